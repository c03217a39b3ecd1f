-- dead_letter: move an unreadable queue entry to the dead-letter stream, with the reason.
-- KEYS[1] = the stream it came from (rb:{ns}:pending:<w> or rb:{ns}:requeue:<w>)
-- KEYS[2] = rb:{ns}:dead   KEYS[3] = rb:{ns}:session:<sid>, or KEYS[2] again when the entry
-- names no usable session id   KEYS[4] = rb:{ns}:settings   KEYS[5] = rb:{ns}:body:<sid>, or
-- KEYS[2] again
-- ARGV[1] = entry id   ARGV[2] = group that holds it ('broker')   ARGV[3] = reason
-- ARGV[4] = now   ARGV[5..] = the entry's fields, name and value alternating
-- Returns 'ok'.
-- Invariant: in one step the entry leaves its stream (acked and deleted) and appears once in
-- the dead-letter stream; a session whose current queue entry this was is marked
-- 'dead_lettered' with the reason (and retired, lib.lua), so its state never claims 'pending'
-- for an entry that is gone.
local body = {'stream', KEYS[1], 'entry_id', ARGV[1], 'reason', ARGV[3]}
for i = 5, #ARGV, 2 do
  body[#body + 1] = 'f:' .. ARGV[i]
  body[#body + 1] = ARGV[i + 1]
end
redis.call('XADD', KEYS[2], '*', unpack(body))
redis.call('XACK', KEYS[1], ARGV[2], ARGV[1])
redis.call('XDEL', KEYS[1], ARGV[1])
if KEYS[3] ~= KEYS[2] then
  local st = redis.call('HMGET', KEYS[3], 'state', 'pending_entry')
  if st[1] == 'pending' and st[2] == ARGV[1] then
    redis.call('HSET', KEYS[3], 'state', 'dead_lettered', 'finished_at', ARGV[4],
      'last_error', ARGV[3])
    retire(KEYS[3], KEYS[5], KEYS[4], true)
  end
end
return 'ok'
