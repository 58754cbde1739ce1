-- Let never-started agents wait on a busy queue, once per version (the sweep, sweep.py).
-- KEYS: state, resends, watch, started
-- ARGV: later deadline (ms), batch id, indices (JSON array of the due agents' indices)
-- An agent whose current version was not started and not yet deferred at that version gets
-- its deadline moved to the later one and the version recorded in resends' "q:<index>"
-- field. Returned (for the sweep to look at itself): the indices started at their current
-- version, those deferred once already at it (their message is overdue: re-send it), and
-- those gone or unreadable.
local state_key, resends_key, watch_key, started_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local later_ms, batch_id, indices = ARGV[1], ARGV[2], json_list(ARGV[3])
local again = {}
for _, index in ipairs(indices) do
  local v = version_of(redis.call('HGET', state_key, index))
  if v == nil or redis.call('HGET', started_key, index) == v
      or redis.call('HGET', resends_key, 'q:' .. index) == v then
    again[#again + 1] = index
  else
    redis.call('HSET', resends_key, 'q:' .. index, v)
    redis.call('ZADD', watch_key, 'XX', later_ms, batch_id .. ':' .. index)
  end
end
return again
