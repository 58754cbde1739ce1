-- Record one tool outcome for (agent, version, call), and drop the call's lock (if it took
-- one: the recorded outcome is what a duplicate delivery now finds). Returns -1 if the agent
-- moved on, the number recorded while the round is incomplete, and every outcome (field,
-- value, ...) once all ``expected`` are in, so the completing task needs no second round
-- trip.
-- KEYS: state, tool_results, [call lock]   ARGV: index, version, call_id, outcome_json,
--       ttl_s, expected
if version_of(redis.call('HGET', KEYS[1], ARGV[1])) ~= ARGV[2] then return -1 end
redis.call('HSETNX', KEYS[2], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
if KEYS[3] then redis.call('DEL', KEYS[3]) end
local n = redis.call('HLEN', KEYS[2])
if n >= tonumber(ARGV[6]) then return redis.call('HGETALL', KEYS[2]) end
return n
