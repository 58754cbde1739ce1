-- Re-send a lost agent's task(s), atomically with counting it and moving its deadline.
-- KEYS: state, lease, watch, resends, meta, audit, started, pbatch, then one queue list per
--       payload
-- ARGV: index, version, now_ms, base_ms, max_resends, audit ('1'|'0'), watch member,
--       deadline score the sweep read ('' = do not check), payloads (JSON array: one task
--       message per queue list key), model turn ('1' when the version's task is a model
--       turn, '0' for tool calls)
-- Returns -1 when the agent moved on, is leased again or its deadline is no longer the one
-- the sweep read (nothing sent), -2 when it was
-- re-sent max_resends times at this version already (nothing sent: the caller ends it),
-- else the number of re-sends at this version, this one included. The next look is
-- base_ms later, doubling with each re-send that made no progress (at most 32x); the
-- re-sent version counts as queued (its started mark is dropped) until a worker starts it.
-- Re-sent messages go to the consuming end of the list (RPUSH): recovery jumps the queue.
-- Returned as {n, paid}: paid is 1 when the version's last holder had a provider-batch turn's
-- sync hedge request in flight (its intent, ``hedge_intent.lua``, still in ``pbatch``): the
-- provider bills it and no commit carries it, so it is counted with the re-send
-- (``stat:hedge_sync_paid_unknown``: a request paid, its tokens not known) and the intent
-- dropped (also when the re-send cap is reached: the caller ends the agent); 2 when the
-- version is a model turn a worker had started (its started mark) that is neither a hedge
-- (above) nor in a provider batch (``pbatch`` field "<index>:<version>": the re-sent turn
-- adopts that batch and pays nothing again): its worker may have sent the sync request, which
-- the provider bills and no commit carries, so it is counted (``stat:sync_turn_maybe_paid``:
-- maybe paid, its tokens not known); else 0. A re-sent turn that runs again is
-- ``stat:recovered``; these are what its first run may have paid.
local state_key, lease_key, watch_key, resends_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local meta_key, audit_key, started_key, pbatch_key = KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local queues = keys_from(9, #KEYS - 8)
local index, version, now, base_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local max_resends, audit, member, seen_score = tonumber(ARGV[5]), ARGV[6] == '1', ARGV[7], ARGV[8]
local payloads = json_list(ARGV[9])
local model_turn = ARGV[10] == '1'
if #queues ~= #payloads then
  return redis.error_reply('resend: ' .. #queues .. ' queue keys for ' .. #payloads .. ' payloads')
end

if version_of(redis.call('HGET', state_key, index)) ~= version then return {-1, 0} end
if redis.call('EXISTS', lease_key) == 1 then return {-1, 0} end
-- The fence of the sweep's pass: another sweeper (this one's lock lapsed mid-pass) that
-- re-sent the agent, or anything else that touched it, moved the deadline since it was read.
if seen_score ~= '' and tonumber(redis.call('ZSCORE', watch_key, member)) ~= tonumber(seen_score) then
  return {-1, 0}
end
local paid = 0
local intent = 's:' .. index .. ':' .. version
if redis.call('HDEL', pbatch_key, intent) == 1 then
  redis.call('HINCRBY', meta_key, 'stat:hedge_sync_paid_unknown', 1)
  paid = 1
end
local started = redis.call('HGET', started_key, index)
if paid == 0 and model_turn and started and started == version
    and redis.call('HEXISTS', pbatch_key, index .. ':' .. version) == 0 then
  redis.call('HINCRBY', meta_key, 'stat:sync_turn_maybe_paid', 1)
  paid = 2
end
local n = 1
local prev = redis.call('HGET', resends_key, index)
if prev then
  local pv, pc = string.match(prev, '^(%d+):(%d+)$')
  if pv == version then n = tonumber(pc) + 1 end
end
if n > max_resends then return {-2, paid} end
redis.call('HSET', resends_key, index, version .. ':' .. n)
local wait = base_ms * 2 ^ math.min(n - 1, 5)
redis.call('ZADD', watch_key, math.floor(now + wait), member)
redis.call('HDEL', started_key, index)
redis.call('HINCRBY', meta_key, 'stat:recovered', 1)
if audit then redis.call('XADD', audit_key, '*', 'i', index, 'resent', version) end
for j, queue in ipairs(queues) do
  redis.call('RPUSH', queue, payloads[j])
end
return {n, paid}
