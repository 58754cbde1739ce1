-- Let never-started agents wait on a busy queue, once per version (the sweep, sweep.py).
-- KEYS: state, resends, watch
-- ARGV: later deadline score (even: still not started), batch id, indices...
-- An agent not yet deferred at its current version gets its deadline moved to ARGV[1] and
-- the version recorded in resends' "q:<index>" field. Returned (for the sweep to look at
-- itself): the indices deferred once already at their version (their message is overdue:
-- re-send it), and those gone or unreadable.
local again = {}
for j = 3, #ARGV do
  local index = ARGV[j]
  local v = version_of(redis.call('HGET', KEYS[1], index))
  if v == nil or redis.call('HGET', KEYS[2], 'q:' .. index) == v then
    again[#again + 1] = index
  else
    redis.call('HSET', KEYS[2], 'q:' .. index, v)
    redis.call('ZADD', KEYS[3], 'XX', ARGV[1], ARGV[2] .. ':' .. index)
  end
end
return again
