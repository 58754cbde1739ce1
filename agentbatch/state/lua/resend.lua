-- Re-send a lost agent's task(s), atomically with counting it and moving its deadline.
-- KEYS: state, lease, watch, resends, meta, audit, queue lists...
-- ARGV: index, version, now_ms, base_ms, max_resends, audit ('1'|'0'), watch member,
--       deadline score the sweep read ('' = do not check), payloads...
-- Returns -1 when the agent moved on, is leased again or its deadline is no longer the one
-- the sweep read (nothing sent), -2 when it was
-- re-sent max_resends times at this version already (nothing sent: the caller ends it),
-- else the number of re-sends at this version, this one included. The next look is
-- base_ms later, doubling with each re-send that made no progress (at most 32x); the
-- re-sent version counts as queued (even deadline) until a worker starts it.
-- Re-sent messages go to the consuming end of the list (RPUSH): recovery jumps the queue.
if version_of(redis.call('HGET', KEYS[1], ARGV[1])) ~= ARGV[2] then return -1 end
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
-- The fence of the sweep's pass: another sweeper (this one's lock lapsed mid-pass) that
-- re-sent the agent, or anything else that touched it, moved the deadline since it was read.
if ARGV[8] ~= '' and tonumber(redis.call('ZSCORE', KEYS[3], ARGV[7])) ~= tonumber(ARGV[8]) then
  return -1
end
local n = 1
local prev = redis.call('HGET', KEYS[4], ARGV[1])
if prev then
  local pv, pc = string.match(prev, '^(%d+):(%d+)$')
  if pv == ARGV[2] then n = tonumber(pc) + 1 end
end
if n > tonumber(ARGV[5]) then return -2 end
redis.call('HSET', KEYS[4], ARGV[1], ARGV[2] .. ':' .. n)
local wait = tonumber(ARGV[4]) * 2 ^ math.min(n - 1, 5)
redis.call('ZADD', KEYS[3], queued_at(tonumber(ARGV[3]) + wait), ARGV[7])
redis.call('HINCRBY', KEYS[5], 'stat:recovered', 1)
if ARGV[6] == '1' then redis.call('XADD', KEYS[6], '*', 'i', ARGV[1], 'resent', ARGV[2]) end
for j = 7, #KEYS do
  redis.call('RPUSH', KEYS[j], ARGV[j + 2])
end
return n
