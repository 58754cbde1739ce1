-- A tool call of this agent's round is running: keep the version marked started with its
-- progress deadline at deadline_ms, and the call's lock (when it holds one) alive for
-- lock_ttl_ms, so a tool worker that dies is noticed at lease expiry rather than after the
-- queue grace, and a live one keeps its call.
-- KEYS: state, watch, [call lock]   ARGV: index, version, deadline_ms, watch member,
--       [lock token, lock_ttl_ms]
-- Returns 0 when the agent moved on, -1 when the lock was lost, else 1.
if version_of(redis.call('HGET', KEYS[1], ARGV[1])) ~= ARGV[2] then return 0 end
-- XX: an agent of a batch deleted or expired meanwhile must not bring back its watch entry
redis.call('ZADD', KEYS[2], 'XX', started_at(ARGV[3]), ARGV[4])
if KEYS[3] then
  if redis.call('GET', KEYS[3]) ~= ARGV[5] then return -1 end
  redis.call('PEXPIRE', KEYS[3], ARGV[6])
end
return 1
