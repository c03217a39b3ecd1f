-- reclaim: take back the sessions of a backend whose heartbeat expired.
-- KEYS[1] = rb:{ns}:lease   KEYS[2] = rb:{ns}:hb:<b>   KEYS[3] = rb:{ns}:ledger:<b>
-- KEYS[4] = rb:{ns}:ledger:<b>:sessions   KEYS[5] = rb:{ns}:admitted:<b>   KEYS[6] = rb:{ns}:events
-- KEYS[5+2i] = rb:{ns}:session:<sid_i>    KEYS[6+2i] = rb:{ns}:requeue:<workload_i>
-- ARGV[1] = lease token   ARGV[2] = backend id   ARGV[3] = now   ARGV[3+i] = sid_i
-- Returns the number of sessions requeued, or 'lease' / 'alive' (heartbeat back: do nothing).
-- Invariant: each listed session still admitted/running on this backend moves, in one step,
-- from the backend's ledger to the front of its workload (the requeue stream) with state
-- 'pending' (the entry keeps the original enqueue time); its reservation is released exactly. When the backend has no sessions left its
-- admitted stream is dropped (a returning worker registers again).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'lease'
end
if redis.call('EXISTS', KEYS[2]) == 1 then
  return 'alive'
end
local moved = 0
local n = (#KEYS - 6) / 2
for i = 1, n do
  local skey, rkey, sid = KEYS[5 + 2 * i], KEYS[6 + 2 * i], ARGV[3 + i]
  local st = redis.call('HMGET', skey, 'state', 'backend', 'workload', 'session', 'enqueued_at')
  local charge = redis.call('HGET', KEYS[4], sid)
  if charge then
    redis.call('HDEL', KEYS[4], sid)
    redis.call('HINCRBY', KEYS[3], 'reserved', -tonumber(charge))
    if st[3] then
      redis.call('HINCRBY', KEYS[3], 'w:' .. st[3], -tonumber(charge))
    end
  end
  if (st[1] == 'admitted' or st[1] == 'running') and st[2] == ARGV[2] then
    local id = redis.call('XADD', rkey, '*', 'sid', sid, 'session', st[4],
      'enqueued_at', st[5] or ARGV[3])
    redis.call('HSET', skey, 'state', 'pending', 'pending_entry', id, 'requeued_at', ARGV[3])
    redis.call('HDEL', skey, 'backend', 'reserved', 'admitted_at', 'admitted_entry', 'running_at')
    moved = moved + 1
  end
end
if redis.call('HLEN', KEYS[4]) == 0 then
  redis.call('DEL', KEYS[5])
end
if moved > 0 then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', '10000', '*', 'kind', 'reclaim', 'backend', ARGV[2])
end
return moved
