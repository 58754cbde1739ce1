-- Record one tool outcome for (agent, version, call). Returns -1 if the agent moved on, the
-- number recorded while the round is incomplete, and every outcome (field, value, ...) once
-- all ``expected`` are in, so the completing task needs no second round trip.
-- KEYS: ver, tool_results   ARGV: index, version, call_id, outcome_json, ttl_s, expected
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return -1 end
redis.call('HSETNX', KEYS[2], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
local n = redis.call('HLEN', KEYS[2])
if n >= tonumber(ARGV[6]) then return redis.call('HGETALL', KEYS[2]) end
return n
