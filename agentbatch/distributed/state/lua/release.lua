-- Drop a lease only if it is still ours, and the inference slot it may hold.
-- KEYS: lease, [sem zset: only when the lease holds a slot]   ARGV: token
-- A freed slot is announced on '<sem zset>:freed', where queued turns listen (semaphore.py).
local lease_key = KEYS[1]
local sem_key = KEYS[2]  -- nil: no slot to free
local token = ARGV[1]
if sem_key and redis.call('ZREM', sem_key, token) == 1 then
  redis.call('PUBLISH', sem_key .. ':freed', 'freed')
end
if redis.call('GET', lease_key) == token then return redis.call('DEL', lease_key) end
return 0
