-- One fleet-wide token bucket per tool (GCRA): reserve the next token, say when it is due.
-- KEYS: bucket   ARGV: interval_us (1e6 / rate), burst
-- The key holds the "theoretical arrival time" (µs, Redis TIME) after the last reservation.
-- Each caller takes a token now, possibly on credit, and learns how long to sleep until it is
-- due: waiters queue in arrival order across the fleet and nobody polls.
-- Returns the wait in microseconds (0: run now).
local bucket_key = KEYS[1]
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tat = tonumber(redis.call('GET', bucket_key)) or now
if tat < now then tat = now end
local new_tat = tat + interval
local wait = new_tat - burst * interval - now
if wait < 0 then wait = 0 end
-- the key outlives its last reservation by one interval; then an idle bucket is simply full
redis.call('SET', bucket_key, string.format('%.0f', new_tat),
           'PX', math.floor((new_tat - now) / 1000) + 1000)
return math.floor(wait)
