-- admit: reserve KV for a pending session on a backend and hand it to that backend's worker.
-- KEYS[1] = rb:{ns}:lease                 KEYS[2] = rb:{ns}:session:<sid>
-- KEYS[3] = rb:{ns}:ledger:<b>            KEYS[4] = rb:{ns}:ledger:<b>:sessions
-- KEYS[5] = rb:{ns}:hb:<b>                KEYS[6] = rb:{ns}:admitted:<b>
-- KEYS[7] = the stream the entry came from (rb:{ns}:pending:<w> or rb:{ns}:requeue:<w>)
-- ARGV[1] = lease token   ARGV[2] = sid   ARGV[3] = backend id   ARGV[4] = reserved tokens
-- ARGV[5] = source entry id   ARGV[6] = now (unix seconds)
-- ARGV[7] = '1' to enforce the limit (admission policies); '0' for a router baseline that
--           dispatches on arrival and lets the engine queue (it is charged, never refused)
-- Returns 'ok', or an expected refusal: 'lease' (caller is not the active broker),
-- 'not_pending' (cancelled or already placed; its stale entry is acked), 'no_backend',
-- 'unhealthy' (no fresh heartbeat), 'no_capacity', 'bad_charge'.
-- Invariants, all or nothing: after 'ok' with ARGV[7] = '1', reserved <= floor(alpha * capacity),
-- reserved == sum of the backend's per-session reservations == sum of its w:<workload> fields,
-- and the session is in exactly one place: acked+deleted from its source stream, present in
-- admitted:<b>, state 'admitted'. After a refusal nothing has changed (except a stale ack).
-- The admitted entry carries no body: the worker reads it from rb:{ns}:body:<sid> (or, for a
-- session enqueued by an earlier version, from its hash's 'session' field).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'lease'
end
local state = redis.call('HGET', KEYS[2], 'state')
if state ~= 'pending' then
  redis.call('XACK', KEYS[7], 'broker', ARGV[5])
  redis.call('XDEL', KEYS[7], ARGV[5])
  return 'not_pending'
end
local led = redis.call('HMGET', KEYS[3], 'capacity', 'alpha', 'reserved')
if not led[1] then
  return 'no_backend'
end
if redis.call('EXISTS', KEYS[5]) == 0 then
  return 'unhealthy'
end
local charge = tonumber(ARGV[4])
if charge == nil or charge < 0 or charge ~= math.floor(charge) then
  return 'bad_charge'
end
local capacity = tonumber(led[1])
local alpha = tonumber(led[2] or '1')
local reserved = tonumber(led[3] or '0')
if ARGV[7] ~= '0' and reserved + charge > math.floor(alpha * capacity) then
  return 'no_capacity'
end
local sid = ARGV[2]
local workload = redis.call('HGET', KEYS[2], 'workload')
redis.call('HINCRBY', KEYS[3], 'reserved', charge)
redis.call('HINCRBY', KEYS[3], 'w:' .. workload, charge)
redis.call('HSET', KEYS[4], sid, charge)
redis.call('HINCRBY', KEYS[3], 'ver', 1)  -- the sessions changed (broker/snapshot.py reads by it)
local eid = redis.call('XADD', KEYS[6], '*', 'sid', sid, 'reserved', charge)
redis.call('XACK', KEYS[7], 'broker', ARGV[5])
redis.call('XDEL', KEYS[7], ARGV[5])
redis.call('HSET', KEYS[2], 'state', 'admitted', 'backend', ARGV[3], 'reserved', charge,
  'admitted_at', ARGV[6], 'admitted_entry', eid)
return 'ok'
