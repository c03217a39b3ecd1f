-- requeue: take sessions back from backend b to the front of their workload's queue.
-- KEYS[1] = rb:{ns}:lease   KEYS[2] = rb:{ns}:hb:<b>   KEYS[3] = rb:{ns}:ledger:<b>
-- KEYS[4] = rb:{ns}:ledger:<b>:sessions   KEYS[5] = rb:{ns}:admitted:<b>
-- KEYS[6] = rb:{ns}:events   KEYS[7] = rb:{ns}:results   KEYS[8] = rb:{ns}:settings
-- KEYS[9] = rb:{ns}:kvsec (a failed result counts there as finish.lua counts it)
-- KEYS[7+3i] = rb:{ns}:session:<sid_i>    KEYS[8+3i] = rb:{ns}:requeue:<workload_i>
-- KEYS[9+3i] = rb:{ns}:body:<sid_i>
-- ARGV[1] = the broker's lease token, or '' when the backend's own worker hands sessions back
-- ARGV[2] = backend id   ARGV[3] = now   ARGV[4] = why (kept as the session's last_error)
-- ARGV[5] = 'dead' (only if the backend's heartbeat is gone) or 'any'   ARGV[5+i] = sid_i
-- ARGV[5+n+i] (optional) = a new stored body for sid_i ('' keeps it): a draining worker's
-- session with the output it had generated (`resume_from`), so it goes on from there. Without
-- one, the session's last checkpoint (checkpoint.lua: its finished turns) is the body.
-- The broker passes its token (returns 'lease' unless it holds the lease): 'dead' for a
-- backend whose heartbeat expired (returns 'alive', doing nothing, if it is back; drops the
-- admitted stream once the backend holds nothing, so its worker registers again), 'any' for
-- sessions a live backend's worker lost. The worker passes '' and 'any' for sessions its
-- engine could not serve.
-- Returns {requeued, failed}.
-- Invariant: each listed session still admitted/running on this backend leaves it in one step:
-- its reservation is released exactly and its admitted entry acked and deleted. A session that
-- was running counts an attempt; if that reaches the session's max_attempts it ends 'failed'
-- with one published result naming why (and is retired, lib.lua), else it goes to the front
-- of its workload (the requeue stream) as 'pending', keeping its original enqueue time, with
-- requeued_from = b so a late finish from b is still accepted while nobody else has it (see
-- finish.lua). Its requeue entry carries the id and enqueue time only; the body stays in (or,
-- for a session enqueued by an earlier version, moves from the hash's 'session' field to)
-- rb:{ns}:body:<sid>.
if ARGV[1] ~= '' and redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 'lease'
end
local dead = ARGV[5] == 'dead'
if dead and redis.call('EXISTS', KEYS[2]) == 1 then
  return 'alive'
end
local requeued, failed = 0, 0
local n = (#KEYS - 9) / 3
for i = 1, n do
  local skey, rkey, bkey, sid = KEYS[7 + 3 * i], KEYS[8 + 3 * i], KEYS[9 + 3 * i], ARGV[5 + i]
  local st = redis.call('HMGET', skey, 'state', 'backend', 'workload', 'session', 'enqueued_at',
    'admitted_entry', 'attempts', 'checkpoint')
  local body = ARGV[5 + n + i]
  if (not body or body == '') and st[8] then
    body = st[8]
  end
  local charge = redis.call('HGET', KEYS[4], sid)
  if charge then
    redis.call('HDEL', KEYS[4], sid)
    redis.call('HINCRBY', KEYS[3], 'ver', 1)  -- the sessions changed (broker/snapshot.py reads by it)
    redis.call('HINCRBY', KEYS[3], 'reserved', -tonumber(charge))
    if st[3] then
      redis.call('HINCRBY', KEYS[3], 'w:' .. st[3], -tonumber(charge))
    end
  end
  if (st[1] == 'admitted' or st[1] == 'running') and st[2] == ARGV[2] then
    if st[6] then
      redis.call('XACK', KEYS[5], 'workers', st[6])
      redis.call('XDEL', KEYS[5], st[6])
    end
    local attempts = tonumber(st[7] or '0')
    if st[1] == 'running' then
      attempts = attempts + 1
    end
    local stored = redis.call('GET', bkey)
    if body and body ~= '' then
      stored = body
      redis.call('SET', bkey, body)
    elseif not stored and st[4] then
      stored = st[4]
      redis.call('SET', bkey, stored)
    end
    if st[4] then
      redis.call('HDEL', skey, 'session')
    end
    local ok, session = pcall(cjson.decode, stored or '')
    local max_attempts = 3
    if ok and type(session) == 'table' and tonumber(session.max_attempts) then
      max_attempts = tonumber(session.max_attempts)
    end
    redis.call('HDEL', skey, 'backend', 'reserved', 'admitted_at', 'admitted_entry', 'running_at',
      'checkpoint')
    if attempts >= max_attempts then
      local why = 'gave up after ' .. attempts .. ' attempts; the last: ' .. ARGV[4]
      local result = {session_id = sid, workload = st[3], status = 'failed', backend_id = ARGV[2],
        error = why, enqueued_at = tonumber(st[5]), finished_at = tonumber(ARGV[3])}
      if ok and type(session) == 'table' then
        result.group_id = session.group_id
        result.group_size = session.group_size
        result.policy_version = session.policy_version
      end
      redis.call('XADD', KEYS[7], '*', 'sid', sid, 'workload', st[3], 'status', 'failed',
        'result', cjson.encode(result), 'stats', '{}')
      redis.call('HSET', skey, 'state', 'failed', 'finished_at', ARGV[3], 'attempts', attempts,
        'last_error', ARGV[4])
      retire(skey, bkey, KEYS[8], true)
      redis.call('HINCRBY', KEYS[9], 'n:' .. st[3], 1)
      redis.call('HINCRBY', KEYS[9], 'failed:' .. st[3], 1)
      failed = failed + 1
    else
      local id = redis.call('XADD', rkey, '*', 'sid', sid, 'enqueued_at', st[5] or ARGV[3])
      redis.call('HSET', skey, 'state', 'pending', 'pending_entry', id, 'requeued_at', ARGV[3],
        'requeued_from', ARGV[2], 'attempts', attempts, 'last_error', ARGV[4])
      requeued = requeued + 1
    end
  end
end
if dead and redis.call('HLEN', KEYS[4]) == 0 then
  redis.call('DEL', KEYS[5])
end
if requeued + failed > 0 then
  redis.call('XADD', KEYS[6], 'MAXLEN', '~', '10000', '*', 'kind', 'requeue', 'backend', ARGV[2])
end
return {requeued, failed}
