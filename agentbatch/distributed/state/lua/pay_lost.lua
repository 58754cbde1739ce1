-- What a provider batch billed for turns the sync API answered (their hedges won), on one
-- batch's meta, unless the batch is gone (expired or deleted): its spend (when priced; the
-- claims' max_cost_usd check and progress() read it) and the counts, in one atomic step.
-- KEYS: meta   ARGV: spend ('' = not priced), turns, prompt tokens, completion tokens
local meta_key = KEYS[1]
local spend, turns, prompt_tokens, completion_tokens = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
if redis.call('EXISTS', meta_key) == 0 then return 0 end
if spend ~= '' then redis.call('HINCRBYFLOAT', meta_key, 'spend', spend) end
redis.call('HINCRBY', meta_key, 'stat:hedge_lost_batch_paid', turns)
redis.call('HINCRBY', meta_key, 'stat:hedge_lost_batch_paid_prompt_tokens', prompt_tokens)
redis.call('HINCRBY', meta_key, 'stat:hedge_lost_batch_paid_completion_tokens',
           completion_tokens)
return 1
