-- Publish a leader's outcome: store it briefly for late waiters, notify, drop the lock.
-- KEYS: lock, result   ARGV: token, payload, result_ttl_s, channel, note
-- Returns 1, or 0 when the lock was no longer the leader's (another may have run the call).
local lock_key, result_key = KEYS[1], KEYS[2]
local token, payload, result_ttl_s, channel, note = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
redis.call('SET', result_key, payload, 'EX', result_ttl_s)
redis.call('PUBLISH', channel, note)
if redis.call('GET', lock_key) == token then
  redis.call('DEL', lock_key)
  return 1
end
return 0
