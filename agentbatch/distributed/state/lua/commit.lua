-- Compare-and-set one agent transition; on a terminal state append its one result, and push
-- the agent's next task(s) in the same atomic step, so a successful write can never lose its
-- follow-up. A claimer that loses the compare-and-set still drops its lease and its inference
-- slot (if still ours), so the agent's next task is never refused as ``busy`` by a lease
-- nobody renews.
-- KEYS: state, lease, watch, meta, results, batches, audit, resends, plan, gone, msgs,
--       fence, calls, started,
--       then, counted by ARGV: the sem zset (when has_slot is '1'), the keys the transition
--       consumes (n_consumed: the round's tool fan-in hash, call locks), one queue list
--       per task payload, then the on_finish queue list (only when on_finish is given)
-- ARGV: index, expected_version, new_version, state_json (no messages, no tool log), token
--       ('' = no lease held), old_status, new_status, terminal ('1'|'0'), result_json,
--       deadline_ms, batch_id, audit ('1'|'0'), retention_ms (when meta has none),
--       tombstone_ms, msg_mode ('' = none new, 'a' = append, 'r' = replace),
--       has_slot ('1' when the turn holds an inference slot), n_consumed,
--       messages (JSON array of message JSON strings), records (JSON array of tool-call
--       record JSON strings), payloads (JSON array: one task message per queue list key),
--       on_finish (optional, '' = none: a task message pushed only by the commit that
--       finishes the batch: a pipeline stage's 'stage finished' task, patterns/pipeline_chain),
--       keep_transcript (optional, '1': a terminal agent keeps its msgs list, see below),
--       spend_usd (optional, '' = nothing to add: what this transition's new usage costs at
--       the batch's prices, US dollars, computed by the worker), replies (optional: the
--       model replies it adds)
-- Spend: a winning commit adds spend_usd to meta's ``spend`` (HINCRBYFLOAT) and replies to
-- its ``replies`` in this same atomic step, so the batch's spend is fleet-wide and a turn
-- that runs twice is paid into it once: the copy that loses the compare-and-set adds
-- nothing. Claims read ``spend`` to refuse new turns at ``max_cost_usd`` (claim.lua).
-- History is linear: the state hash holds the agent's scalars, the msgs list its
-- conversation and the calls list its tool-call log, and a transition RPUSHes only what it
-- adds to either (O(new), not O(history)).
-- A terminal agent keeps neither list: its result, appended here, is what readers get;
-- unless keep_transcript (asked for, or the agent failed): then its last messages are
-- appended as on any commit, the msgs list kept with the batch's retention TTL (from the
-- agent's end) and its result entry marked 'm' = '1' so readers fetch it (the messages are
-- never copied into the result). The calls list goes either way: the result holds the log.
-- ``resends`` is not touched: resend.lua counts per version, so a new version starts at 0.
-- ``started`` is not touched either: it names the version started, and this one is new.
-- Status counts: only ``n:awaiting_tools`` moves on the transitions within a run (needs_model
-- is total - delivered - awaiting_tools), and ``n:<terminal status>`` once per agent.
-- Retention: the commit that delivers the last result removes the batch from ``batches``
-- and gives every key of the batch the retention TTL (meta's ``retention_ms``, set at
-- submit), plus a ``gone`` tombstone that outlives them, all in this one atomic step.
local state_key, lease_key, watch_key, meta_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local results_key, batches_key, audit_key, resends_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local plan_key, gone_key, msgs_key, fence_key = KEYS[9], KEYS[10], KEYS[11], KEYS[12]
local calls_key, started_key = KEYS[13], KEYS[14]
local index, expected_version, new_version = ARGV[1], ARGV[2], ARGV[3]
local state_json, token, old_status, new_status = ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local terminal, result_json, deadline_ms, batch_id = ARGV[8] == '1', ARGV[9], ARGV[10], ARGV[11]
local audit, retention_ms, tombstone_ms = ARGV[12] == '1', ARGV[13], tonumber(ARGV[14])
local msg_mode, has_slot, n_consumed = ARGV[15], ARGV[16] == '1', tonumber(ARGV[17])
local messages, records, payloads = json_list(ARGV[18]), json_list(ARGV[19]), json_list(ARGV[20])
local on_finish = ARGV[21] or ''
local keep_transcript = ARGV[22] == '1'
local spend_usd, replies = ARGV[23] or '', tonumber(ARGV[24] or '0')
local next_key = 15
local sem_key = nil  -- nil: the turn holds no inference slot
if has_slot then sem_key, next_key = KEYS[15], 16 end
local consumed, queue_start = keys_from(next_key, n_consumed)
local n_queues, finish_queue = #KEYS - queue_start + 1, nil
if on_finish ~= '' then finish_queue, n_queues = KEYS[#KEYS], n_queues - 1 end
local queues = keys_from(queue_start, n_queues)
if #queues ~= #payloads then
  return redis.error_reply('commit: ' .. #queues .. ' queue keys for ' .. #payloads .. ' payloads')
end
local member = batch_id .. ':' .. index  -- in the fleet-wide watch zset

if token ~= '' and sem_key then redis.call('ZREM', sem_key, token) end
if version_of(redis.call('HGET', state_key, index)) ~= expected_version then
  if token ~= '' and redis.call('GET', lease_key) == token then redis.call('DEL', lease_key) end
  return 0
end
redis.call('HSET', state_key, index, new_version .. ':' .. state_json)
-- The lease of the version just replaced, whoever holds it: any holder of it now fails its
-- own compare-and-set, and the next version's claim must not find it busy.
if token ~= '' then redis.call('DEL', lease_key) end
if #consumed > 0 then redis.call('DEL', unpack(consumed)) end
if spend_usd ~= '' then
  redis.call('HINCRBYFLOAT', meta_key, 'spend', spend_usd)
  if replies > 0 then redis.call('HINCRBY', meta_key, 'replies', replies) end
end
if terminal and not keep_transcript then
  redis.call('DEL', msgs_key, calls_key)
else
  if msg_mode == 'r' then redis.call('DEL', msgs_key) end
  if #messages > 0 then redis.call('RPUSH', msgs_key, unpack(messages)) end
  if terminal then
    redis.call('DEL', calls_key)
    redis.call('PEXPIRE', msgs_key, tonumber(redis.call('HGET', meta_key, 'retention_ms')
                                            or retention_ms))
  elseif #records > 0 then
    redis.call('RPUSH', calls_key, unpack(records))
  end
end
if old_status ~= new_status then
  if old_status == 'awaiting_tools' then
    redis.call('HINCRBY', meta_key, 'n:awaiting_tools', -1)
  end
  if new_status == 'awaiting_tools' or terminal then
    redis.call('HINCRBY', meta_key, 'n:' .. new_status, 1)
  end
end
if audit then
  redis.call('XADD', audit_key, '*', 'i', index, 'v', new_version)
end
if terminal then
  redis.call('ZREM', watch_key, member)
  if keep_transcript then
    redis.call('XADD', results_key, '*', 'i', index, 'r', result_json, 'm', '1')
  else
    redis.call('XADD', results_key, '*', 'i', index, 'r', result_json)
  end
  local delivered = redis.call('HINCRBY', meta_key, 'delivered', 1)
  -- the batch's own total, never the worker's idea of it (a worker that misread the plan
  -- once finished a running batch); a meta without one (gone under us) finishes nothing
  local total = tonumber(redis.call('HGET', meta_key, 'total'))
  if total ~= nil and delivered >= total then
    redis.call('SREM', batches_key, batch_id)
    local t = redis.call('TIME')
    local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local keep = tonumber(redis.call('HGET', meta_key, 'retention_ms') or retention_ms)
    redis.call('HSET', meta_key, 'finished', '1', 'finished_at_ms', now_ms)
    for _, key in ipairs({state_key, meta_key, results_key, audit_key, resends_key, plan_key,
                          fence_key, started_key}) do
      redis.call('PEXPIRE', key, keep)
    end
    redis.call('SET', gone_key, cjson.encode({reason = 'expired', finished_at_ms = now_ms,
                                              retention_ms = keep}),
               'PX', keep + tombstone_ms)
    if finish_queue then redis.call('LPUSH', finish_queue, on_finish) end
  end
else
  redis.call('ZADD', watch_key, deadline_ms, member)
end
for j, queue in ipairs(queues) do
  redis.call('LPUSH', queue, payloads[j])
end
return 1
