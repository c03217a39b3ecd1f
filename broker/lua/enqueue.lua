-- enqueue: add a batch of sessions, skipping ids the namespace has seen before.
-- KEYS[3i-2] = rb:{ns}:session:<sid_i>   KEYS[3i-1] = rb:{ns}:pending:<workload_i>
-- KEYS[3i] = rb:{ns}:body:<sid_i>
-- ARGV[1] = now (unix seconds)
-- ARGV[3i-1] = sid_i   ARGV[3i] = workload_i   ARGV[3i+1] = stored body_i (broker/body.py)
-- Returns: a list with 1 for each session added, 0 for each id that already existed.
-- Invariant: a session id is enqueued at most once, ever: its state hash, its body and its one
-- pending entry are created together, and an id whose hash exists is left untouched. The body
-- is stored once, in its own key; the entry carries only the id.
local out = {}
local n = #KEYS / 3
for i = 1, n do
  local skey = KEYS[3 * i - 2]
  if redis.call('EXISTS', skey) == 1 then
    out[i] = 0
  else
    local sid, workload, body = ARGV[3 * i - 1], ARGV[3 * i], ARGV[3 * i + 1]
    local id = redis.call('XADD', KEYS[3 * i - 1], '*', 'sid', sid)
    redis.call('SET', KEYS[3 * i], body)
    redis.call('HSET', skey, 'state', 'pending', 'workload', workload, 'enqueued_at', ARGV[1],
      'pending_entry', id)
    out[i] = 1
  end
end
return out
