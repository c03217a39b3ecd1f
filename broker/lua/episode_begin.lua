-- episode_begin: a gateway starts one of an episode's calls on the backend it is admitted to.
-- KEYS[1] = rb:{ns}:session:<sid>   KEYS[2] = rb:{ns}:idle (sorted set: sid -> the time its
-- charge may be released, read by the broker)
-- ARGV[1] = sid   ARGV[2] = backend id   ARGV[3] = now   ARGV[4] = the call's deadline (unix s)
-- Returns 'ok', or the state ('pending', 'parked', a terminal one) or 'moved' (admitted elsewhere
-- since the caller read it): the caller reads the episode again.
-- Invariant: while a call runs the broker does not release the episode's charge (its idle
-- time is the call's deadline, so a gateway killed mid-call releases it then).
local st = redis.call('HMGET', KEYS[1], 'state', 'backend')
if st[1] ~= 'admitted' and st[1] ~= 'running' then
  return st[1] or 'unknown'
end
if st[2] ~= ARGV[2] then
  return 'moved'
end
if st[1] == 'admitted' then
  redis.call('HSET', KEYS[1], 'state', 'running', 'running_at', ARGV[3])
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return 'ok'
