-- Make a staged batch live: rename its staged keys into place, never over an existing key.
-- A submitter may write a batch's own keys only through RENAMENX (deploy/redis-users.acl),
-- so it can create a batch and never rewrite another's; this script makes it all or nothing.
-- KEYS: staged state, staged plan, staged meta, staged gone, state, plan, meta, gone, batches
-- ARGV: total (agents the staged state must hold), running ("1": persist the staged keys and
--       add the batch to the active set; "0": a batch finished as written keeps its TTLs),
--       batch id
-- Returns 1, or an error: "EXISTS <key>" when a key of the batch is there already (nothing is
-- changed), "INCOMPLETE <n>" when the staged state holds n agents, not total (expired?).
local staged = {KEYS[1], KEYS[2], KEYS[3], KEYS[4]}  -- state, plan, meta, gone
local live = {KEYS[5], KEYS[6], KEYS[7], KEYS[8]}    -- the same four, in place
local batches_key = KEYS[9]
local total, running, batch_id = tonumber(ARGV[1]), ARGV[2] == '1', ARGV[3]
for i = 1, 3 do  -- state, plan, meta (the tombstone of an earlier batch may stay)
  if redis.call('EXISTS', live[i]) == 1 then
    return redis.error_reply('EXISTS ' .. live[i])
  end
end
if total > 0 then
  local have = redis.call('HLEN', staged[1])
  if have ~= total then return redis.error_reply('INCOMPLETE ' .. have) end
end
for i = 1, 4 do
  if redis.call('EXISTS', staged[i]) == 1 then
    if running then redis.call('PERSIST', staged[i]) end
    -- only the tombstone of an earlier batch with this id can be there: it stays
    if redis.call('RENAMENX', staged[i], live[i]) == 0 then redis.call('UNLINK', staged[i]) end
  end
end
if running then redis.call('SADD', batches_key, batch_id) end
return 1
