-- A tool call of this agent's round is running: keep its version marked started with its
-- progress deadline at deadline_ms, and the call's lock (when it holds one) alive for
-- lock_ttl_ms, so a tool worker that dies is noticed at lease expiry rather than after the
-- queue grace, and a live one keeps its call.
-- KEYS: state, watch, started, [call lock: only when the call holds one]
-- ARGV: index, version, deadline_ms, watch member, [lock token, lock_ttl_ms: with the lock]
-- Returns 0 when the agent moved on, -1 when the lock was lost, else 1.
local state_key, watch_key, started_key = KEYS[1], KEYS[2], KEYS[3]
local lock_key = KEYS[4]  -- nil: the call holds no lock
local index, version, deadline_ms, member = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lock_token, lock_ttl_ms = ARGV[5], ARGV[6]
if version_of(redis.call('HGET', state_key, index)) ~= version then return 0 end
-- XX: an agent of a batch deleted or expired meanwhile must not bring back its watch entry
redis.call('ZADD', watch_key, 'XX', deadline_ms, member)
mark_started(started_key, index, version)
if lock_key then
  if redis.call('GET', lock_key) ~= lock_token then return -1 end
  redis.call('PEXPIRE', lock_key, lock_ttl_ms)
end
return 1
