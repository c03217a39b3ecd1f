-- lease_release: give the broker lease up on a clean stop, so a standby takes over at once.
-- KEYS[1] = rb:{ns}:lease
-- ARGV[1] = lease token
-- Returns 1 if released, 0 if the caller did not hold it.
-- Invariant: a broker never deletes a lease another broker holds.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
