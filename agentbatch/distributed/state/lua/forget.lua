-- A provider-batch turn's version is committed (or lost to another delivery that committed
-- it): drop its provider batch record and its sync hedge intent (``hedge_intent.lua``). An
-- intent left by another holder of the turn (one killed, or whose lease lapsed, while its
-- hedge request was in flight: paid, and in no commit) is counted on the batch, unless the
-- batch is gone: ``stat:hedge_sync_paid_unknown``. The worker's own intent is its request:
-- committed with its answer, or reported as the loser (``dropped_conflict``).
-- KEYS: pbatch, meta   ARGV: record field, intent field, token ('' = none held)
-- Returns 1 when another holder's intent was counted, else 0.
local pbatch_key, meta_key = KEYS[1], KEYS[2]
local record, field, token = ARGV[1], ARGV[2], ARGV[3]
redis.call('HDEL', pbatch_key, record)
local intent = redis.call('HGET', pbatch_key, field)
if not intent then return 0 end
redis.call('HDEL', pbatch_key, field)
if intent == token or redis.call('EXISTS', meta_key) == 0 then return 0 end
redis.call('HINCRBY', meta_key, 'stat:hedge_sync_paid_unknown', 1)
return 1
