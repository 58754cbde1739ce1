-- Fleet-wide AIMD, additive increase: a worker's model call succeeded.
-- KEYS: aimd hash   ARGV: configured_limit, now_ms ('' = Redis TIME), quiet_ms, idle_ms
-- +1 (capped at the configured limit) only when quiet_ms passed since the last throttle AND
-- since the last increase, so the whole fleet grows by one per quiet period, not one per call.
-- Returns {increased 0/1, limit or -1 when no dynamic limit is set}.
local configured = tonumber(ARGV[1])
-- now: Redis's clock (TIME) unless a test passes one: cooldown and quiet periods compare
-- times written by different workers, so they must come from one clock.
local now = tonumber(ARGV[2])
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local quiet = tonumber(ARGV[3])
local current = tonumber(redis.call('HGET', KEYS[1], 'limit'))
if not current then return {0, -1} end
if current >= configured then return {0, current} end
local throttled = tonumber(redis.call('HGET', KEYS[1], 'last_throttle_ms')) or 0
local increased = tonumber(redis.call('HGET', KEYS[1], 'last_increase_ms')) or 0
if now - throttled < quiet or now - increased < quiet then return {0, current} end
redis.call('HSET', KEYS[1], 'limit', current + 1, 'last_increase_ms', now)
redis.call('PEXPIRE', KEYS[1], ARGV[4])  -- idle_ms past its last write (see sem_throttle)
return {1, current + 1}
