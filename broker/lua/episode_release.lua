-- episode_release: the broker releases the KV charge of an episode whose agent has made no call
-- for the idle timeout; its next call asks for admission again (episode_request.lua).
-- KEYS[1] = rb:{ns}:lease   KEYS[2] = rb:{ns}:session:<sid>   KEYS[3] = rb:{ns}:ledger:<b>
-- KEYS[4] = rb:{ns}:ledger:<b>:sessions   KEYS[5] = rb:{ns}:idle   KEYS[6] = rb:{ns}:events
-- ARGV[1] = lease token   ARGV[2] = sid   ARGV[3] = backend id (as the caller read it)   ARGV[4] = now
-- Returns 'released'; 'lease'; 'busy' (a call started, or one finished, since the caller read
-- the idle set: nothing changes); 'gone' (not placed on that backend any more: its idle entry
-- is dropped).
-- Invariant: the reservation leaves the ledger exactly (reserved and w:<workload> drop by it)
-- in the same step as the episode becomes 'parked'.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'lease'
end
local due = tonumber(redis.call('ZSCORE', KEYS[5], ARGV[2]) or '')
if not due then
  return 'gone'
end
if due > tonumber(ARGV[4]) then
  return 'busy'
end
local st = redis.call('HMGET', KEYS[2], 'state', 'backend', 'workload')
redis.call('ZREM', KEYS[5], ARGV[2])
if (st[1] ~= 'admitted' and st[1] ~= 'running') or st[2] ~= ARGV[3] then
  return 'gone'
end
release_charge(KEYS[3], KEYS[4], ARGV[2], st[3])
redis.call('HSET', KEYS[2], 'state', 'parked', 'parked_from', ARGV[3], 'parked_at', ARGV[4])
redis.call('HDEL', KEYS[2], 'backend', 'reserved', 'admitted_at', 'admitted_entry', 'running_at')
redis.call('HINCRBY', KEYS[2], 'releases', 1)
redis.call('XADD', KEYS[6], 'MAXLEN', '~', '10000', '*', 'kind', 'release', 'backend', ARGV[3])
return 'released'
