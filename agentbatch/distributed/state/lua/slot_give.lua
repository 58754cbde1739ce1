-- A turn placed by slot_take.lua ended: its slot's count drops, and the slot it ran on (the
-- one sent, else the one llama-server said it picked, else the one counted) now holds the
-- agent's conversation, which no other slot is taken to hold any more.
-- KEYS: the server's slot map hash (see slot_take.lua)
-- ARGV: agent key, slots, slot counted busy or -1, slot it ran on or -1, idle_ms
local map_key, agent, slots = KEYS[1], ARGV[1], tonumber(ARGV[2])
local counted, ran, idle_ms = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if counted >= 0 then
  local left = tonumber(redis.call('HGET', map_key, 'b' .. counted) or '0') - 1
  if left < 0 then left = 0 end
  redis.call('HSET', map_key, 'b' .. counted, left)
end
if ran >= 0 and ran < slots then
  local flat = redis.call('HGETALL', map_key)
  for j = 1, #flat, 2 do
    if flat[j + 1] == agent and flat[j] ~= 'h' .. ran and string.sub(flat[j], 1, 1) == 'h' then
      redis.call('HDEL', map_key, flat[j])
    end
  end
  redis.call('HSET', map_key, 'h' .. ran, agent, 'u' .. ran, now)
end
redis.call('PEXPIRE', map_key, idle_ms)
return 1
