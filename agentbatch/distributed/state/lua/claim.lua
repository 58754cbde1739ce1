-- Start one turn in one round trip: version check, lease, progress deadline, started mark,
-- the agent's state, conversation and tool-call log, and (when asked) a fleet inference slot.
-- KEYS: state, lease, watch, meta, msgs, calls, started,
--       then, only when a slot is asked (sem_limit ~= ''): sem zset, sem aimd hash,
--       sem waiters zset
-- ARGV: index, expected_version, token, ttl_ms, now_ms, sem_limit ('' = no slot now),
--       sem_ttl_ms, watch member ('<batch id>:<index>')
-- Returns {'ok', state entry, cancelled, {messages...}, slot 0/1, aimd limit or -1,
-- {tool-call records...}, scarce 0/1, spend}, {'stale', version}, {'gone'} or
-- {'busy', lease pttl}.
-- spend: the batch's spend so far (meta's ``spend``, added by commit.lua; '0' = none), read
-- with ``cancelled`` in the same HMGET: the worker refuses the turn at ``max_cost_usd``.
-- scarce: 1 when no slot was taken, or the one taken fills half the limit (slots_scarce):
-- the commit that frees it should announce it to turns that may be queued for one.
-- The slot: the holder is the lease token; the commit that ends the turn releases it. Slot
-- expiry uses now_ms, Redis's own TIME as last synced by the worker (redis_store.now_ms).
-- Expired holders are purged only when the set looks full, so a free slot costs 3 calls.
-- Requests already waiting for a slot (sem_acquire's queue) are not overtaken: a free slot
-- is taken here only beyond the ones they are owed. The queue is looked at when this slot
-- would fill half of them: turns queue only while slots are scarce, so a fleet far below
-- its cap pays no command for it (the window left: right after many slots were freed at
-- once, a claim may start ahead of queued turns that have not asked again yet, while
-- free slots remain for them too).
local state_key, lease_key, watch_key, meta_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local msgs_key, calls_key, started_key = KEYS[5], KEYS[6], KEYS[7]
local sem_key, aimd_key, waiters_key = KEYS[8], KEYS[9], KEYS[10]  -- nil: no slot asked
local index, expected_version, token = ARGV[1], ARGV[2], ARGV[3]
local ttl_ms, now = tonumber(ARGV[4]), tonumber(ARGV[5])
local sem_limit, sem_ttl_ms, member = ARGV[6], tonumber(ARGV[7]), ARGV[8]

-- One definition of "slots are scarce": this slot would fill half the limit.
local function slots_scarce(held, limit)
  return (held + 1) * 2 > limit
end

local entry = redis.call('HGET', state_key, index)
if not entry then return {'gone'} end
local v = version_of(entry)
if v ~= expected_version then return {'stale', v or ''} end
if not redis.call('SET', lease_key, token, 'NX', 'PX', ttl_ms) then
  return {'busy', tostring(redis.call('PTTL', lease_key))}
end
redis.call('ZADD', watch_key, now + ttl_ms, member)
mark_started(started_key, index, v)
local flags = redis.call('HMGET', meta_key, 'cancelled', 'spend')
local cancelled, spend = flags[1] or '0', flags[2] or '0'
local slot, dynamic, scarce = 0, -1, 1
if sem_limit ~= '' and cancelled ~= '1' then
  local limit = tonumber(sem_limit)
  local stored = tonumber(redis.call('HGET', aimd_key, 'limit'))
  if stored then
    dynamic = stored
    if stored < limit then limit = stored end
  end
  local held = redis.call('ZCARD', sem_key)
  if slots_scarce(held, limit) then  -- look for queued turns
    held = held + redis.call('ZCARD', waiters_key)
  end
  if held >= limit then
    redis.call('ZREMRANGEBYSCORE', sem_key, '-inf', now)
    held = redis.call('ZCARD', sem_key) + redis.call('ZCARD', waiters_key)
  end
  if held < limit then
    redis.call('ZADD', sem_key, now + sem_ttl_ms, token)
    slot = 1
    if not slots_scarce(held, limit) then scarce = 0 end
  end
end
-- Version 0 is the agent as submitted: only a commit writes its lists, and it moves the
-- version on, so they are empty and not read (two commands per agent).
local msgs, calls = {}, {}
if v ~= '0' then
  msgs, calls = redis.call('LRANGE', msgs_key, 0, -1), redis.call('LRANGE', calls_key, 0, -1)
end
return {'ok', entry, cancelled, msgs, slot, dynamic, calls, scarce, spend}
