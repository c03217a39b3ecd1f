-- episode_open: open an episode the agent drives through the session gateway (gateway/).
-- KEYS[1] = rb:{ns}:session:<sid>   KEYS[2] = rb:{ns}:episode:<sid> (its spec)
-- ARGV[1] = sid   ARGV[2] = workload   ARGV[3] = spec JSON (broker/episodes.py)   ARGV[4] = now
-- Returns 'ok', or 'exists' when the namespace has seen the id (nothing changes).
-- Invariant: the episode starts 'parked': it holds no KV and sits in no queue until its first
-- call asks for admission (episode_request.lua). Like enqueue, an id is used at most once.
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 'exists'
end
redis.call('HSET', KEYS[1], 'state', 'parked', 'workload', ARGV[2], 'driver', 'agent',
  'enqueued_at', ARGV[4], 'turns', 0)
redis.call('SET', KEYS[2], ARGV[3])
return 'ok'
