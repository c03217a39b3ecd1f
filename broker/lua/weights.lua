-- weights: the trainer pauses generation for a weight update, or resumes on new weights.
-- KEYS[1] = rb:{ns}:weights   KEYS[2] = rb:{ns}:control   KEYS[3] = rb:{ns}:events
-- ARGV[1] = 'pause' | 'resume' | 'staleness' | 'pause_adapter' | 'resume_adapter'
-- ARGV[2] = the pause mode (abort|wait|keep), the new policy version (resume), the staleness
-- bound ('' for none), or the adapter's name (resume_adapter)   ARGV[3] = the adapter's name
-- (pause_adapter)
-- Returns the pause epoch (pause, pause_adapter; a pause while paused returns the epoch in
-- force and changes nothing, as vLLM's does), the version now current (resume), 1 (staleness),
-- or 1 / 0 (resume_adapter: whether the adapter was paused).
-- An adapter's pause is the field `adapter_pause:<name>` = '<mode> <epoch>' (pauses share the
-- epoch counter, so a worker's acknowledgements only grow).
-- Invariant: the weights hash and the control stream every worker follows move together: a
-- worker that reads the stream from the hash's `control_id` on sees every later change.

-- An order for the workers (`op` and its fields) on the control stream, its id in the hash,
-- and an event of `kind` for the broker.
local function order(kind, ...)
  local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', '1000', '*', 'op', kind, ...)
  redis.call('HSET', KEYS[1], 'control_id', id)
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'kind', kind, 'backend', '')
end

if ARGV[1] == 'pause' then
  local st = redis.call('HMGET', KEYS[1], 'paused', 'epoch')
  if st[1] and st[1] ~= '' then
    return tonumber(st[2])
  end
  local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  redis.call('HSET', KEYS[1], 'paused', ARGV[2])
  order('pause', 'mode', ARGV[2], 'epoch', epoch)
  return epoch
end
if ARGV[1] == 'pause_adapter' then
  local field = 'adapter_pause:' .. ARGV[3]
  local held = redis.call('HGET', KEYS[1], field)
  if held then
    return tonumber(string.match(held, '%d+$'))
  end
  local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
  redis.call('HSET', KEYS[1], field, ARGV[2] .. ' ' .. epoch)
  order('pause', 'mode', ARGV[2], 'epoch', epoch, 'adapter', ARGV[3])
  return epoch
end
if ARGV[1] == 'resume_adapter' then
  local field = 'adapter_pause:' .. ARGV[2]
  if redis.call('HDEL', KEYS[1], field) == 0 then
    return 0
  end
  order('resume', 'adapter', ARGV[2])
  return 1
end
if ARGV[1] == 'staleness' then
  redis.call('HSET', KEYS[1], 'max_staleness', ARGV[2])
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', '10000', '*', 'kind', 'staleness', 'backend', '')
  return 1
end
local epoch = redis.call('HGET', KEYS[1], 'epoch') or '0'
redis.call('HSET', KEYS[1], 'paused', '', 'version', ARGV[2])
order('resume', 'version', ARGV[2], 'epoch', epoch)
return tonumber(ARGV[2])
