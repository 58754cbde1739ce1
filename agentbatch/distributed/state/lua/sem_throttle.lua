-- Fleet-wide AIMD, multiplicative decrease: a worker saw a 429/throttle.
-- KEYS: aimd hash   ARGV: configured_limit, now_ms ('' = Redis TIME), cooldown_ms, idle_ms
-- Halves min(stored, configured) -- never below 1 -- unless the last halving (by any worker)
-- was less than cooldown_ms ago: one overload arrives as a burst of 429s. Every throttle,
-- halving or not, restarts the quiet period that gates recovery (last_throttle_ms).
-- Returns {halved 0/1, limit}.
local aimd_key = KEYS[1]
local configured, now_arg = tonumber(ARGV[1]), ARGV[2]
local cooldown_ms, idle_ms = tonumber(ARGV[3]), ARGV[4]
-- now: Redis's clock (TIME) unless a test passes one: cooldown and quiet periods compare
-- times written by different workers, so they must come from one clock.
local now = tonumber(now_arg)
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local current = tonumber(redis.call('HGET', aimd_key, 'limit')) or configured
if current > configured then current = configured end
redis.call('HSET', aimd_key, 'last_throttle_ms', now)
-- the hash lives idle_ms past its last write: an idle fleet forgets old throttles
redis.call('PEXPIRE', aimd_key, idle_ms)
local last = tonumber(redis.call('HGET', aimd_key, 'last_decrease_ms'))
if last and now - last < cooldown_ms then return {0, current} end
local halved = math.max(1, math.floor(current / 2))
redis.call('HSET', aimd_key, 'limit', halved, 'last_decrease_ms', now)
return {1, halved}
