-- Start one tool call of an agent's round in one round trip: check the version, read the
-- agent's state (its scalars: the pending calls, not the conversation), whether this call's
-- outcome is already recorded and whether the batch was cancelled, and, when the call is to
-- run, mark the version started and move its progress deadline to now + ttl (renewed while
-- the tool runs), so a tool worker that dies is noticed at lease expiry, not after the
-- queue grace.
-- KEYS: ver, state, tool fan-in (index, version), meta, watch, run
-- ARGV: index, version, call_id, deadline_ms, watch member
-- Returns {state or '' when the agent moved on, recorded 0/1, cancelled '0'/'1'}.
local cancelled = redis.call('HGET', KEYS[4], 'cancelled') or '0'
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return {'', 0, cancelled} end
local have = redis.call('HEXISTS', KEYS[3], ARGV[3])
if have == 0 and cancelled ~= '1' then
  redis.call('ZADD', KEYS[5], 'XX', ARGV[4], ARGV[5])
  redis.call('HSET', KEYS[6], ARGV[1], ARGV[2])
end
return {redis.call('HGET', KEYS[2], ARGV[1]) or '', have, cancelled}
