-- enqueue: add a batch of sessions, skipping ids the namespace has seen before.
-- KEYS[2i-1] = rb:{ns}:session:<sid_i>       KEYS[2i] = rb:{ns}:pending:<workload_i>
-- ARGV[1] = now (unix seconds)
-- ARGV[3i-1] = sid_i   ARGV[3i] = workload_i   ARGV[3i+1] = session JSON_i
-- Returns: a list with 1 for each session added, 0 for each id that already existed.
-- Invariant: a session id is enqueued at most once, ever: its state hash and its one pending
-- entry are created together, and an id whose hash exists is left untouched.
local out = {}
local n = #KEYS / 2
for i = 1, n do
  local skey = KEYS[2 * i - 1]
  if redis.call('EXISTS', skey) == 1 then
    out[i] = 0
  else
    local sid, workload, body = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
    local id = redis.call('XADD', KEYS[2 * i], '*', 'sid', sid, 'session', body)
    redis.call('HSET', skey, 'state', 'pending', 'workload', workload, 'session', body,
      'enqueued_at', ARGV[1], 'pending_entry', id)
    out[i] = 1
  end
end
return out
