-- checkpoint: keep what a running multi-turn session has done so far, so that it survives its
-- worker (or engine) dying: a requeue that is given no new body uses it (requeue.lua).
-- KEYS[1] = rb:{ns}:session:<sid>
-- ARGV[1] = backend id   ARGV[2] = the session body to go on from (with `resume_from`)
-- Returns 1 when stored, 0 when the session no longer runs on this backend.
-- Invariant: only the backend a session runs on writes its checkpoint; every requeue and
-- finish removes it, so a checkpoint never outlives the run that wrote it.
local st = redis.call('HMGET', KEYS[1], 'state', 'backend')
if st[1] ~= 'running' or st[2] ~= ARGV[1] then
  return 0
end
redis.call('HSET', KEYS[1], 'checkpoint', ARGV[2])
return 1
