-- Publish a leader's outcome: store it briefly for late waiters, notify, drop the lock.
-- KEYS: lock, result   ARGV: token, payload, result_ttl_s, channel, note
-- Returns 1, or 0 when the lock was no longer the leader's (another may have run the call).
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
redis.call('PUBLISH', ARGV[4], ARGV[5])
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
