-- Let never-started agents wait on a busy queue (the sweep, sweep.py): once per version, and
-- again for as long as their queue keeps moving without having reached them.
-- KEYS: state, resends, watch, started
-- ARGV: later deadline (ms), batch id, indices (JSON array of the due agents' indices),
--       their due scores (JSON array, in the same order), then per queue the message at its
--       consuming end as the sweep read it: inference sent_ms, inference head id, tools
--       sent_ms, tools head id ('' = unknown: an empty queue, or a message without a stamp),
--       then the sweep's now (ms) and the queue grace (ms)
-- An agent let wait again looks again after as long as it has waited already (from its
-- message's send, its first due score - grace), at least until the later deadline: a batch
-- queued for minutes costs a few looks per agent and version, not one per two graces.
-- The "q:<index>" field of resends holds "<version>:<first due score>:<head id seen>": the
-- version let wait, its deadline when first found due (the commit's: its message was sent
-- one queue grace before) and the head of its queue then. An agent whose current version
-- was not started is let wait (its deadline moved to the later one) when
-- - it was not let wait at this version yet (the first look), or
-- - its queue moved since the last look (another message is at the consuming end) and that
--   message was sent no later than one grace after the agent's own (its first due score):
--   the FIFO list has not reached it, so it is still queued behind.
-- Else (its queue stood still, or moved past it) it is returned for a re-send. Returned too
-- (for the sweep to look at itself): the indices started at their current version, and
-- those gone or unreadable.
local state_key, resends_key, watch_key, started_key = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local later_ms, batch_id, indices = ARGV[1], ARGV[2], json_list(ARGV[3])
local scores = json_list(ARGV[4])
local heads = {inference = {ARGV[5] or '', ARGV[6] or ''},
               tools = {ARGV[7] or '', ARGV[8] or ''}}
local now, grace = tonumber(ARGV[9] or '0'), tonumber(ARGV[10] or '0')

-- "<version>:<first score>:<head id>", or a bare "<version>" (written before the head was
-- kept: it counts as let wait once, with nothing known of its queue then)
local function deferral(raw)
  if not raw then return nil end
  local v, first, head = string.match(raw, '^(%d+):(%d+):(.*)$')
  if v then return v, tonumber(first), head end
  return raw, nil, nil
end

-- the head of the agent's queue: awaiting_tools -> tools, else inference (nil: unreadable)
local function head_of(entry, v)
  local ok, state = pcall(cjson.decode, string.sub(entry, #v + 2))
  if not ok or type(state) ~= 'table' then return nil end
  if state.status == 'awaiting_tools' then return heads.tools end
  return heads.inference
end

local again = {}
for n, index in ipairs(indices) do
  local entry = redis.call('HGET', state_key, index)
  local v = version_of(entry)
  local wait, first, head = false, math.floor(tonumber(scores[n]) or 0), ''
  local until_ms = tonumber(later_ms)
  if v ~= nil and redis.call('HGET', started_key, index) ~= v then
    local queue = head_of(entry, v)
    local qv, seen_first, seen_head = deferral(redis.call('HGET', resends_key, 'q:' .. index))
    if queue then head = queue[2] end
    if qv ~= v then
      wait = true
    elseif queue and seen_first and queue[1] ~= '' and head ~= '' and head ~= seen_head
        and tonumber(queue[1]) <= seen_first then
      wait, first = true, seen_first
      until_ms = math.max(until_ms, now + (now - (seen_first - grace)))
    end
  end
  if wait then
    redis.call('HSET', resends_key, 'q:' .. index, v .. ':' .. first .. ':' .. head)
    redis.call('ZADD', watch_key, 'XX', until_ms, batch_id .. ':' .. index)
  else
    again[#again + 1] = index
  end
end
return again
