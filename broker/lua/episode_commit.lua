-- episode_commit: record one finished call of an episode (its turn records and its reply).
-- KEYS[1] = rb:{ns}:session:<sid>   KEYS[2] = rb:{ns}:episode:<sid>:turns (list of TurnRecord
-- JSON)   KEYS[3] = rb:{ns}:episode:<sid>:reply   KEYS[4] = rb:{ns}:idle
-- KEYS[5] = rb:{ns}:settings (field episode_idle_timeout_s, default DEFAULT_IDLE_TIMEOUT_S)
-- KEYS[6] = rb:{ns}:episode:<sid>:text (a completions episode's text so far)
-- ARGV[1] = sid   ARGV[2] = backend id   ARGV[3] = the episode's calls when this one started
-- ARGV[4] = the call's mark (its message count, or its prompt's length): a call with the same
--           mark is this call again
-- ARGV[5] = the reply (JSON, handed again to a retry of the same call)   ARGV[6] = now
-- ARGV[7] = context tokens after it   ARGV[8] = seconds the agent took before the call
-- ARGV[9] = KV-token-seconds the episode held over that wait and the call
-- ARGV[10] = the text so far for a text completions call ('' for none)
-- ARGV[11..] = the call's TurnRecord JSONs
-- Returns 'ok'; 'conflict' when another call was recorded since ARGV[3] (a retried call that
-- two gateways both ran: the first recorded wins, the caller hands over its reply); or the
-- terminal state ('done', 'failed', 'cancelled', 'unknown'), recording nothing.
-- Invariant: the turns list holds each call's records once, in order, `turns` counting the
-- calls; the tokens a record holds are what the engine consumed and produced. An episode still
-- placed on the backend may have its charge released once the idle timeout passes with no call.
local DEFAULT_IDLE_TIMEOUT_S = 30
local st = redis.call('HMGET', KEYS[1], 'state', 'backend', 'turns')
local state = st[1]
if not state or state == 'done' or state == 'failed' or state == 'cancelled'
    or state == 'dead_lettered' then
  return state or 'unknown'
end
if tonumber(st[3] or '0') ~= tonumber(ARGV[3]) then
  return 'conflict'
end
for i = 11, #ARGV do
  redis.call('RPUSH', KEYS[2], ARGV[i])
end
redis.call('SET', KEYS[3], ARGV[5])
if ARGV[10] ~= '' then
  redis.call('SET', KEYS[6], ARGV[10])
end
redis.call('HINCRBY', KEYS[1], 'turns', 1)
redis.call('HINCRBYFLOAT', KEYS[1], 'agent_wait_s', ARGV[8])
redis.call('HINCRBYFLOAT', KEYS[1], 'kv_token_s', ARGV[9])
redis.call('HSET', KEYS[1], 'mark', ARGV[4], 'context_tokens', ARGV[7],
  'last_call_at', ARGV[6])
if (state == 'running' or state == 'admitted') and st[2] == ARGV[2] then
  local idle = tonumber(redis.call('HGET', KEYS[5], 'episode_idle_timeout_s') or '')
  redis.call('ZADD', KEYS[4], tonumber(ARGV[6]) + (idle or DEFAULT_IDLE_TIMEOUT_S), ARGV[1])
end
return 'ok'
