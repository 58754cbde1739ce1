-- Start one turn in one round trip: version check, lease, progress deadline (marked
-- started), the agent's state, conversation and tool-call log, and (when asked) a fleet
-- inference slot.
-- KEYS: state, lease, watch, meta, msgs, sem zset, sem aimd hash, calls, sem waiters zset
-- ARGV: index, expected_version, token, ttl_ms, now_ms, sem_limit ('' = no slot now),
--       sem_ttl_ms, watch member ('<batch id>:<index>')
-- Returns {'ok', state entry, cancelled, {messages...}, slot 0/1, aimd limit or -1,
-- {tool-call records...}, slots held (and waited for, when over half) before this claim},
-- {'stale', version}, {'gone'} or {'busy', lease pttl}.
-- The slot: the holder is the lease token; the commit that ends the turn releases it. Slot
-- expiry uses now_ms, Redis's own TIME as last synced by the worker (redis_store.now_ms).
-- Expired holders are purged only when the set looks full, so a free slot costs 3 calls.
-- Requests already waiting for a slot (sem_acquire's queue) are not overtaken: a free slot
-- is taken here only beyond the ones they are owed. The queue is looked at when this slot
-- would fill half of them: turns queue only while slots are scarce, so a fleet far below
-- its cap pays no command for it (the window left: right after many slots were freed at
-- once, a claim may start ahead of queued turns that have not asked again yet, while
-- free slots remain for them too).
local entry = redis.call('HGET', KEYS[1], ARGV[1])
if not entry then return {'gone'} end
local v = version_of(entry)
if v ~= ARGV[2] then return {'stale', v or ''} end
if not redis.call('SET', KEYS[2], ARGV[3], 'NX', 'PX', ARGV[4]) then
  return {'busy', tostring(redis.call('PTTL', KEYS[2]))}
end
local now = tonumber(ARGV[5])
redis.call('ZADD', KEYS[3], started_at(now + tonumber(ARGV[4])), ARGV[8])
local cancelled = redis.call('HGET', KEYS[4], 'cancelled') or '0'
local slot, dynamic, held = 0, -1, 0
if ARGV[6] ~= '' and cancelled ~= '1' then
  local limit = tonumber(ARGV[6])
  local stored = tonumber(redis.call('HGET', KEYS[7], 'limit'))
  if stored then
    dynamic = stored
    if stored < limit then limit = stored end
  end
  held = redis.call('ZCARD', KEYS[6])
  if (held + 1) * 2 > limit then  -- this slot would fill half: look for queued turns
    held = held + redis.call('ZCARD', KEYS[9])
  end
  if held >= limit then
    redis.call('ZREMRANGEBYSCORE', KEYS[6], '-inf', now)
    held = redis.call('ZCARD', KEYS[6]) + redis.call('ZCARD', KEYS[9])
  end
  if held < limit then
    redis.call('ZADD', KEYS[6], now + tonumber(ARGV[7]), ARGV[3])
    slot = 1
  end
end
return {'ok', entry, cancelled, redis.call('LRANGE', KEYS[5], 0, -1), slot, dynamic,
        redis.call('LRANGE', KEYS[8], 0, -1), held}
