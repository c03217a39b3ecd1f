-- recharge: change the reservation of a resident session (policy's Decision.recharge).
-- KEYS[1] = rb:{ns}:lease   KEYS[2] = rb:{ns}:session:<sid>
-- KEYS[3] = rb:{ns}:ledger:<b>   KEYS[4] = rb:{ns}:ledger:<b>:sessions
-- ARGV[1] = lease token   ARGV[2] = sid   ARGV[3] = backend id   ARGV[4] = new reservation
-- ARGV[5] = '1' to enforce the limit (admission policies), '0' not (router baselines)
-- Returns 'ok', 'lease', 'stale' (not resident on this backend), 'bad_charge', or
-- 'no_capacity' (an increase that would pass alpha * capacity; nothing changes).
-- Invariant (the rule of broker/decision.py): a decrease always applies; with the limit
-- enforced an increase never takes reserved above floor(alpha * capacity); reserved stays the
-- exact sum of per-session reservations.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'lease'
end
local st = redis.call('HMGET', KEYS[2], 'state', 'backend', 'workload')
if (st[1] ~= 'admitted' and st[1] ~= 'running') or st[2] ~= ARGV[3] then
  return 'stale'
end
local old = tonumber(redis.call('HGET', KEYS[4], ARGV[2]) or '0')
local new = tonumber(ARGV[4])
if new == nil or new < 0 or new ~= math.floor(new) then
  return 'bad_charge'
end
local led = redis.call('HMGET', KEYS[3], 'capacity', 'alpha', 'reserved')
local reserved = tonumber(led[3] or '0')
if ARGV[5] ~= '0' and new > old
    and reserved - old + new > math.floor(tonumber(led[2] or '1') * tonumber(led[1])) then
  return 'no_capacity'
end
redis.call('HSET', KEYS[4], ARGV[2], new)
redis.call('HINCRBY', KEYS[3], 'ver', 1)  -- the sessions changed (broker/snapshot.py reads by it)
redis.call('HINCRBY', KEYS[3], 'reserved', new - old)
redis.call('HINCRBY', KEYS[3], 'w:' .. st[3], new - old)
redis.call('HSET', KEYS[2], 'reserved', new)
return 'ok'
