-- Become the leader of a coalesced tool call, or learn who is. Taking the lock also takes the
-- next fencing token, so a leader paused past its lock holds a lower token than its successor.
-- KEYS: lock, fence   ARGV: token, ttl_ms
-- returns {1, token, 0, fencing_token} when we lead, else {0, leader_token, pttl, 0}
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  -- kept a day past the last leadership: a counter that expired under a paused leader would
  -- restart below the token that leader holds
  redis.call('PEXPIRE', KEYS[2], 86400000 + tonumber(ARGV[2]))
  return {1, ARGV[1], 0, fence}
end
local leader = redis.call('GET', KEYS[1])
return {0, leader or '', redis.call('PTTL', KEYS[1]), 0}
