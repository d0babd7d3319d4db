-- npud.nvim: completions and edits from a local npud daemon, streamed into the buffer.
--
-- Every request is a protocol `complete` (interactive priority) on its own connection;
-- closing that connection cancels it in the daemon. The streamed text lives between two
-- extmarks, so edits elsewhere in the buffer while it streams do not disturb it, and the
-- region ends up holding exactly the daemon's final text.

local context = require('npud.context')
local rpc = require('npud.rpc')

local M = {}

M.config = {
  socket = nil, -- nil: g:npud_socket, $NPUD_SOCKET, /run/npud/npud.sock, a per-user npud's socket
  model = nil, -- nil: the daemon's default model
  max_tokens = 256,
  context_length = nil, -- nil: the model's, from the daemon (see npud.context)
  bytes_per_token = 2, -- how many bytes of text one token is assumed to hold when trimming
  stop = nil, -- a list of stop strings for :NpuComplete
  spec = nil, -- speculative decoding params, e.g. { method = 'ngram', k = 4 }
  edit_system_prompt = 'Rewrite the text the user gives you as the instruction says. '
    .. 'Reply with the rewritten text only: no explanation, no code fences.',
}

local ns = vim.api.nvim_create_namespace('npud')

-- The one request this editor has running, or nil.
--   kind 'complete' | 'edit'; conn; job (id, known from the first ticket event);
--   buf; start_mark, end_mark (extmark ids around the streamed text); streamed (text so
--   far); original (lines the edit replaces, for restoring); cancelled; finished
local active = nil

function M.setup(opts)
  M.config = vim.tbl_deep_extend('force', M.config, opts or {})
end

local function notify(message, level)
  vim.notify('npud: ' .. message, level or vim.log.levels.INFO, { title = 'npud' })
end

-- true while a request of this editor is running
function M.busy()
  return active ~= nil
end

local function split_lines(text)
  return vim.split(text, '\n', { plain = true })
end

local function mark_pos(buf, id)
  local pos = vim.api.nvim_buf_get_extmark_by_id(buf, ns, id, {})
  return pos[1], pos[2]
end

-- The changes of one request are joined into one undo step, so one `u` takes the whole
-- completion back; its first change starts that step (joining it would fold the user's
-- last edit into it).
local function join_undo(req)
  if req.changed and vim.api.nvim_get_current_buf() == req.buf then
    pcall(vim.cmd, 'undojoin') -- fails right after an undo; then the step simply starts anew
  end
  req.changed = true
end

