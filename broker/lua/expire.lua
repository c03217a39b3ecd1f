-- expire: a pending session staler than the namespace's bound ends failed, never admitted.
-- KEYS[1] = rb:{ns}:lease   KEYS[2] = rb:{ns}:session:<sid>
-- KEYS[3] = the stream its entry came from (rb:{ns}:pending:<w> or rb:{ns}:requeue:<w>)
-- KEYS[4] = rb:{ns}:results   KEYS[5] = rb:{ns}:settings   KEYS[6] = rb:{ns}:body:<sid>
-- KEYS[7] = rb:{ns}:kvsec (counts the result: 'n:<workload>', 'failed:<workload>', as finish.lua)
-- ARGV[1] = lease token   ARGV[2] = sid   ARGV[3] = source entry id   ARGV[4] = now
-- ARGV[5] = SessionResult JSON (status failed, the reason in `error`)   ARGV[6] = the reason
-- Returns 'ok'; 'lease' (caller is not the active broker); 'not_pending' (cancelled or placed
-- meanwhile: its stale entry is acked, nothing published).
-- Invariant: at most one results entry per session; on 'ok' the session leaves its queue and
-- is 'failed' (and retired, lib.lua) in the same step.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'lease'
end
local st = redis.call('HMGET', KEYS[2], 'state', 'workload')
redis.call('XACK', KEYS[3], 'broker', ARGV[3])
redis.call('XDEL', KEYS[3], ARGV[3])
if st[1] ~= 'pending' then
  return 'not_pending'
end
redis.call('XADD', KEYS[4], '*', 'sid', ARGV[2], 'workload', st[2], 'status', 'failed',
  'result', ARGV[5], 'stats', '{}')
redis.call('HSET', KEYS[2], 'state', 'failed', 'finished_at', ARGV[4], 'last_error', ARGV[6])
retire(KEYS[2], KEYS[6], KEYS[5], true)
redis.call('HINCRBY', KEYS[7], 'n:' .. st[2], 1)
redis.call('HINCRBY', KEYS[7], 'failed:' .. st[2], 1)
return 'ok'
