-- status: read everything GET /v1/status shows in one call, without scanning any queue.
-- KEYS[1] = rb:{ns}:mixture   KEYS[2] = rb:{ns}:consumed   KEYS[3] = rb:{ns}:kvsec
-- KEYS[4] = rb:{ns}:lease     KEYS[5] = rb:{ns}:results    KEYS[6] = rb:{ns}:dead
-- KEYS[7] = rb:{ns}:workloads KEYS[8] = rb:{ns}:backends
-- then per workload w (ARGV[1] of them):  rb:{ns}:pending:<w>, rb:{ns}:requeue:<w>
-- then per backend b (ARGV[2] of them):   rb:{ns}:ledger:<b>, rb:{ns}:ledger:<b>:sessions,
--                                          rb:{ns}:hb:<b>, rb:{ns}:admitted:<b>
-- ARGV[1] = number of workloads   ARGV[2] = number of backends
-- The caller names the workloads and backends it knew from its last call; the index sets come
-- back too, and a caller whose names differ from them calls again with the new names (so one
-- round trip suffices while the fleet does not change).
-- Returns one JSON document (floats survive JSON; a Lua number returned bare is truncated):
-- {index_workloads, index_backends: the sets' members;
--  mixture, consumed, kvsec: flat field/value lists; lease: the holder's token ('' if none:
--  "<policy>@<consumer>/<nonce>", see broker/lease.py); results, dead: lengths;
--  workloads: [[pending len, requeue len, first pending id|'', first requeue enqueued_at|'']];
--  backends: [[ledger flat list, resident sessions, heartbeat metrics|false, entries added|-1]]}
-- Read-only: it writes nothing. Cost: O(workloads + backends), each stream read is XLEN or one
-- entry, whatever the queue lengths; only a heartbeat's metrics are decoded, and only they travel.
local nw, nb = tonumber(ARGV[1]), tonumber(ARGV[2])
local out = {
  mixture = redis.call('HGETALL', KEYS[1]),
  consumed = redis.call('HGETALL', KEYS[2]),
  kvsec = redis.call('HGETALL', KEYS[3]),
  lease = redis.call('GET', KEYS[4]) or '',
  results = redis.call('XLEN', KEYS[5]),
  dead = redis.call('XLEN', KEYS[6]),
  index_workloads = redis.call('SMEMBERS', KEYS[7]),
  index_backends = redis.call('SMEMBERS', KEYS[8]),
  workloads = {},
  backends = {},
}
local function first(stream)
  local e = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)
  return e[1]
end
for i = 0, nw - 1 do
  local pk, rk = KEYS[9 + 2 * i], KEYS[10 + 2 * i]
  local p, r = first(pk), first(rk)
  local requeued_at = ''
  if r then
    for j = 1, #r[2], 2 do
      if r[2][j] == 'enqueued_at' then requeued_at = r[2][j + 1] end
    end
    if requeued_at == '' then requeued_at = r[1] end
  end
  out.workloads[i + 1] = {redis.call('XLEN', pk), redis.call('XLEN', rk), p and p[1] or '', requeued_at}
end
local base = 9 + 2 * nw
for i = 0, nb - 1 do
  local lk, sk, hk, ak = KEYS[base + 4 * i], KEYS[base + 4 * i + 1], KEYS[base + 4 * i + 2], KEYS[base + 4 * i + 3]
  local metrics = false
  local raw = redis.call('GET', hk)
  if raw then
    -- Decoding only the flat "metrics" object and "at" (a record's per-session progress can
    -- be thousands of objects); ids cannot hold quotes, so these keys cannot appear in a value.
    local ok, m = pcall(cjson.decode, string.match(raw, '"metrics"%s*:%s*(%b{})') or 'null')
    local at = tonumber(string.match(raw, '"at"%s*:%s*([-+%d.eE]+)'))
    if ok and type(m) == 'table' and at then
      m.at = at
      -- On an engine several namespaces share: this namespace's part (a flat object too).
      local sok, part = pcall(cjson.decode, string.match(raw, '"shared"%s*:%s*(%b{})') or 'null')
      if sok and type(part) == 'table' then m.shared = part end
      metrics = m
    end
  end
  local added = -1
  if redis.call('EXISTS', ak) == 1 then
    local info = redis.call('XINFO', 'STREAM', ak)
    for j = 1, #info, 2 do
      if info[j] == 'entries-added' then added = info[j + 1] end
    end
  end
  out.backends[i + 1] = {redis.call('HGETALL', lk), redis.call('HLEN', sk), metrics, added}
end
return cjson.encode(out)