-- Replace the text between the request's marks with `text`.
local function set_region(req, text)
  local sr, sc = mark_pos(req.buf, req.start_mark)
  local er, ec = mark_pos(req.buf, req.end_mark)
  join_undo(req)
  vim.api.nvim_buf_set_text(req.buf, sr, sc, er, ec, split_lines(text))
  -- the end mark sits at the replaced end; put it after the new text
  local lines = split_lines(text)
  local nr = sr + #lines - 1
  local nc = (#lines == 1) and (sc + #lines[1]) or #lines[#lines]
  vim.api.nvim_buf_set_extmark(req.buf, ns, nr, nc, { id = req.end_mark, right_gravity = true })
end

local function append(req, text)
  if text == '' then
    return
  end
  local er, ec = mark_pos(req.buf, req.end_mark)
  join_undo(req)
  -- the end mark has right gravity: it moves past what is inserted at it
  vim.api.nvim_buf_set_text(req.buf, er, ec, er, ec, split_lines(text))
end

-- A chat model may still wrap a rewrite in a code fence; take it off.
function M.strip_fences(text)
  local lines = split_lines(text)
  while #lines > 0 and lines[#lines]:match('^%s*$') do
    table.remove(lines)
  end
  if #lines >= 2 and lines[1]:match('^%s*```[%w_+.-]*%s*$') and lines[#lines]:match('^%s*```%s*$') then
    table.remove(lines, 1)
    table.remove(lines)
    return table.concat(lines, '\n')
  end
  return text
end

local function finish(req)
  if req.finished then
    return false
  end
  req.finished = true
  if active == req then
    active = nil
  end
  req.conn:close()
  if vim.api.nvim_buf_is_valid(req.buf) then
    vim.api.nvim_buf_del_extmark(req.buf, ns, req.start_mark)
    vim.api.nvim_buf_del_extmark(req.buf, ns, req.end_mark)
  end
  vim.api.nvim_exec_autocmds('User', { pattern = 'NpuDone', modeline = false })
  return true
end

local function restore_original(req)
  if req.original ~= nil and req.streamed ~= nil and vim.api.nvim_buf_is_valid(req.buf) then
    set_region(req, req.original)
  end
end

local function on_token(req, data)
  if req.finished or not vim.api.nvim_buf_is_valid(req.buf) then
    return
  end
  local text = rpc.nonnull(data.text) or ''
  if req.streamed == nil then
    -- first text: an edit removes the selection only now, so an early error leaves it as it was
    req.streamed = ''
    if req.kind == 'edit' then
      set_region(req, '')
    end
  end
  req.streamed = req.streamed .. text
  append(req, text)
end

local function on_reply(req, result, err)
  if req.finished then
    return
  end
  if err then
    if req.kind == 'edit' then
      restore_original(req)
    end
    finish(req)
    notify(err.message, vim.log.levels.ERROR)
    return
  end
  if not vim.api.nvim_buf_is_valid(req.buf) then
    finish(req)
    return
  end
  local text = rpc.nonnull(result.text) or ''
  local reason = rpc.nonnull(result.finish_reason)
  if reason == 'cancelled' then
    if req.kind == 'edit' then
      restore_original(req)
    elseif text ~= (req.streamed or '') then
      set_region(req, text) -- what the daemon generated before it stopped
    end
    finish(req)
    notify(string.format('cancelled (job %s)', tostring(rpc.nonnull(result.job) or req.job or '?')))
    return
  end
  if req.kind == 'edit' then
    text = M.strip_fences(text)
    if text == '' then
      restore_original(req)
      finish(req)
      notify('the model returned an empty rewrite; the selection is unchanged', vim.log.levels.WARN)
      return
    end
  end
  -- the final text is the truth (a stop string may cut what was streamed)
  if text ~= (req.streamed or '') or (req.kind == 'edit' and req.streamed == nil) then
    set_region(req, text)
  end
  finish(req)
end

-- Start a `complete` whose text goes between (sr, sc) and (er, ec) of `buf`. `params` is
-- a table, or a function of the model's facts (npud.context.model_info) returning one.
local function start(kind, buf, region, params, original)
  if active ~= nil then
    notify('a request is already running; :NpuCancel stops it', vim.log.levels.WARN)
    return
  end
  local sr, sc, er, ec = unpack(region)
  local req = {
    kind = kind,
    buf = buf,
    original = original,
    start_mark = vim.api.nvim_buf_set_extmark(buf, ns, sr, sc, { right_gravity = false }),
    end_mark = vim.api.nvim_buf_set_extmark(buf, ns, er, ec, { right_gravity = true }),
    finished = false,
    cancelled = false,
  }
  active = req
  local cfg = M.config
  local function send(conn, p)
    if req.cancelled then -- :NpuCancel before the request went out
      on_reply(req, { text = '', finish_reason = 'cancelled' }, nil)
      return
    end
    p.model = cfg.model
    p.max_tokens = cfg.max_tokens
    p.spec = cfg.spec
    conn:request('complete', p, function(result, err)
      on_reply(req, result, err)
    end, function(name, data)
      if name == 'ticket' then
        req.job = rpc.nonnull(data.job) or req.job
      elseif name == 'token' then
        on_token(req, data)
      end
    end)
  end
  rpc.connect(rpc.socket_path(cfg.socket), function(conn)
    req.conn = conn
    if type(params) == 'function' then
      context.model_info(conn, cfg.model, function(info)
        if not req.finished then
          send(conn, params(info))
        end
      end)
    else
      send(conn, params)
    end
  end, function(message)
    req.conn = { close = function() end }
    finish(req)
    notify(message, vim.log.levels.ERROR)
  end)
end

-- :NpuComplete: continue the text before the cursor (trimmed to the model's context, the
-- text nearest the cursor kept), with the text after it as the FIM suffix when the model
-- has FIM tokens. From normal mode the character under the cursor counts as before it
-- (like `a`), so the end of a line is continued.
function M.complete()
  local buf = vim.api.nvim_get_current_buf()
  local row, col = unpack(vim.api.nvim_win_get_cursor(0))
  local line = vim.api.nvim_buf_get_lines(buf, row - 1, row, true)[1]
  if vim.api.nvim_get_mode().mode:sub(1, 1) ~= 'i' then
    col = col + #vim.fn.matchstr(line:sub(col + 1), '^.')
  end
  local before = table.concat(vim.api.nvim_buf_get_text(buf, 0, 0, row - 1, col, {}), '\n')
  if before == '' then
    notify('there is no text before the cursor to complete', vim.log.levels.WARN)
    return
  end
  local last = vim.api.nvim_buf_line_count(buf)
  local after = table.concat(vim.api.nvim_buf_get_text(buf, row - 1, col, last - 1,
    #vim.api.nvim_buf_get_lines(buf, last - 1, last, true)[1], {}), '\n')
  start('complete', buf, { row - 1, col, row - 1, col }, function(info)
    local prompt, suffix = context.parts(before, after, info, M.config)
    return { prompt = prompt, suffix = suffix, stop = M.config.stop }
  end, nil)
end

-- The region of a command range: the characters of the last visual selection when it was
-- charwise and the range is that selection, otherwise whole lines.
local function selection(buf, line1, line2)
  local vs = vim.fn.getpos("'<")
  local ve = vim.fn.getpos("'>")
  if vim.fn.visualmode() == 'v' and vs[2] == line1 and ve[2] == line2 then
    local last = vim.api.nvim_buf_get_lines(buf, line2 - 1, line2, true)[1]
    local sc = math.min(vs[3] - 1, #vim.api.nvim_buf_get_lines(buf, line1 - 1, line1, true)[1])
    local ec = math.min(ve[3] - 1, #last)
    ec = ec + #vim.fn.matchstr(last:sub(ec + 1), '^.') -- include the whole last character
    return { line1 - 1, sc, line2 - 1, ec }
  end
  local last = vim.api.nvim_buf_get_lines(buf, line2 - 1, line2, true)[1]
  return { line1 - 1, 0, line2 - 1, #last }
end

-- :[range]NpuEdit {instruction}: rewrite the selection as instructed, streamed in its place.
function M.edit(instruction, line1, line2)
  if instruction == nil or instruction:match('^%s*$') then
    notify('usage: :NpuEdit {instruction} (on a visual selection)', vim.log.levels.ERROR)
    return
  end
  local buf = vim.api.nvim_get_current_buf()
  local region = selection(buf, line1, line2)
  local original = table.concat(vim.api.nvim_buf_get_text(buf, region[1], region[2], region[3], region[4], {}), '\n')
  local ft = vim.bo[buf].filetype
  local user = string.format('%s\n\n```%s\n%s\n```', instruction, ft, original)
  local messages = {
    { role = 'system', content = M.config.edit_system_prompt },
    { role = 'user', content = user },
  }
  start('edit', buf, region, { messages = messages }, original)
end

-- :NpuCancel: stop this editor's running request. With its job id known the daemon is
-- asked to cancel it (the reply then says `cancelled`); before that, closing the
-- connection cancels it.
function M.cancel()
  local req = active
  if req == nil then
    notify('nothing to cancel', vim.log.levels.WARN)
    return
  end
  req.cancelled = true
  if req.conn == nil then
    return -- still connecting; the connect callback sees `cancelled`
  end
  if req.job ~= nil then
    req.conn:request('cancel', { job = req.job }, function(_, err)
      if err and not req.finished then
        on_reply(req, nil, err)
      end
    end)
  else
    on_reply(req, { text = '', finish_reason = 'cancelled' }, nil)
  end
end

local function fmt_time(t)
  t = rpc.nonnull(t)
  if t == nil then
    return '-'
  end
  return os.date('%H:%M:%S', math.floor(t))
end

local function describe_ticket(t)
  if t == nil then
    return 'none'
  end
  local parts = { string.format('#%d job %d %s %s', t.ticket, t.job, t.priority, t.state) }
  local outcome = rpc.nonnull(t.outcome)
  if outcome then
    local reason = rpc.nonnull(t.reason)
    parts[#parts + 1] = reason and string.format('(%s: %s)', outcome, reason) or string.format('(%s)', outcome)
  end
  parts[#parts + 1] = string.format('queued %s', fmt_time(t.queued_at))
  local granted, queued = rpc.nonnull(t.granted_at), rpc.nonnull(t.queued_at)
  if granted and queued then
    parts[#parts + 1] = string.format('waited %d ms', math.floor((granted - queued) * 1000 + 0.5))
  end
  parts[#parts + 1] = string.format('%d tokens', rpc.nonnull(t.tokens) or 0)
  local drafted, accepted = rpc.nonnull(t.drafted) or 0, rpc.nonnull(t.accepted) or 0
  if drafted > 0 then
    parts[#parts + 1] = string.format('acceptance %d%%', math.floor(100 * accepted / drafted + 0.5))
  end
  return table.concat(parts, ' ')
end

-- The lines :NpuStatus shows, from the replies of device.status, stats and tickets.
function M.status_lines(device, stats, tickets)
  local lines = {}
  local dev = string.format('device: %s (%s)', device.kind, rpc.nonnull(device.reason) or '')
  local q = rpc.nonnull(device.quarantine)
  if q then
    dev = dev .. string.format('; QUARANTINED since %s: %s', fmt_time(q.since), rpc.nonnull(q.reason) or '?')
  end
  local thermal = rpc.nonnull(device.thermal) or {}
  local reading = rpc.nonnull(thermal.reading_c)
  dev = dev .. string.format('; thermal %s%s', rpc.nonnull(thermal.state) or '?',
    reading and string.format(' %.1f°C', reading) or '')
  local errors = rpc.nonnull(device.errors) or {}
  dev = dev .. string.format('; errors %d', rpc.nonnull(errors.count) or 0)
  lines[#lines + 1] = dev
  local queue = rpc.nonnull(stats.queue) or {}
  lines[#lines + 1] = string.format('queue: %d interactive, %d batch; holding: %s', queue.interactive or 0,
    queue.batch or 0, describe_ticket(rpc.nonnull(stats.granted)))
  local list = rpc.nonnull(tickets.tickets) or {}
  lines[#lines + 1] = 'last ticket: ' .. describe_ticket(list[1])
  if active ~= nil then
    lines[#lines + 1] = string.format('this editor: %s running (job %s)', active.kind, tostring(active.job or '?'))
  end
  return lines
end

-- :NpuStatus: the device, the queue and the last ticket, as one notification.
function M.status()
  rpc.connect(rpc.socket_path(M.config.socket), function(conn)
    local replies, failed = {}, false
    local function done(key)
      return function(result, err)
        if failed then
          return
        end
        if err then
          failed = true
          conn:close()
          notify(err.message, vim.log.levels.ERROR)
          return
        end
        replies[key] = result
        if replies.device and replies.stats and replies.tickets then
          conn:close()
          notify(table.concat(M.status_lines(replies.device, replies.stats, replies.tickets), '\n'))
        end
      end
    end
    conn:request('device.status', nil, done('device'))
    conn:request('stats', nil, done('stats'))
    conn:request('tickets', { limit = 1 }, done('tickets'))
  end, function(message)
    notify(message, vim.log.levels.ERROR)
  end)
end

return M
