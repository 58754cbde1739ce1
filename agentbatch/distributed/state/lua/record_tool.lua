-- Record one tool outcome for (agent, version, call), and drop the call's lock (if it took
-- one: the recorded outcome is what a duplicate delivery now finds). Returns -1 if the agent
-- moved on, the number recorded while the round is incomplete, and every outcome (field,
-- value, ...) once all ``expected`` are in, so the completing task needs no second round
-- trip.
-- KEYS: state, tool_results, [call lock: only when the call took one]
-- ARGV: index, version, call_id, outcome_json, ttl_s, expected
local state_key, results_key = KEYS[1], KEYS[2]
local lock_key = KEYS[3]  -- nil: the call took no lock
local index, version, call_id, outcome_json = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local ttl_s, expected = ARGV[5], tonumber(ARGV[6])
if version_of(redis.call('HGET', state_key, index)) ~= version then return -1 end
redis.call('HSETNX', results_key, call_id, outcome_json)
redis.call('EXPIRE', results_key, ttl_s)
if lock_key then redis.call('DEL', lock_key) end
local n = redis.call('HLEN', results_key)
if n >= expected then return redis.call('HGETALL', results_key) end
return n
