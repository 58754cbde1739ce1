-- Compare-and-set one agent transition; on a terminal state append its one result.
-- and push the agent's next task(s) in the same atomic step, so a successful write can never
-- lose its follow-up.
-- KEYS: ver, state, lease, watch, meta, results, batches, audit, queue lists...
-- ARGV: index, expected_version, new_version, state_json, token, old_status, new_status,
--       terminal ('1'|'0'), result_json, deadline_ms, batch_id, audit ('1'|'0'), payloads...
local v = redis.call('HGET', KEYS[1], ARGV[1])
if v ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
if ARGV[5] ~= '' and redis.call('GET', KEYS[3]) == ARGV[5] then redis.call('DEL', KEYS[3]) end
if ARGV[6] ~= ARGV[7] then
  redis.call('HINCRBY', KEYS[5], 'n:' .. ARGV[6], -1)
  redis.call('HINCRBY', KEYS[5], 'n:' .. ARGV[7], 1)
end
if ARGV[12] == '1' then
  redis.call('XADD', KEYS[8], '*', 'i', ARGV[1], 'v', ARGV[3])
end
if ARGV[8] == '1' then
  redis.call('ZREM', KEYS[4], ARGV[1])
  redis.call('XADD', KEYS[6], '*', 'i', ARGV[1], 'r', ARGV[9])
  local delivered = redis.call('HINCRBY', KEYS[5], 'delivered', 1)
  local total = tonumber(redis.call('HGET', KEYS[5], 'total') or '0')
  if delivered >= total then
    redis.call('SREM', KEYS[7], ARGV[11])
    redis.call('HSET', KEYS[5], 'finished', '1')
  end
else
  redis.call('ZADD', KEYS[4], ARGV[10], ARGV[1])
end
for j = 9, #KEYS do
  redis.call('LPUSH', KEYS[j], ARGV[j + 4])
end
return 1
