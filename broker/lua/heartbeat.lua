-- heartbeat: store a backend's latest telemetry and session progress, refresh its TTL.
-- KEYS[1] = rb:{ns}:hb:<b>   KEYS[2] = rb:{ns}:ledger:<b>   KEYS[3] = rb:{ns}:events
-- ARGV[1] = backend id   ARGV[2] = heartbeat JSON   ARGV[3] = TTL in milliseconds
-- Returns 'ok', or 'unregistered' when the backend has no ledger (register first).
-- Invariant: a backend is healthy exactly while its hb key exists; only a heartbeat of a
-- registered backend creates it, and it disappears by itself when heartbeats stop.
if redis.call('EXISTS', KEYS[2]) == 0 then
  return 'unregistered'
end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3])
redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'kind', 'hb', 'backend', ARGV[1])
return 'ok'
