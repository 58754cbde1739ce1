-- Which slot of one llama-server an agent's turn goes to, decided for the whole fleet (the
-- embedded engine's ``SlotPicker``, kept in Redis so any worker pins an agent's turns alike).
-- KEYS: the server's slot map hash (keys.slot_map_key): per slot i, h<i> = the agent whose
--       conversation the slot holds, b<i> = our turns on it, e<i> = when that count lapses
--       (ms), u<i> = when a turn last took it (ms)
-- ARGV: agent key, slots, mode, ttl_ms (a turn's deadline: a count left by a dead worker
--       lapses then), idle_ms (the map's own expiry)
-- mode 'first' or 'next' (a turn, the agent's first or not): pinned to the slot holding the
-- agent's conversation when no turn of ours is on it; a first turn to a free slot holding
-- nobody's; any other turn unpinned (llama.cpp restores it from its host-memory cache into a
-- slot it picks: counted on our oldest free one).
-- mode 'held' (a save, for a carry to another server): the idle slot holding the agent's
-- conversation, else nothing. mode 'claim' (a restore): a free slot, one holding nobody's
-- first, else the one used longest ago, else nothing.
-- Returns {slot sent as id_slot or -1, slot counted busy or -1}.
local map_key, agent, slots = KEYS[1], ARGV[1], tonumber(ARGV[2])
local mode, ttl_ms, idle_ms = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local first = mode == 'first'
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local flat = redis.call('HGETALL', map_key)
local f = {}
for j = 1, #flat, 2 do f[flat[j]] = flat[j + 1] end
local function busy(s)
  return tonumber(f['e' .. s] or '0') > now and tonumber(f['b' .. s] or '0') or 0
end
local function used(s) return tonumber(f['u' .. s] or '0') end
local home, oldest, blank = nil, nil, nil
for s = 0, slots - 1 do
  local holder = f['h' .. s]
  if holder == agent then home = s end
  if busy(s) == 0 then
    if oldest == nil or used(s) < used(oldest) then oldest = s end
    if (holder == nil or holder == '') and (blank == nil or used(s) < used(blank)) then
      blank = s
    end
  end
end
local send, slot = -1, -1
if mode == 'held' then
  if home ~= nil and busy(home) == 0 then send, slot = home, home end
elseif mode == 'claim' then
  local free = blank or oldest
  if free ~= nil then send, slot = free, free end
elseif home ~= nil and busy(home) == 0 then
  send, slot = home, home
elseif home == nil and first and blank ~= nil then
  send, slot = blank, blank
elseif oldest ~= nil then
  slot = oldest
end
if slot >= 0 then
  redis.call('HSET', map_key, 'b' .. slot, busy(slot) + 1, 'e' .. slot, now + ttl_ms,
             'u' .. slot, now)
end
redis.call('PEXPIRE', map_key, idle_ms)
return {send, slot}
