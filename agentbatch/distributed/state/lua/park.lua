-- Let never-started agents wait in their queue lists (the sweep, sweep.py): each agent still
-- at the version the sweep read and not started gets, in one step, its park mark in resends
-- ("q:<index>" = "<version>:<since ms>"), its member in its list's parked zset (scored by
-- since: woken by wake.lua once the list has moved past that time) and its deadline moved to
-- look_at (a backstop: the wake is what normally brings it back). A claim in between starts
-- the agent and moves its deadline itself, so it is left alone here: its lease is watched.
-- The commands do not grow with the agents: one HMGET each for the versions and started
-- marks, one ZADD and one HSET for all of them, one ZADD per parked zset.
-- KEYS: state, started, resends, watch, then the parked zsets the rows name (1-based)
-- ARGV: look_at (ms), batch id, rows (JSON array of "<index>:<version>:<zset>:<since ms>")
-- Returns the indices parked.
local state_key, started_key, resends_key, watch_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local look_at, batch_id, rows = ARGV[1], ARGV[2], json_list(ARGV[3])
if #rows == 0 then return {} end
local index, version, zset, since = {}, {}, {}, {}
for j, row in ipairs(rows) do
  local i, v, z, s = string.match(row, '^(%d+):(%d+):(%d+):(%d+)$')
  index[j], version[j], zset[j], since[j] = i, v, tonumber(z), s
end
local entries = redis.call('HMGET', state_key, unpack(index))
local started = redis.call('HMGET', started_key, unpack(index))
local watch_args, marks, by_zset, parked = {'XX'}, {}, {}, {}
for j = 1, #rows do
  local v = version[j]
  if version_of(entries[j] or nil) == v and started[j] ~= v then
    local member = batch_id .. ':' .. index[j]
    watch_args[#watch_args + 1] = look_at
    watch_args[#watch_args + 1] = member
    marks[#marks + 1] = 'q:' .. index[j]
    marks[#marks + 1] = v .. ':' .. since[j]
    local z = by_zset[zset[j]] or {}
    z[#z + 1] = since[j]
    z[#z + 1] = member
    by_zset[zset[j]] = z
    parked[#parked + 1] = index[j]
  end
end
if #parked == 0 then return {} end
redis.call('ZADD', watch_key, unpack(watch_args))
redis.call('HSET', resends_key, unpack(marks))
for z, args in pairs(by_zset) do
  redis.call('ZADD', KEYS[4 + z], unpack(args))
end
return parked
