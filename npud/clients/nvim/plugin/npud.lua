-- npud.nvim user commands; the work is in lua/npud/. Configure with
-- require('npud').setup({ socket = ..., model = ..., max_tokens = ... }).
if vim.g.loaded_npud then
  return
end
vim.g.loaded_npud = true

local function npud()
  return require('npud')
end

vim.api.nvim_create_user_command('NpuComplete', function()
  npud().complete()
end, { desc = 'npud: stream a completion of the text before the cursor' })

vim.api.nvim_create_user_command('NpuEdit', function(opts)
  npud().edit(opts.args, opts.line1, opts.line2)
end, { nargs = '+', range = true, desc = 'npud: rewrite the selection as {instruction} says' })

vim.api.nvim_create_user_command('NpuStatus', function()
  npud().status()
end, { desc = 'npud: device, queue and last ticket' })

vim.api.nvim_create_user_command('NpuCancel', function()
  npud().cancel()
end, { desc = "npud: cancel this editor's running request" })
