-- A counting semaphore whose holders expire, so a killed worker never leaks a slot.
-- KEYS: sem zset, aimd hash, waiters zset (by rank), waiters' expiry zset
-- ARGV: holder, limit, ttl_ms, priority ('' = do not queue), wait_ttl_ms
-- Expiry scores are Redis's own clock (TIME), never a worker's: one worker's clock running
-- ahead would otherwise see every live holder as expired and evict it.
-- The effective limit is min(limit, aimd.limit) when the fleet-wide AIMD hash has one.
-- A current holder is always re-scored (renewal): a shrinking limit evicts no one.
-- Waiters (priority given) queue: rank = priority * 1e13 + the Redis ms of their first try
-- (lower first: fewer turns left, then arrival), kept while they keep asking; a free slot
-- goes to the first waiters only, so a request that asks at the right moment cannot
-- overtake one that has waited longer or is nearer done. A waiter that stops asking (its
-- worker died) is dropped wait_ttl_ms later; the keys expire when nobody waits.
-- Without a priority, a caller takes a free slot only when nobody waits.
-- Returns {acquired 0/1, the aimd limit or -1 when there is none, waiters ahead of it}.
local sem_key, aimd_key, waiters_key, waiter_expiry_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local holder, configured_limit, ttl_ms = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local priority, wait_ttl_ms = ARGV[4], tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', sem_key, '-inf', now)
local dynamic = -1
local limit = configured_limit
local stored = tonumber(redis.call('HGET', aimd_key, 'limit'))
if stored then
  dynamic = stored
  if stored < limit then limit = stored end
end
local expires = now + ttl_ms
if redis.call('ZSCORE', sem_key, holder) then
  redis.call('ZADD', sem_key, expires, holder)
  return {1, dynamic, 0}
end
local gone = redis.call('ZRANGEBYSCORE', waiter_expiry_key, '-inf', now)
if #gone > 0 then
  redis.call('ZREM', waiters_key, unpack(gone))
  redis.call('ZREM', waiter_expiry_key, unpack(gone))
end
local free = limit - redis.call('ZCARD', sem_key)
local ahead = 0
if priority == '' then
  ahead = redis.call('ZCARD', waiters_key)
else
  if not redis.call('ZSCORE', waiters_key, holder) then
    redis.call('ZADD', waiters_key, tonumber(priority) * 1e13 + now, holder)
  end
  ahead = redis.call('ZRANK', waiters_key, holder)
end
if ahead < free then
  redis.call('ZADD', sem_key, expires, holder)
  redis.call('ZREM', waiters_key, holder)
  redis.call('ZREM', waiter_expiry_key, holder)
  return {1, dynamic, 0}
end
if priority ~= '' then
  redis.call('ZADD', waiter_expiry_key, now + wait_ttl_ms, holder)
  redis.call('PEXPIRE', waiters_key, wait_ttl_ms)
  redis.call('PEXPIRE', waiter_expiry_key, wait_ttl_ms)
end
return {0, dynamic, ahead}
