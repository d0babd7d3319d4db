-- What :NpuComplete sends: the text before the cursor trimmed to the model's context, and,
-- when the model has fill-in-the-middle tokens, the text after the cursor as `suffix`.
--
-- The model's context and FIM support come from the daemon's `models` reply, asked once
-- per model (a model that is not loaded yet has neither; then DEFAULT_CONTEXT is assumed,
-- no suffix is sent, and the next completion asks again). The plugin cannot count tokens,
-- so it budgets bytes: `bytes_per_token` bytes a token (1 never overflows a byte-level BPE
-- tokenizer, whose every token is at least one byte).

local rpc = require('npud.rpc')

local M = {}

M.DEFAULT_CONTEXT = 2048
M.RESERVED_TOKENS = 4 -- the FIM marker tokens and a BOS
M.SUFFIX_SHARE = 0.25 -- at most this part of the budget goes to the suffix

-- model name ('' for the daemon's default model) -> { context_length = n, fim = bool }
local known = {}

function M.forget()
  known = {}
end

-- The facts of `model` (nil: the default), asked from the daemon over `conn` unless known;
-- calls done(info) with info = { context_length = n or nil, fim = bool }.
function M.model_info(conn, model, done)
  local key = model or ''
  if known[key] then
    done(known[key])
    return
  end
  local function ask(name)
    conn:request('models', nil, function(result, err)
      local info = { context_length = nil, fim = false }
      for _, m in ipairs((not err and rpc.nonnull(result.models)) or {}) do
        if m.name == name then
          info = { context_length = rpc.nonnull(m.context_length), fim = rpc.nonnull(m.fim) == true }
        end
      end
      if info.context_length ~= nil then
        known[key] = info
      end
      done(info)
    end)
  end
  if model then
    ask(model)
  else
    conn:request('hello', nil, function(result, err)
      ask(not err and rpc.nonnull(result.default_model) or nil)
    end)
  end
end

local function is_continuation(text, i)
  local b = text:byte(i)
  return b ~= nil and b >= 0x80 and b < 0xC0
end

-- The last `max_bytes` bytes of `text` at most, starting at a line start when the kept part
-- holds one, never inside a UTF-8 character.
function M.keep_end(text, max_bytes)
  if #text <= max_bytes then
    return text
  end
  local first = #text - math.max(max_bytes, 0) + 1
  while is_continuation(text, first) do
    first = first + 1
  end
  local nl = text:find('\n', first - 1, true) -- text[first - 1] == '\n': already at a line start
  if nl ~= nil and nl < #text then
    first = nl + 1
  end
  return text:sub(first)
end

-- The first `max_bytes` bytes of `text` at most, ending at a line end when the kept part
-- holds one, never inside a UTF-8 character.
function M.keep_start(text, max_bytes)
  if #text <= max_bytes then
    return text
  end
  local last = math.max(max_bytes, 0)
  while last > 0 and is_continuation(text, last + 1) do
    last = last - 1
  end
  local kept = text:sub(1, last)
  local nl = kept:match('.*()\n')
  if nl ~= nil and nl > 1 then
    kept = kept:sub(1, nl - 1)
  end
  return kept
end

-- The prompt and suffix for `before` / `after` the cursor under `info` (model_info's) and
-- the options max_tokens, bytes_per_token, context_length (an override): the suffix (FIM
-- models only; nil otherwise) gets up to SUFFIX_SHARE of the budget, the prefix the rest.
-- The budget leaves max_tokens of the context for the answer, but never less than a quarter
-- of the context for the prompt (the daemon clamps max_tokens to what fits).
function M.parts(before, after, info, opts)
  local context = opts.context_length or info.context_length or M.DEFAULT_CONTEXT
  local tokens = math.max(context - opts.max_tokens, math.floor(context / 4)) - M.RESERVED_TOKENS
  local budget = math.max(tokens, 1) * opts.bytes_per_token
  local suffix = nil
  if info.fim then
    suffix = M.keep_start(after, math.floor(budget * M.SUFFIX_SHARE))
    budget = budget - #suffix
  end
  return M.keep_end(before, budget), suffix
end

return M
