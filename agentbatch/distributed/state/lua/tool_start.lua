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
-- KEYS: state, tool fan-in (index, version), meta, watch, call lock, fence, started
-- ARGV: index, version, call_id, deadline_ms, watch member, fan_in ('1' when the round has
--       several calls), lock token ('' = take no lock), lock_ttl_ms
-- Returns {state entry or '' when the agent moved on, recorded 0/1, cancelled '0'/'1',
--          fencing token (0: no lock taken), busy_ms (> 0: the lock is held elsewhere)}.
local state_key, fan_in_key, meta_key, watch_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lock_key, fence_key, started_key = KEYS[5], KEYS[6], KEYS[7]
local index, version, call_id, deadline_ms = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local member, fan_in, lock_token, lock_ttl_ms = ARGV[5], ARGV[6] == '1', ARGV[7], ARGV[8]
local cancelled = redis.call('HGET', meta_key, 'cancelled') or '0'
local entry = redis.call('HGET', state_key, index)
if version_of(entry) ~= version then return {'', 0, cancelled, 0, 0} end
local have = 0
if fan_in then have = redis.call('HEXISTS', fan_in_key, call_id) end
local fence = 0
if have == 0 and cancelled ~= '1' then
  if lock_token ~= '' then
    if not redis.call('SET', lock_key, lock_token, 'NX', 'PX', lock_ttl_ms) then
      return {entry, 0, cancelled, 0, math.max(redis.call('PTTL', lock_key), 1)}
    end
    fence = redis.call('HINCRBY', fence_key, index, 1)
  end
  redis.call('ZADD', watch_key, 'XX', deadline_ms, member)
  mark_started(started_key, index, version)
end
return {entry, have, cancelled, fence, 0}
