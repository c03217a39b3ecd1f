-- lease_renew: extend the broker lease only if the caller still holds it (compare-and-set).
-- KEYS[1] = rb:{ns}:lease
-- ARGV[1] = lease token   ARGV[2] = lease period in milliseconds
-- Returns 1 if renewed, 0 if the lease is gone or held by another broker.
-- Invariant: a broker never extends a lease another broker acquired.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
