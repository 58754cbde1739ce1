-- Record one tool outcome for (agent, version, call); return how many are recorded.
-- KEYS: ver, tool_results   ARGV: index, version, call_id, outcome_json, ttl_s
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return -1 end
redis.call('HSETNX', KEYS[2], ARGV[3], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[5])
return redis.call('HLEN', KEYS[2])
