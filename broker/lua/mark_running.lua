-- mark_running: a worker starts running an admitted session.
-- KEYS[1] = rb:{ns}:session:<sid>
-- ARGV[1] = backend id   ARGV[2] = now
-- Returns 'ok' (now running here; also when it already was, so a restarted worker may resume),
-- 'stale' (not placed on this backend any more), or the terminal state ('cancelled', 'done',
-- 'failed', 'dead_lettered'), which tells the worker to drop it.
-- Invariant: only the backend the session is admitted to moves it admitted -> running.
local st = redis.call('HMGET', KEYS[1], 'state', 'backend')
local state = st[1]
if state == 'done' or state == 'failed' or state == 'cancelled' or state == 'dead_lettered' then
  return state
end
if st[2] ~= ARGV[1] or (state ~= 'admitted' and state ~= 'running') then
  return 'stale'
end
if state == 'admitted' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'running_at', ARGV[2])
end
return 'ok'
