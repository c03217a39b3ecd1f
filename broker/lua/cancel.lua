-- cancel: the trainer withdraws a session that has not finished.
-- KEYS[1] = rb:{ns}:session:<sid>   KEYS[2] = rb:{ns}:ledger:<b>
-- KEYS[3] = rb:{ns}:ledger:<b>:sessions   KEYS[4] = rb:{ns}:admitted:<b>   KEYS[5] = rb:{ns}:events
-- KEYS[6] = rb:{ns}:control (the workers' order stream: a running session's worker stops it)
-- KEYS[7] = rb:{ns}:settings   KEYS[8] = rb:{ns}:body:<sid>
-- ARGV[1] = sid   ARGV[2] = the backend the caller read from the session hash ('' if none)
-- ARGV[3] = now
-- Returns 'cancelled'; the current terminal state ('done', 'failed', 'cancelled',
-- 'dead_lettered'); 'unknown'; or 'retry' when the session's backend is not ARGV[2] (it moved:
-- read it again).
-- Invariant: a cancelled session publishes no result; a pending one keeps its stream entry,
-- which admit acks as stale; an admitted/running one releases its reservation exactly and
-- leaves its backend's stream in the same step. A cancelled session is retired (lib.lua); a
-- pending one keeps its body until its hash expires, for the broker to read its entry.
local st = redis.call('HMGET', KEYS[1], 'state', 'backend', 'workload', 'admitted_entry')
local state = st[1]
if not state then
  return 'unknown'
end
if state == 'done' or state == 'failed' or state == 'cancelled' or state == 'dead_lettered' then
  return state
end
if state == 'pending' or state == 'parked' then  -- parked: an agent's episode holding no KV
  redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[3])
  retire(KEYS[1], KEYS[8], KEYS[7], state == 'parked')
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', '10000', '*', 'kind', 'cancel', 'backend', '')
  return 'cancelled'
end
if st[2] ~= ARGV[2] then
  return 'retry'
end
release_charge(KEYS[2], KEYS[3], ARGV[1], st[3])
if st[4] then
  redis.call('XACK', KEYS[4], 'workers', st[4])
  redis.call('XDEL', KEYS[4], st[4])
end
redis.call('HSET', KEYS[1], 'state', 'cancelled', 'finished_at', ARGV[3])
retire(KEYS[1], KEYS[8], KEYS[7], true)
redis.call('XADD', KEYS[5], 'MAXLEN', '~', '10000', '*', 'kind', 'cancel', 'backend', ARGV[2])
if state == 'running' then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', '1000', '*', 'op', 'cancel', 'session', ARGV[1],
             'backend', ARGV[2])
end
return 'cancelled'
