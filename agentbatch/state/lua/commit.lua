-- Compare-and-set one agent transition; on a terminal state append its one result, and push
-- the agent's next task(s) in the same atomic step, so a successful write can never lose its
-- follow-up. A claimer that loses the compare-and-set still drops its lease (if it is still
-- ours), so the agent's next task is never refused as ``busy`` by a lease nobody renews.
-- KEYS: ver, state, lease, watch, meta, results, batches, audit, resends, plan, run,
--       tool fan-in (index, expected_version), gone, queue lists...
-- ARGV: index, expected_version, new_version, state_json, token, old_status, new_status,
--       terminal ('1'|'0'), result_json, deadline_ms, batch_id, audit ('1'|'0'),
--       retention_ms (when meta has none), tombstone_ms, payloads...
-- Retention: the commit that delivers the last result removes the batch from ``batches``
-- and gives every key of the batch the retention TTL (meta's ``retention_ms``, set at
-- submit), plus a ``gone`` tombstone that outlives them, all in this one atomic step.
local v = redis.call('HGET', KEYS[1], ARGV[1])
local ours = ARGV[5] ~= '' and redis.call('GET', KEYS[3]) == ARGV[5]
if v ~= ARGV[2] then
  if ours then redis.call('DEL', KEYS[3]) end
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
if ours then redis.call('DEL', KEYS[3]) end
redis.call('HDEL', KEYS[9], ARGV[1])  -- progress: no longer being recovered
if ARGV[6] == 'awaiting_tools' then
  redis.call('DEL', KEYS[12])  -- the round's tool outcomes: consumed by this transition
end
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
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local keep = tonumber(redis.call('HGET', KEYS[5], 'retention_ms') or ARGV[13])
    redis.call('HSET', KEYS[5], 'finished', '1', 'finished_at_ms', now_ms)
    for _, j in ipairs({1, 2, 4, 5, 6, 8, 9, 10, 11}) do
      redis.call('PEXPIRE', KEYS[j], keep)
    end
    redis.call('SET', KEYS[13], cjson.encode({reason = 'expired', finished_at_ms = now_ms,
                                              retention_ms = keep}),
               'PX', keep + tonumber(ARGV[14]))
  end
else
  redis.call('ZADD', KEYS[4], ARGV[10], ARGV[1])
end
for j = 14, #KEYS do
  redis.call('LPUSH', KEYS[j], ARGV[j + 1])
end
return 1
