-- Start one tool call of an agent's round in one round trip: check the version, read the
-- agent's state (its scalars: the pending calls, not the conversation), whether this call's
-- outcome is already recorded and whether the batch was cancelled, and, when the call is to
-- run, mark the version started with its progress deadline at now + ttl (renewed while the
-- tool runs), so a tool worker that dies is noticed at lease expiry, not after the queue
-- grace.
-- A call of a tool that shares no executions (neither cacheable nor coalesced) also takes
-- its lock here, with the agent's next fencing token: only duplicate deliveries of that very
-- call contend for it, and one that finds it held is told how long it lives (``busy_ms``)
-- and tries again then, as a turn does with a busy lease. The commit (or the record, for a
-- round of several calls) that consumes the outcome deletes the lock.
-- KEYS: state, tool fan-in (index, version), meta, watch, call lock, fence
-- ARGV: index, version, call_id, deadline_ms, watch member, fan_in ('1' when the round has
--       several calls), lock token ('' = take no lock), lock_ttl_ms
-- Returns {state entry or '' when the agent moved on, recorded 0/1, cancelled '0'/'1',
--          fencing token (0: no lock taken), busy_ms (> 0: the lock is held elsewhere)}.
local cancelled = redis.call('HGET', KEYS[3], 'cancelled') or '0'
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if version_of(entry) ~= ARGV[2] then return {'', 0, cancelled, 0, 0} end
local have = 0
if ARGV[6] == '1' then have = redis.call('HEXISTS', KEYS[2], ARGV[3]) end
local fence = 0
if have == 0 and cancelled ~= '1' then
  if ARGV[7] ~= '' then
    if not redis.call('SET', KEYS[5], ARGV[7], 'NX', 'PX', ARGV[8]) then
      return {entry, 0, cancelled, 0, math.max(redis.call('PTTL', KEYS[5]), 1)}
    end
    fence = redis.call('HINCRBY', KEYS[6], ARGV[1], 1)
  end
  redis.call('ZADD', KEYS[4], 'XX', started_at(ARGV[4]), ARGV[5])
end
return {entry, have, cancelled, fence, 0}
