-- Compare-and-set one agent transition; on a terminal state append its one result, and push
-- the agent's next task(s) in the same atomic step, so a successful write can never lose its
-- follow-up. A claimer that loses the compare-and-set still drops its lease and its inference
-- slot (if still ours), so the agent's next task is never refused as ``busy`` by a lease
-- nobody renews.
-- KEYS: ver, state, lease, watch, meta, results, batches, audit, resends, plan, run,
--       tool fan-in (index, expected_version), gone, msgs, sem zset (the lease key again
--       when the turn holds no slot), queue lists...
-- ARGV: index, expected_version, new_version, state_json (no messages), token, old_status,
--       new_status, terminal ('1'|'0'), result_json, deadline_ms, batch_id, audit ('1'|'0'),
--       retention_ms (when meta has none), tombstone_ms,
--       msg_mode ('' = none new, 'a' = append, 'r' = replace), n, n messages, payloads...
-- History is linear: the state hash holds the agent's scalars, the msgs list its
-- conversation, and a transition RPUSHes only its new messages (O(new), not O(history)).
-- A terminal agent keeps no conversation: its result, appended here, is what readers get.
-- ``resends`` is not touched: resend.lua counts per version, so a new version starts at 0.
-- Retention: the commit that delivers the last result removes the batch from ``batches``
-- and gives every key of the batch the retention TTL (meta's ``retention_ms``, set at
-- submit), plus a ``gone`` tombstone that outlives them, all in this one atomic step.
local member = ARGV[11] .. ':' .. ARGV[1]  -- in the fleet-wide watch zset
local ours = false
if ARGV[5] ~= '' then
  if KEYS[15] ~= KEYS[3] then redis.call('ZREM', KEYS[15], ARGV[5]) end  -- no slot: lease
  ours = redis.call('GET', KEYS[3]) == ARGV[5]
end
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then
  if ours then redis.call('DEL', KEYS[3]) end
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[4])
if ours then redis.call('DEL', KEYS[3]) end
local n = tonumber(ARGV[16])
if ARGV[8] == '1' then
  redis.call('DEL', KEYS[14])
else
  if ARGV[15] == 'r' then redis.call('DEL', KEYS[14]) end
  if n > 0 then redis.call('RPUSH', KEYS[14], unpack(ARGV, 17, 16 + n)) end
end
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
  redis.call('ZREM', KEYS[4], member)
  redis.call('XADD', KEYS[6], '*', 'i', ARGV[1], 'r', ARGV[9])
  local delivered = redis.call('HINCRBY', KEYS[5], 'delivered', 1)
  local total = tonumber(redis.call('HGET', KEYS[5], 'total') or '0')
  if delivered >= total then
    redis.call('SREM', KEYS[7], ARGV[11])
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local keep = tonumber(redis.call('HGET', KEYS[5], 'retention_ms') or ARGV[13])
    redis.call('HSET', KEYS[5], 'finished', '1', 'finished_at_ms', now_ms)
    for _, j in ipairs({1, 2, 5, 6, 8, 9, 10, 11}) do
      redis.call('PEXPIRE', KEYS[j], keep)
    end
    redis.call('SET', KEYS[13], cjson.encode({reason = 'expired', finished_at_ms = now_ms,
                                              retention_ms = keep}),
               'PX', keep + tonumber(ARGV[14]))
  end
else
  redis.call('ZADD', KEYS[4], ARGV[10], member)
end
for j = 16, #KEYS do
  redis.call('LPUSH', KEYS[j], ARGV[n + j + 1])
end
return 1
