-- ack_results: the trainer acknowledges results it has taken; each counts as consumed once and
-- its entry leaves the stream (nothing reads an acknowledged result again).
-- KEYS[1] = rb:{ns}:results   KEYS[2] = rb:{ns}:consumed
-- ARGV[1] = the consumer group ('trainer')   ARGV[2i] = entry id_i   ARGV[2i+1] = workload_i
-- Returns how many entries were newly acknowledged.
-- Invariant: consumed[w] grows by exactly one per result of w the group acknowledges, however
-- often the same acknowledgement is sent (a retry after a lost reply counts nothing twice).
local acked = 0
for i = 2, #ARGV, 2 do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    redis.call('XDEL', KEYS[1], ARGV[i])
    redis.call('HINCRBY', KEYS[2], ARGV[i + 1], 1)
    acked = acked + 1
  end
end
return acked
