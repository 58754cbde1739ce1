-- Fleet-wide AIMD, additive increase: a worker's model call succeeded.
-- KEYS: aimd hash   ARGV: configured_limit, now_ms ('' = Redis TIME), quiet_ms, idle_ms
-- +1 (capped at the configured limit) only when quiet_ms passed since the last throttle AND
-- since the last increase, so the whole fleet grows by one per quiet period, not one per call.
-- Returns {increased 0/1, limit or -1 when no dynamic limit is set}.
local aimd_key = KEYS[1]
local configured, now_arg = tonumber(ARGV[1]), ARGV[2]
local quiet_ms, idle_ms = tonumber(ARGV[3]), ARGV[4]
-- now: Redis's clock (TIME) unless a test passes one: cooldown and quiet periods compare
-- times written by different workers, so they must come from one clock.
local now = tonumber(now_arg)
if not now then
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local current = tonumber(redis.call('HGET', aimd_key, 'limit'))
if not current then return {0, -1} end
if current >= configured then return {0, current} end
local throttled = tonumber(redis.call('HGET', aimd_key, 'last_throttle_ms')) or 0
local increased = tonumber(redis.call('HGET', aimd_key, 'last_increase_ms')) or 0
if now - throttled < quiet_ms or now - increased < quiet_ms then return {0, current} end
redis.call('HSET', aimd_key, 'limit', current + 1, 'last_increase_ms', now)
redis.call('PEXPIRE', aimd_key, idle_ms)  -- idle_ms past its last write (see sem_throttle)
return {1, current + 1}
