-- Become the leader of a coalesced tool call, or learn who is.
-- KEYS: lock   ARGV: token, ttl_ms    returns {1, token} when we lead, {0, leader_token, pttl}
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return {1, ARGV[1], 0} end
local leader = redis.call('GET', KEYS[1])
return {0, leader or '', redis.call('PTTL', KEYS[1])}
