-- A worker is about to send a provider-batch turn's sync hedge request (which the provider
-- bills, answered or not): record the intent in the batch's ``pbatch`` hash, field
-- "s:<index>:<version>" -> the lease token of the worker sending it. The commit of that
-- version's turn clears it (``forget.lua``, after the compare-and-set); a worker killed
-- before then leaves it, and whoever takes the turn over counts it (``resend.lua``, this
-- script, ``forget.lua``): ``stat:hedge_sync_paid_unknown``, a request paid whose tokens are
-- not known.
-- KEYS: pbatch, meta   ARGV: intent field, token, ttl_ms (the hash's, when it has none)
-- Returns 1 when another holder's intent was there (counted, then replaced), else 0.
local pbatch_key, meta_key = KEYS[1], KEYS[2]
local field, token, ttl_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local found = 0
local prev = redis.call('HGET', pbatch_key, field)
if prev and prev ~= token and redis.call('EXISTS', meta_key) == 1 then
  redis.call('HINCRBY', meta_key, 'stat:hedge_sync_paid_unknown', 1)
  found = 1
end
redis.call('HSET', pbatch_key, field, token)
if redis.call('PTTL', pbatch_key) < 0 then redis.call('PEXPIRE', pbatch_key, ttl_ms) end
return found
