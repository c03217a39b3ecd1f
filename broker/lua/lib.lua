-- lib: helpers every script in this folder starts with (broker/scripts.py puts this file in
-- front of each; a script uses what it needs).
--
-- retire(skey, bkey, settings, drop_body): a session has reached its end state (done, failed,
-- cancelled, dead_lettered). Its state hash stays for the namespace's retention window
-- (settings field 'session_retention_s', default DEFAULT_SESSION_RETENTION_S; `GET
-- /sessions/<id>` and duplicate-id refusal within it), then expires. Its body is deleted now
-- when nothing can read it again (`drop_body`), else it expires with the hash (a cancelled
-- pending session's queue entry is still on its way to the broker, which reads the body).
-- Finishing after the hash expired is refused as 'stale' (finish.lua), so retention never
-- lets a result be published twice.
local DEFAULT_SESSION_RETENTION_S = 3600
local function retire(skey, bkey, settings, drop_body)
  local s = tonumber(redis.call('HGET', settings, 'session_retention_s') or '')
  local ms = math.max(1, math.floor((s or DEFAULT_SESSION_RETENTION_S) * 1000))
  redis.call('PEXPIRE', skey, ms)
  if drop_body then
    redis.call('DEL', bkey)
  else
    redis.call('PEXPIRE', bkey, ms)
  end
end

-- release_charge(ledger, sessions, sid, workload): the session's KV reservation leaves its
-- backend's ledger exactly (its entry in ledger:<b>:sessions, and as much of `reserved` and
-- `w:<workload>`), and the ledger's version moves (broker/snapshot.py reads by it). Returns
-- the charge released (0 if it held none).
local function release_charge(ledger, sessions, sid, workload)
  local charge = tonumber(redis.call('HGET', sessions, sid) or '0')
  redis.call('HDEL', sessions, sid)
  redis.call('HINCRBY', ledger, 'ver', 1)
  redis.call('HINCRBY', ledger, 'reserved', -charge)
  redis.call('HINCRBY', ledger, 'w:' .. workload, -charge)
  return charge
end
