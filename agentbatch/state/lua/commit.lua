-- Compare-and-set one agent transition; on a terminal state append its one result, and push
-- the agent's next task(s) in the same atomic step, so a successful write can never lose its
-- follow-up. A claimer that loses the compare-and-set still drops its lease and its inference
-- slot (if still ours), so the agent's next task is never refused as ``busy`` by a lease
-- nobody renews.
-- KEYS: state, lease, watch, meta, results, batches, audit, resends, plan, gone, msgs,
--       sem zset (the lease key again when the turn holds no slot), fence, calls,
--       keys the transition consumes (the round's tool fan-in hash, call locks)...,
--       queue lists...
-- ARGV: index, expected_version, new_version, state_json (no messages, no tool log), token,
--       old_status, new_status, terminal ('1'|'0'), result_json, deadline_ms, batch_id,
--       audit ('1'|'0'), retention_ms (when meta has none), tombstone_ms,
--       n consumed keys, msg_mode ('' = none new, 'a' = append, 'r' = replace), n,
--       n messages, m, m tool-call records, payloads...
-- History is linear: the state hash holds the agent's scalars, the msgs list its
-- conversation and the calls list its tool-call log, and a transition RPUSHes only what it
-- adds to either (O(new), not O(history)).
-- A terminal agent keeps neither list: its result, appended here, is what readers get.
-- ``resends`` is not touched: resend.lua counts per version, so a new version starts at 0.
-- Status counts: only ``n:awaiting_tools`` moves on the transitions within a run (needs_model
-- is total - delivered - awaiting_tools), and ``n:<terminal status>`` once per agent.
-- Retention: the commit that delivers the last result removes the batch from ``batches``
-- and gives every key of the batch the retention TTL (meta's ``retention_ms``, set at
-- submit), plus a ``gone`` tombstone that outlives them, all in this one atomic step.
local member = ARGV[11] .. ':' .. ARGV[1]  -- in the fleet-wide watch zset
local token = ARGV[5]
if token ~= '' and KEYS[12] ~= KEYS[2] then redis.call('ZREM', KEYS[12], token) end
if version_of(redis.call('HGET', KEYS[1], ARGV[1])) ~= ARGV[2] then
  if token ~= '' and redis.call('GET', KEYS[2]) == token then redis.call('DEL', KEYS[2]) end
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3] .. ':' .. ARGV[4])
-- The lease of the version just replaced, whoever holds it: any holder of it now fails its
-- own compare-and-set, and the next version's claim must not find it busy.
if token ~= '' then redis.call('DEL', KEYS[2]) end
local consumed = tonumber(ARGV[15])
if consumed > 0 then redis.call('DEL', unpack(KEYS, 15, 14 + consumed)) end
local n = tonumber(ARGV[17])
local m = tonumber(ARGV[18 + n])
if ARGV[8] == '1' then
  redis.call('DEL', KEYS[11], KEYS[14])
else
  if ARGV[16] == 'r' then redis.call('DEL', KEYS[11]) end
  if n > 0 then redis.call('RPUSH', KEYS[11], unpack(ARGV, 18, 17 + n)) end
  if m > 0 then redis.call('RPUSH', KEYS[14], unpack(ARGV, 19 + n, 18 + n + m)) end
end
if ARGV[6] ~= ARGV[7] then
  if ARGV[6] == 'awaiting_tools' then
    redis.call('HINCRBY', KEYS[4], 'n:awaiting_tools', -1)
  end
  if ARGV[7] == 'awaiting_tools' or ARGV[8] == '1' then
    redis.call('HINCRBY', KEYS[4], 'n:' .. ARGV[7], 1)
  end
end
if ARGV[12] == '1' then
  redis.call('XADD', KEYS[7], '*', 'i', ARGV[1], 'v', ARGV[3])
end
if ARGV[8] == '1' then
  redis.call('ZREM', KEYS[3], member)
  redis.call('XADD', KEYS[5], '*', 'i', ARGV[1], 'r', ARGV[9])
  local delivered = redis.call('HINCRBY', KEYS[4], 'delivered', 1)
  -- the batch's own total, never the worker's idea of it (a worker that misread the plan
  -- once finished a running batch); a meta without one (gone under us) finishes nothing
  local total = tonumber(redis.call('HGET', KEYS[4], 'total'))
  if total ~= nil and delivered >= total then
    redis.call('SREM', KEYS[6], ARGV[11])
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local keep = tonumber(redis.call('HGET', KEYS[4], 'retention_ms') or ARGV[13])
    redis.call('HSET', KEYS[4], 'finished', '1', 'finished_at_ms', now_ms)
    for _, j in ipairs({1, 4, 5, 7, 8, 9, 13}) do
      redis.call('PEXPIRE', KEYS[j], keep)
    end
    redis.call('SET', KEYS[10], cjson.encode({reason = 'expired', finished_at_ms = now_ms,
                                              retention_ms = keep}),
               'PX', keep + tonumber(ARGV[14]))
  end
else
  redis.call('ZADD', KEYS[3], queued_at(ARGV[10]), member)
end
local first_queue = 14 + consumed
for j = first_queue + 1, #KEYS do
  redis.call('LPUSH', KEYS[j], ARGV[18 + n + m + j - first_queue])
end
return 1
