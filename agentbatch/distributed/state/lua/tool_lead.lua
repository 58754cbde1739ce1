-- Become the leader of a coalesced tool call, or learn who is. Taking the lock also takes the
-- next fencing token, so a leader paused past its lock holds a lower token than its successor.
-- KEYS: lock, fence   ARGV: token, ttl_ms
-- returns {1, token, 0, fencing_token} when we lead, else {0, leader_token, pttl, 0}
local lock_key, fence_key = KEYS[1], KEYS[2]
local token, ttl_ms = ARGV[1], ARGV[2]
if redis.call('SET', lock_key, token, 'NX', 'PX', ttl_ms) then
  local fence = redis.call('INCR', fence_key)
  -- kept a day past the last leadership: a counter that expired under a paused leader would
  -- restart below the token that leader holds
  redis.call('PEXPIRE', fence_key, 86400000 + tonumber(ttl_ms))
  return {1, token, 0, fence}
end
local leader = redis.call('GET', lock_key)
return {0, leader or '', redis.call('PTTL', lock_key), 0}
