-- finish: publish a session's one result and release its KV reservation.
-- KEYS[1] = rb:{ns}:session:<sid>          KEYS[2] = rb:{ns}:ledger:<b>
-- KEYS[3] = rb:{ns}:ledger:<b>:sessions    KEYS[4] = rb:{ns}:admitted:<b>
-- KEYS[5] = rb:{ns}:results                KEYS[6] = rb:{ns}:events
-- KEYS[7] = rb:{ns}:kvsec
-- ARGV[1] = sid   ARGV[2] = backend id   ARGV[3] = status ('done' | 'failed')
-- ARGV[4] = SessionResult JSON   ARGV[5] = completion stats JSON   ARGV[6] = now
-- ARGV[7] = KV-token-seconds the session held
-- Returns 'ok'; 'duplicate' when the session is already done/failed/cancelled (nothing changes);
-- 'stale' when the session is not admitted/running on this backend (e.g. requeued after its
-- heartbeat expired), so a zombie worker cannot publish.
-- Invariant: at most one results entry per session, ever; on 'ok' the session's reservation
-- leaves the ledger (reserved and w:<workload> drop by exactly that amount) in the same step.
if ARGV[3] ~= 'done' and ARGV[3] ~= 'failed' then
  return redis.error_reply('finish: status must be done or failed')
end
local st = redis.call('HMGET', KEYS[1], 'state', 'backend', 'workload', 'admitted_entry')
local state = st[1]
if state == 'done' or state == 'failed' or state == 'cancelled' then
  return 'duplicate'
end
if (state ~= 'admitted' and state ~= 'running') or st[2] ~= ARGV[2] then
  return 'stale'
end
local sid, workload = ARGV[1], st[3]
local charge = tonumber(redis.call('HGET', KEYS[3], sid) or '0')
redis.call('HDEL', KEYS[3], sid)
redis.call('HINCRBY', KEYS[2], 'reserved', -charge)
redis.call('HINCRBY', KEYS[2], 'w:' .. workload, -charge)
redis.call('XADD', KEYS[5], '*', 'sid', sid, 'workload', workload, 'status', ARGV[3],
  'result', ARGV[4], 'stats', ARGV[5])
if st[4] then
  redis.call('XACK', KEYS[4], 'workers', st[4])
  redis.call('XDEL', KEYS[4], st[4])
end
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finished_at', ARGV[6])
redis.call('HINCRBYFLOAT', KEYS[7], workload, ARGV[7])
redis.call('HINCRBY', KEYS[7], 'n:' .. workload, 1)
redis.call('XADD', KEYS[6], 'MAXLEN', '~', '10000', '*', 'kind', 'finish', 'backend', ARGV[2])
return 'ok'
