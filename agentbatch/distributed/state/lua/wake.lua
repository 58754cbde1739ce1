-- Wake the parked agents their queue lists have moved past (the sweep, sweep.py): per parked
-- zset, the members parked before its bound (every message pushed before then has left the
-- list: taken by a worker, or lost with one) leave the zset, and their deadlines come down to
-- wake_at unless already sooner (LT: a claim set it; XX: an agent gone or ended meanwhile is
-- not watched again). Those a worker started are then watched by their leases as usual; the
-- others come due at wake_at and are re-sent. Commands per zset: one range, and when it
-- finds members, one ZREM and one ZADD, whatever their number (at most limit).
-- KEYS: watch, then the parked zsets
-- ARGV: wake_at (ms), limit, then per parked zset its bound ('(<ms>' exclusive, or '+inf')
local watch_key, wake_at, limit = KEYS[1], ARGV[1], tonumber(ARGV[2])
local woken = 0
for z = 2, #KEYS do
  local members = redis.call('ZRANGEBYSCORE', KEYS[z], '-inf', ARGV[z + 1], 'LIMIT', 0, limit)
  if #members > 0 then
    redis.call('ZREM', KEYS[z], unpack(members))
    local args = {'XX', 'LT'}
    for _, member in ipairs(members) do
      args[#args + 1] = wake_at
      args[#args + 1] = member
    end
    redis.call('ZADD', watch_key, unpack(args))
    woken = woken + #members
  end
end
return woken
