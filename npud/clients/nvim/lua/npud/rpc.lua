-- The npud socket protocol (docs/protocol.md) over a libuv pipe: newline-delimited JSON,
-- requests matched to their events and reply by `id`. No Python on the editor side.
--
-- Every callback given to this module runs on the main loop (vim.schedule), in the order
-- the messages arrived, so callers may touch buffers and call vim.notify from them.

local M = {}

local uv = vim.uv or vim.loop -- vim.uv from Neovim 0.10; Debian 12 ships 0.7 with vim.loop

M.DEFAULT_SOCKET = '/run/npud/npud.sock'

-- Where a per-user npud (`npud --model PATH`) listens, by the rule of npud/userdirs.py and
-- npud/clients/client.py: $XDG_RUNTIME_DIR/npud/npud.sock, else /tmp/npud-<uid>/npud.sock, but only
-- when that directory is this user's own and closed to others (anyone can make a directory in
-- /tmp and listen there as if it were npud, to read the prompts); nil when there is no such place.
function M.user_socket_path()
  local runtime = os.getenv('XDG_RUNTIME_DIR')
  if runtime and runtime:sub(1, 1) == '/' then
    return runtime .. '/npud/npud.sock'
  end
  local uid = uv.getuid()
  local dir = '/tmp/npud-' .. uid
  local st = uv.fs_lstat(dir)
  if not st or st.type ~= 'directory' or st.uid ~= uid or bit.band(st.mode, 63) ~= 0 then
    return nil -- 63 = 0o077: group or others may enter
  end
  return dir .. '/npud.sock'
end

-- The socket path: the explicit option, then g:npud_socket, then $NPUD_SOCKET, then the
-- system daemon's if it exists, then a per-user daemon's if it exists, else the system
-- daemon's path (so the error says nothing listens there): the order of the Python client
-- and npuctl.
function M.socket_path(explicit)
  if explicit and explicit ~= '' then
    return explicit
  end
  local g = vim.g.npud_socket
  if type(g) == 'string' and g ~= '' then
    return g
  end
  local env = os.getenv('NPUD_SOCKET')
  if env and env ~= '' then
    return env
  end
  if uv.fs_stat(M.DEFAULT_SOCKET) then
    return M.DEFAULT_SOCKET
  end
  local user = M.user_socket_path()
  if user and uv.fs_stat(user) then
    return user
  end
  return M.DEFAULT_SOCKET
end

-- JSON null decodes to vim.NIL; the protocol means "absent" by it.
function M.nonnull(value)
  if value == vim.NIL then
    return nil
  end
  return value
end

-- A connect failure as a sentence that says whether npud is running and what to do.
local function connect_message(path, err)
  local name = tostring(err):match('^(%u+)') or tostring(err)
  if name == 'ENOENT' or name == 'ECONNREFUSED' then
    return string.format(
      'cannot connect to npud at %s (%s): npud is not running; start it with '
        .. '`systemctl start npud`, or point $NPUD_SOCKET / g:npud_socket at its socket',
      path,
      err
    )
  elseif name == 'EACCES' or name == 'EPERM' then
    return string.format(
      'permission denied on %s (%s): your user must be in the group of npud\'s socket '
        .. '(server.socket_group)',
      path,
      err
    )
  end
  return string.format('cannot connect to npud at %s: %s', path, err)
end

local Conn = {}
Conn.__index = Conn

-- Open a connection. `on_ready(conn)` or `on_error(message)` is called once, on the main loop.
function M.connect(path, on_ready, on_error)
  local pipe, perr = uv.new_pipe(false)
  if not pipe then
    vim.schedule(function()
      on_error('cannot create a pipe: ' .. tostring(perr))
    end)
    return
  end
  local conn = setmetatable({
    path = path,
    pipe = pipe,
    partial = '',
    next_id = 1,
    pending = {}, -- id -> {on_event = fn(name, data), on_reply = fn(result, err)}
    closed = false,
  }, Conn)
  pipe:connect(path, function(err)
    if err then
      conn.closed = true
      pipe:close()
      vim.schedule(function()
        on_error(connect_message(path, err))
      end)
      return
    end
    pipe:read_start(function(rerr, chunk)
      conn:_on_read(rerr, chunk)
    end)
    vim.schedule(function()
      on_ready(conn)
    end)
  end)
end

-- Runs in the libuv callback (a fast context): split lines here, decode and dispatch on
-- the main loop.
function Conn:_on_read(err, chunk)
  if err or not chunk then
    local why = err and ('the connection to npud failed: ' .. tostring(err))
      or 'npud closed the connection (did it stop or restart?)'
    vim.schedule(function()
      self:_fail_all(why)
    end)
    return
  end
  local data = self.partial .. chunk
  local start = 1
  while true do
    local nl = data:find('\n', start, true)
    if not nl then
      break
    end
    local line = data:sub(start, nl - 1)
    start = nl + 1
    if line ~= '' then
      vim.schedule(function()
        self:_dispatch(line)
      end)
    end
  end
  self.partial = data:sub(start)
end

function Conn:_dispatch(line)
  local ok, msg = pcall(vim.json.decode, line)
  if not ok or type(msg) ~= 'table' then
    self:_fail_all('npud sent a line that is not JSON: ' .. line:sub(1, 120))
    return
  end
  local id = M.nonnull(msg.id)
  if id == nil then
    -- an error about a line the daemon could not read: ours are always well formed, so
    -- this is a protocol mismatch; every request on this connection is affected
    local e = M.nonnull(msg.error) or {}
    self:_fail_all(tostring(M.nonnull(e.message) or 'npud rejected a request'), M.nonnull(e.code))
    return
  end
  local handlers = self.pending[id]
  if not handlers then
    return -- a late message for a request we gave up on
  end
  if msg.event ~= nil then
    if handlers.on_event then
      handlers.on_event(msg.event, M.nonnull(msg.data) or {})
    end
    return
  end
  self.pending[id] = nil
  if msg.ok then
    handlers.on_reply(M.nonnull(msg.result), nil)
  else
    local e = M.nonnull(msg.error) or {}
    handlers.on_reply(nil, {
      code = M.nonnull(e.code) or 'internal_error',
      message = M.nonnull(e.message) or 'npud reported an error without a message',
    })
  end
end

function Conn:_fail_all(message, code)
  local pending = self.pending
  self.pending = {}
  self:close()
  for _, handlers in pairs(pending) do
    handlers.on_reply(nil, { code = code or 'connection_lost', message = message })
  end
end

-- Send one request. `on_reply(result, err)` is called exactly once; err is {code, message}.
-- Returns the request id.
function Conn:request(method, params, on_reply, on_event)
  local id = self.next_id
  self.next_id = id + 1
  if self.closed then
    vim.schedule(function()
      on_reply(nil, { code = 'connection_lost', message = 'the connection to npud is closed' })
    end)
    return id
  end
  local msg = { id = id, method = method }
  if params ~= nil and next(params) ~= nil then
    msg.params = params
  end
  self.pending[id] = { on_event = on_event, on_reply = on_reply }
  self.pipe:write(vim.json.encode(msg) .. '\n', function(err)
    if err then
      vim.schedule(function()
        self:_fail_all('cannot write to npud: ' .. tostring(err))
      end)
    end
  end)
  return id
end

-- Close the connection. npud cancels a `complete` whose connection closes.
function Conn:close()
  if self.closed then
    return
  end
  self.closed = true
  if not self.pipe:is_closing() then
    self.pipe:read_stop()
    self.pipe:close()
  end
end

return M
