-- Make a staged batch live: rename its staged keys into place, never over an existing key.
-- A submitter may write a batch's own keys only through RENAMENX (deploy/redis-users.acl),
-- so it can create a batch and never rewrite another's; this script makes it all or nothing.
-- KEYS: staged state, staged plan, staged meta, staged gone, state, plan, meta, gone, batches
-- ARGV: total (agents the staged state must hold), running ("1": persist the staged keys and
--       add the batch to the active set; "0": a batch finished as written keeps its TTLs),
--       batch id
-- Returns 1, or an error: "EXISTS <key>" when a key of the batch is there already (nothing is
-- changed), "INCOMPLETE <n>" when the staged state holds n agents, not total (expired?).
for i = 5, 7 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    return redis.error_reply('EXISTS ' .. KEYS[i])
  end
end
local total = tonumber(ARGV[1])
if total > 0 then
  local have = redis.call('HLEN', KEYS[1])
  if have ~= total then return redis.error_reply('INCOMPLETE ' .. have) end
end
for i = 1, 4 do
  if redis.call('EXISTS', KEYS[i]) == 1 then
    if ARGV[2] == '1' then redis.call('PERSIST', KEYS[i]) end
    -- only the tombstone of an earlier batch with this id can be there: it stays
    if redis.call('RENAMENX', KEYS[i], KEYS[i + 4]) == 0 then redis.call('UNLINK', KEYS[i]) end
  end
end
if ARGV[2] == '1' then redis.call('SADD', KEYS[9], ARGV[3]) end
return 1
