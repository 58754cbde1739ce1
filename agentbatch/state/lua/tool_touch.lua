-- A tool call of this agent's round is running: mark the version started and move the
-- agent's progress deadline to now + ttl (renewed while the tool runs), so a tool worker
-- that dies is noticed at lease expiry rather than after the queue grace.
-- KEYS: ver, watch, run   ARGV: index, version, deadline_ms, watch member
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[2], 'XX', ARGV[3], ARGV[4])
redis.call('HSET', KEYS[3], ARGV[1], ARGV[2])
return 1
