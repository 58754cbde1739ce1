-- Claim an agent for one turn: version check + lease + progress deadline + state read.
-- KEYS: ver, state, lease, watch, meta
-- ARGV: index, expected_version, token, ttl_ms, now_ms
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return {'gone'} end
if v ~= ARGV[2] then return {'stale', v} end
if not redis.call('SET', KEYS[3], ARGV[3], 'NX', 'PX', ARGV[4]) then return {'busy'} end
redis.call('ZADD', KEYS[4], tonumber(ARGV[5]) + tonumber(ARGV[4]), ARGV[1])
local cancelled = redis.call('HGET', KEYS[5], 'cancelled') or '0'
return {'ok', redis.call('HGET', KEYS[2], ARGV[1]), cancelled}
