-- Claim an agent for one turn: version check + lease + progress deadline + state read.
-- KEYS: ver, state, lease, watch, meta, run
-- ARGV: index, expected_version, token, ttl_ms, now_ms
-- Returns {'ok', state, cancelled}, {'stale', version}, {'gone'}, or {'busy', lease pttl}.
-- ``run`` records the version this agent last started at: an unleased agent whose version
-- was started and never committed was lost mid-turn, and the sweep re-sends it at once.
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return {'gone'} end
if v ~= ARGV[2] then return {'stale', v} end
if not redis.call('SET', KEYS[3], ARGV[3], 'NX', 'PX', ARGV[4]) then
  return {'busy', tostring(redis.call('PTTL', KEYS[3]))}
end
redis.call('ZADD', KEYS[4], tonumber(ARGV[5]) + tonumber(ARGV[4]), ARGV[1])
redis.call('HSET', KEYS[6], ARGV[1], ARGV[2])
local cancelled = redis.call('HGET', KEYS[5], 'cancelled') or '0'
return {'ok', redis.call('HGET', KEYS[2], ARGV[1]), cancelled}
