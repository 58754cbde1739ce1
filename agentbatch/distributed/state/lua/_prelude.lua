-- Prepended to every script (scripts.py): the encodings and conventions the scripts share.
-- Each script binds its KEYS and ARGV to named locals at its top; its header lists them.
-- An agent's state hash entry is "<version>:<state JSON>", so one HGET answers both the
-- compare-and-set and the read, and one HSET writes both.
local function version_of(entry)
  if not entry then return nil end
  return string.match(entry, '^(%d+):')
end
-- A variable-length part (messages, records, task payloads, indices) travels as one
-- argument: a JSON array of strings.
local function json_list(arg)
  if arg == nil or arg == '' or arg == '[]' then return {} end
  return cjson.decode(arg)
end
-- A script's variable keys follow its fixed ones in KEYS, counted by its arguments:
-- KEYS[first .. first + n - 1] as a list, and the index of the key after them.
local function keys_from(first, n)
  local list = {}
  for j = first, first + n - 1 do list[#list + 1] = KEYS[j] end
  return list, first + n
end
-- The ``started`` hash holds, per agent, the version last started (claimed, or a tool call
-- of it run): the sweep re-sends a started version at once (its worker died), while a
-- version only queued may still be waiting in its queue.
local function mark_started(started_key, index, version)
  redis.call('HSET', started_key, index, version)
end
