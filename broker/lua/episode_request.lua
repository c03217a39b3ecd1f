-- episode_request: a parked episode's call asks to be admitted.
-- KEYS[1] = rb:{ns}:session:<sid>   KEYS[2] = rb:{ns}:body:<sid>
-- KEYS[3] = the queue: rb:{ns}:pending:<w> for its first admission, rb:{ns}:requeue:<w> (the
--           front) for one whose charge was released while the agent idled
-- KEYS[4] = rb:{ns}:events
-- ARGV[1] = sid   ARGV[2] = the stored body (broker/body.py): the session as it goes on, its
-- prompt the whole context so far, so the policy charges what the next calls hold
-- ARGV[3] = now
-- Returns 'queued', or the state the episode is in instead ('pending', 'admitted', 'running':
-- nothing to do; 'done', 'failed', 'cancelled': it has ended; 'unknown').
-- Invariant: only a parked episode enters a queue, exactly once per request: its body, its
-- queue entry and its state 'pending' are written together.
local state = redis.call('HGET', KEYS[1], 'state')
if not state then
  return 'unknown'
end
if state ~= 'parked' then
  return state
end
local id = redis.call('XADD', KEYS[3], '*', 'sid', ARGV[1])
redis.call('SET', KEYS[2], ARGV[2])
redis.call('HSET', KEYS[1], 'state', 'pending', 'pending_entry', id)
redis.call('HDEL', KEYS[1], 'requeued_from')
redis.call('XADD', KEYS[4], 'MAXLEN', '~', '10000', '*', 'kind', 'episode', 'backend', '')
return 'queued'
