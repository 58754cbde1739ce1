-- Prepended to every script (scripts.py): the two encodings the scripts share.
-- An agent's state hash entry is "<version>:<state JSON>", so one HGET answers both the
-- compare-and-set and the read, and one HSET writes both.
local function version_of(entry)
  if not entry then return nil end
  return string.match(entry, '^(%d+):')
end
-- An agent's progress deadline in the watch zset also says whether its current version was
-- started (claimed, or a tool call of it running: odd score) or is only queued (even), so
-- no separate "started" record costs a command per task. The sweep reads it with the score.
local function started_at(ms)
  ms = math.floor(tonumber(ms))
  return ms - ms % 2 + 1
end
local function queued_at(ms)
  ms = math.floor(tonumber(ms))
  return ms - ms % 2
end
