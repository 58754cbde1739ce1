-- Drop a lease only if it is still ours, and the inference slot it may hold.
-- KEYS: lease, [sem zset]   ARGV: token
-- A freed slot is announced on '<sem zset>:freed', where queued turns listen (semaphore.py).
if KEYS[2] and redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('PUBLISH', KEYS[2] .. ':freed', 'freed')
end
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
