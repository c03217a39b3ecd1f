-- finish: publish a session's one result and release its KV reservation.
-- KEYS[1] = rb:{ns}:session:<sid>          KEYS[2] = rb:{ns}:ledger:<b>
-- KEYS[3] = rb:{ns}:ledger:<b>:sessions    KEYS[4] = rb:{ns}:admitted:<b>
-- KEYS[5] = rb:{ns}:results                KEYS[6] = rb:{ns}:events
-- KEYS[7] = rb:{ns}:kvsec                  KEYS[8] = rb:{ns}:requeue:<workload>
-- KEYS[9] = rb:{ns}:stats                  KEYS[10] = rb:{ns}:settings
-- KEYS[11] = rb:{ns}:body:<sid>            KEYS[12] = rb:{ns}:completions
-- ARGV[1] = sid   ARGV[2] = backend id   ARGV[3] = status ('done' | 'failed')
-- ARGV[4] = SessionResult JSON   ARGV[5] = completion stats JSON   ARGV[6] = now
-- ARGV[7] = KV-token-seconds the session held   ARGV[8] = its output tokens
-- ARGV[9] = the completion the broker learns from (JSON, broker/completions.py), added to the
-- capped completions stream: the results stream loses an entry when the trainer acknowledges
-- it, maybe before the broker read it.
-- On 'ok' the kvsec hash counts, per workload: the KV-token-seconds (field <workload>), the
-- results ('n:'), their output tokens ('tok:'), the failed ones ('failed:') and their latency
-- since enqueue in √2-wide buckets ('lat:<workload>:<bucket>', broker/latency.py).
-- Returns 'ok'; 'duplicate' when the session is already done/failed/cancelled (nothing changes);
-- 'stale' when the session is now another backend's (re-admitted there after this one was
-- taken for dead), so the same session is never published twice.
-- First finish wins: a session taken back from this backend (requeued_from = b, see
-- requeue.lua) that nobody has admitted since is still this backend's to finish; its requeue
-- entry is removed in the same step, so it is never run again.
-- Invariant: at most one results entry per session, ever; on 'ok' the session's reservation
-- (if it still holds one) leaves the ledger (reserved and w:<workload> drop by exactly that
-- amount) in the same step. A refused finish counts in stats field 'stale_finishes'. On 'ok'
-- the session is retired (lib.lua): its body goes, its hash expires after the retention window;
-- a finish after that finds no state and is refused as 'stale'.
-- An episode the agent drives (session field driver = 'agent', closed by the trainer) may end
-- holding no KV: 'parked' (its charge released while the agent idled), or 'pending' waiting
-- for a call's admission (its queue entry stays for the broker, whose admit acks it as
-- 'not_pending', so its body is kept until the hash expires, as cancel.lua keeps it).
if ARGV[3] ~= 'done' and ARGV[3] ~= 'failed' then
  return redis.error_reply('finish: status must be done or failed')
end
local st = redis.call('HMGET', KEYS[1], 'state', 'backend', 'workload', 'admitted_entry',
  'requeued_from', 'pending_entry', 'enqueued_at', 'driver')
local state = st[1]
if state == 'done' or state == 'failed' or state == 'cancelled' or state == 'dead_lettered' then
  return 'duplicate'
end
local sid, workload = ARGV[1], st[3]
local keep_body = false
if st[8] == 'agent' and (state == 'parked' or (state == 'pending' and ARGV[2] == '')) then
  keep_body = state == 'pending'
elseif state == 'pending' and st[5] == ARGV[2] then
  if st[6] then
    redis.call('XACK', KEYS[8], 'broker', st[6])
    redis.call('XDEL', KEYS[8], st[6])
  end
elseif (state == 'admitted' or state == 'running') and st[2] == ARGV[2] then
  release_charge(KEYS[2], KEYS[3], sid, workload)
  if st[4] then
    redis.call('XACK', KEYS[4], 'workers', st[4])
    redis.call('XDEL', KEYS[4], st[4])
  end
else
  redis.call('HINCRBY', KEYS[9], 'stale_finishes', 1)
  return 'stale'
end
redis.call('XADD', KEYS[5], '*', 'sid', sid, 'workload', workload, 'status', ARGV[3],
  'result', ARGV[4], 'stats', ARGV[5])
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'finished_at', ARGV[6])
redis.call('HDEL', KEYS[1], 'checkpoint')
retire(KEYS[1], KEYS[11], KEYS[10], not keep_body)
redis.call('HINCRBYFLOAT', KEYS[7], workload, ARGV[7])
redis.call('HINCRBY', KEYS[7], 'n:' .. workload, 1)
redis.call('HINCRBY', KEYS[7], 'tok:' .. workload, ARGV[8])
redis.call('XADD', KEYS[12], 'MAXLEN', '~', '10000', '*', 'completion', ARGV[9])
if ARGV[3] == 'failed' then
  redis.call('HINCRBY', KEYS[7], 'failed:' .. workload, 1)
end
local enqueued, now = tonumber(st[7]), tonumber(ARGV[6])
if enqueued and now then  -- latency bucket ceil(2·log2 s) in [-14, 25] (broker/latency.py)
  local bucket = -14
  if now - enqueued > 0 then
    bucket = math.ceil(2 * math.log(now - enqueued) / math.log(2) - 1e-9)
  end
  bucket = math.max(-14, math.min(25, bucket))
  redis.call('HINCRBY', KEYS[7], 'lat:' .. workload .. ':' .. string.format('%d', bucket), 1)
end
redis.call('XADD', KEYS[6], 'MAXLEN', '~', '10000', '*', 'kind', 'finish', 'backend', ARGV[2])
return 'ok'
