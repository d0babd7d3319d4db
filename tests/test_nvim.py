"""The Neovim plugin (npud/clients/nvim) driven through headless Neovim against a real npud on a
tiny model; each test checks the buffer's text (and the notifications) afterwards.

The expected text of a completion or an edit is what the client library gets from the same
daemon for the same prompt (greedy decoding is deterministic), so the plugin must send the
right prompt and put every streamed piece in the right place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from npud.clients.client import Client
from npud_fixture import FIM_CONTEXT, FIM_MODEL, MODEL, REPO, python_env, start_daemon, stop_daemon

PLUGIN = REPO / "npud" / "clients" / "nvim"
NVIM = shutil.which("nvim")


def _nvim_version() -> tuple[int, ...]:
    first = subprocess.run([NVIM, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    m = re.search(r"v(\d+)\.(\d+)", first)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


pytestmark = [
    pytest.mark.skipif(NVIM is None, reason="nvim is not installed (Debian: apt-get install -y neovim); "
                                            "these tests drive headless Neovim"),
    pytest.mark.skipif(NVIM is not None and _nvim_version() < (0, 7),
                       reason="the plugin needs Neovim >= 0.7 (nvim_create_user_command)"),
    pytest.mark.slow,
]

EDIT_SYSTEM = ("Rewrite the text the user gives you as the instruction says. "
               "Reply with the rewritten text only: no explanation, no code fences.")

# Loaded before every scenario: records notifications, waits for the plugin, dumps the state.
HELPER = r"""
_G.T = { notes = {} }
vim.notify = function(msg, level)
  table.insert(T.notes, { msg = msg, level = level or vim.log.levels.INFO })
end
function T.wait_idle(ms)
  if not vim.wait(ms or 60000, function() return not require('npud').busy() end, 5) then
    table.insert(T.notes, { msg = 'TEST: the request did not end', level = -1 })
  end
end
function T.wait_notes(n, ms)
  if not vim.wait(ms or 60000, function() return #T.notes >= n end, 5) then
    table.insert(T.notes, { msg = 'TEST: no notification came', level = -1 })
  end
end
function T.text()
  return table.concat(vim.api.nvim_buf_get_lines(0, 0, -1, true), '\n')
end
function T.dump(path, extra)
  local f = assert(io.open(path, 'w'))
  f:write(vim.json.encode({ buffer = T.text(), notes = T.notes, extra = extra or vim.empty_dict() }))
  f:close()
end
"""


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("nvim"), fim=True)
    yield d
    stop_daemon(d)


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.socket) as c:
        yield c


def run_nvim(tmp_path: Path, scenario: str, socket_path: str | None, timeout: float = 120,
             env: dict[str, str] | None = None) -> dict:
    """Run a Lua scenario in headless Neovim with the plugin loaded; returns what it dumped
    (`T.dump(OUT)`): the buffer text, the notifications, and any extra values."""
    helper = tmp_path / "helper.lua"
    helper.write_text(HELPER)
    out = tmp_path / "out.json"
    script = tmp_path / "scenario.lua"
    script.write_text(scenario.replace("OUT", json.dumps(str(out))))
    proc = subprocess.run(
        [NVIM, "--headless", "--clean", "-u", "NONE", "-i", "NONE", "-n",
         "--cmd", f"set runtimepath^={PLUGIN}",
         "-c", "runtime plugin/npud.lua", "-c", f"luafile {helper}", "-c", f"luafile {script}", "-c", "qa!"],
        cwd=tmp_path, env={**python_env(socket_path), **(env or {})}, capture_output=True, timeout=timeout)
    assert out.exists(), f"nvim wrote no result (exit {proc.returncode}): {proc.stderr.decode(errors='replace')}"
    return json.loads(out.read_text(encoding="utf-8"))


def lua_lines(lines: list[str]) -> str:
    return "{" + ", ".join(json.dumps(x) for x in lines) + "}"


def errors(state: dict) -> list[str]:
    return [n["msg"] for n in state["notes"] if n["level"] >= 4 or n["level"] < 0]  # vim.log.levels.ERROR = 4


def edit_messages(instruction: str, filetype: str, original: str) -> list[dict]:
    return [{"role": "system", "content": EDIT_SYSTEM},
            {"role": "user", "content": f"{instruction}\n\n```{filetype}\n{original}\n```"}]


def test_complete_inserts_the_stream_at_the_cursor(daemon, client, tmp_path):
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ max_tokens = 8 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(["x = 1", "def add(a, b):", "# tail"])})
        vim.o.undolevels = vim.o.undolevels  -- an undo break, as after typing
        vim.api.nvim_win_set_cursor(0, {{2, 13}})  -- on the ':' (normal mode): completes after it
        vim.cmd('NpuComplete')
        T.wait_idle()
        local done = T.text()
        vim.cmd('undo')
        T.dump(OUT, {{ after_undo = T.text(), done = done }})
    """, daemon.socket)
    assert errors(state) == []
    expected = client.complete("x = 1\ndef add(a, b):", max_tokens=8).wait()["text"]
    assert expected and "\x00" not in expected
    assert state["extra"]["done"] == f"x = 1\ndef add(a, b):{expected}\n# tail"
    assert state["extra"]["after_undo"] == "x = 1\ndef add(a, b):\n# tail"  # one undo takes it all back
    newest = client.jobs(limit=1)["jobs"][0]
    assert newest["priority"] == "interactive" and newest["interactive"] is True


@pytest.mark.skipif(os.path.exists("/run/npud/npud.sock"), reason="a system npud listens here: it comes first")
def test_without_a_socket_setting_the_plugin_finds_a_per_user_npud(daemon, client, tmp_path):
    runtime = tmp_path / "run"
    (runtime / "npud").mkdir(parents=True)
    (runtime / "npud" / "npud.sock").symlink_to(daemon.socket)  # where `npud --model` would listen
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ max_tokens = 8 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(["def add(a, b):"])})
        vim.api.nvim_win_set_cursor(0, {{1, 13}})
        vim.cmd('NpuComplete')
        T.wait_idle()
        T.dump(OUT, {{ path = require('npud.rpc').socket_path(nil) }})
    """, None, env={"XDG_RUNTIME_DIR": str(runtime)})
    assert errors(state) == []
    assert state["extra"]["path"] == str(runtime / "npud" / "npud.sock")
    expected = client.complete("def add(a, b):", max_tokens=8).wait()["text"]
    assert state["buffer"] == f"def add(a, b):{expected}"


@pytest.mark.skipif(os.path.exists(f"/tmp/npud-{os.getuid()}"), reason="a per-user npud's directory exists")
def test_the_tmp_fallback_is_taken_only_when_it_is_the_users_own_and_closed(tmp_path):
    directory = Path(f"/tmp/npud-{os.getuid()}")
    scenario = "T.dump(OUT, { path = require('npud.rpc').user_socket_path() or vim.NIL })"
    env = {"XDG_RUNTIME_DIR": ""}
    try:
        assert run_nvim(tmp_path, scenario, None, env=env)["extra"]["path"] is None  # no directory
        directory.mkdir(mode=0o755)
        directory.chmod(0o755)
        assert run_nvim(tmp_path, scenario, None, env=env)["extra"]["path"] is None  # others may enter
        directory.chmod(0o700)
        assert run_nvim(tmp_path, scenario, None, env=env)["extra"]["path"] == f"{directory}/npud.sock"
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_edit_replaces_whole_lines_of_a_range(daemon, client, tmp_path):
    lines = ["x = 1", "def add(a, b):", "    return a + b", "y = 2"]
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ max_tokens = 8 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(lines)})
        vim.bo.filetype = 'python'
        vim.cmd('2,3NpuEdit rename add to plus')
        T.wait_idle()
        T.dump(OUT)
    """, daemon.socket)
    assert errors(state) == []
    messages = edit_messages("rename add to plus", "python", "def add(a, b):\n    return a + b")
    expected = client.complete(messages=messages, max_tokens=8).wait()["text"]
    assert expected.strip() and not expected.lstrip().startswith("```")
    assert state["buffer"] == f"x = 1\n{expected}\ny = 2"


def test_edit_replaces_a_charwise_visual_selection(daemon, client, tmp_path):
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ max_tokens = 6 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(["total = add(a, b) + 1", "next"])})
        vim.cmd('normal! 1G9|v17|' .. vim.api.nvim_replace_termcodes('<Esc>', true, false, true))
        vim.cmd("'<,'>NpuEdit use the plus operator")
        T.wait_idle()
        T.dump(OUT)
    """, daemon.socket)
    assert errors(state) == []
    messages = edit_messages("use the plus operator", "", "add(a, b)")
    expected = client.complete(messages=messages, max_tokens=6).wait()["text"]
    assert expected.strip()
    assert state["buffer"] == f"total = {expected} + 1\nnext"


def test_status_shows_device_queue_and_last_ticket(daemon, client, tmp_path):
    client.complete("class Point:", max_tokens=2).wait()  # so that there is a last ticket
    last = client.tickets(limit=1)["tickets"][0]
    state = run_nvim(tmp_path, """
        vim.cmd('NpuStatus')
        T.wait_notes(1)
        T.dump(OUT)
    """, daemon.socket)
    assert errors(state) == []
    (note,) = state["notes"]
    lines = note["msg"].splitlines()
    device = client.device_status()
    assert lines[0] == (f"npud: device: host ({device['reason']}); thermal {device['thermal']['state']} "
                        f"{device['thermal']['reading_c']:.1f}°C; errors 0")
    assert lines[1] == "queue: 0 interactive, 0 batch; holding: none"
    assert lines[2].startswith(f"last ticket: #{last['ticket']} job {last['job']} interactive released (done)")
    assert lines[2].endswith(f"{last['tokens']} tokens") or "acceptance" in lines[2]


def test_cancel_stops_a_running_completion(daemon, client, tmp_path):
    state = run_nvim(tmp_path, """
        require('npud').setup({ max_tokens = 3000 })
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {'def add(a, b):'})
        vim.api.nvim_win_set_cursor(0, {1, 13})
        vim.cmd('NpuComplete')
        -- cancel once text has streamed in and the job id is known
        local streamed = vim.wait(60000, function() return T.text() ~= 'def add(a, b):' end, 1)
        vim.cmd('NpuCancel')
        T.wait_idle()
        local after = T.text()
        vim.cmd('NpuCancel')  -- nothing runs any more
        T.dump(OUT, { streamed = streamed, after = after })
    """, daemon.socket)
    assert state["extra"]["streamed"] is True
    assert errors(state) == []
    notes = [n["msg"] for n in state["notes"]]
    assert len(notes) == 2 and notes[1] == "npud: nothing to cancel"
    m = re.fullmatch(r"npud: cancelled \(job (\d+)\)", notes[0])
    assert m, notes
    job = int(m.group(1))
    assert client.status(job)["state"] == "cancelled"
    (stored,) = client.result(job)["results"]
    assert stored["finish_reason"] == "cancelled" and 0 < len(stored["token_ids"]) < 3000
    assert state["extra"]["after"] == "def add(a, b):" + stored["text"]


def test_cancel_puts_an_edited_selection_back(daemon, client, tmp_path):
    lines = ["x = 1", "def add(a, b):", "    return a + b"]
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ max_tokens = 3000 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(lines)})
        vim.cmd('2,3NpuEdit rewrite this at length')
        local streamed = vim.wait(60000, function() return T.text() ~= {json.dumps(chr(10).join(lines))} end, 1)
        local during = T.text()
        vim.cmd('NpuCancel')
        T.wait_idle()
        T.dump(OUT, {{ streamed = streamed, during = during }})
    """, daemon.socket)
    assert state["extra"]["streamed"] is True
    assert state["extra"]["during"].startswith("x = 1\n") and "return a + b" not in state["extra"]["during"]
    assert errors(state) == []
    (note,) = [n["msg"] for n in state["notes"]]
    job = int(re.fullmatch(r"npud: cancelled \(job (\d+)\)", note).group(1))
    assert client.status(job)["state"] == "cancelled"
    assert state["buffer"] == "\n".join(lines)


def test_daemon_errors_are_notifications_and_leave_the_buffer(daemon, tmp_path):
    lines = ["keep = 1", "def add(a, b):", "    return a + b"]
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ model = 'no-such-model' }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(lines)})
        vim.api.nvim_win_set_cursor(0, {{2, 13}})
        vim.cmd('NpuComplete')
        T.wait_idle()
        vim.cmd('2,3NpuEdit make it shorter')
        T.wait_idle()
        T.dump(OUT, {{ busy = require('npud').busy() }})
    """, daemon.socket)
    message = f"npud: no model 'no-such-model'; models: ['{MODEL}', '{FIM_MODEL}']"
    assert [(n["msg"], n["level"]) for n in state["notes"]] == [(message, 4), (message, 4)]
    assert state["buffer"] == "\n".join(lines)
    assert state["extra"]["busy"] is False


def test_unreachable_daemon_is_a_notification(tmp_path):
    missing = str(tmp_path / "none.sock")
    state = run_nvim(tmp_path, """
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {'abc'})
        vim.cmd('NpuComplete')
        T.wait_idle()
        vim.cmd('NpuStatus')
        T.wait_notes(2)
        T.dump(OUT)
    """, missing)
    assert len(state["notes"]) == 2
    for note in state["notes"]:
        assert note["level"] == 4
        assert note["msg"].startswith(f"npud: cannot connect to npud at {missing} (ENOENT")
        assert "npud is not running" in note["msg"]
    assert state["buffer"] == "abc"


def test_strip_fences(tmp_path):
    cases = {
        "```python\nx = 1\n```": "x = 1",
        "```\na\nb\n```\n\n": "a\nb",
        "x = 1": "x = 1",
        "```python\nunterminated": "```python\nunterminated",
        "a\n```\nb\n```": "a\n```\nb\n```",  # a fence inside the text stays
    }
    state = run_nvim(tmp_path, f"""
        local cases = vim.json.decode({json.dumps(json.dumps(list(cases)))})
        local out = {{}}
        for i, c in ipairs(cases) do out[i] = require('npud').strip_fences(c) end
        T.dump(OUT, {{ out = out }})
    """, None)
    assert state["extra"]["out"] == list(cases.values())


def newest_result(client) -> dict:
    job = client.jobs(limit=1)["jobs"][0]["job"]
    (result,) = client.result(job)["results"]
    return result


def test_complete_sends_the_text_after_the_cursor_as_suffix_to_a_fim_model(daemon, client, tmp_path):
    before, after = "x = 1\ndef add(a, b):\n    return ", "\n\nprint(add(1, 2))"
    # the model is loaded by now, so `models` knows it has FIM tokens
    expected = client.complete(before, suffix=after, model=FIM_MODEL, max_tokens=8).wait()
    plain = client.complete(before, model=FIM_MODEL, max_tokens=8).wait()
    assert expected["text"] != plain["text"]  # so the text says whether the suffix went along
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ model = {json.dumps(FIM_MODEL)}, max_tokens = 8 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines((before + after).split(chr(10)))})
        vim.api.nvim_win_set_cursor(0, {{3, 10}})  -- on the space after 'return' (normal mode)
        vim.cmd('NpuComplete')
        T.wait_idle()
        T.dump(OUT)
    """, daemon.socket)
    assert errors(state) == []
    assert state["buffer"] == before + expected["text"] + after
    assert newest_result(client)["prompt_tokens"] == expected["prompt_tokens"]


def test_complete_sends_no_suffix_to_a_model_without_fim(daemon, client, tmp_path):
    before, after = "x = 1\ndef add(a, b):", "\n# tail"
    expected = client.complete(before, max_tokens=8).wait()["text"]  # loads the model: `models` knows it
    with pytest.raises(Exception) as info:  # a suffix would fail the request
        client.complete(before, suffix=after, max_tokens=8).wait()
    assert info.value.code == "fim_unsupported"
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ max_tokens = 8 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines((before + after).split(chr(10)))})
        vim.api.nvim_win_set_cursor(0, {{2, 13}})
        vim.cmd('NpuComplete')
        T.wait_idle()
        T.dump(OUT)
    """, daemon.socket)
    assert errors(state) == []
    assert state["buffer"] == before + expected + after


def test_complete_trims_a_long_prefix_to_the_models_context(daemon, client, tmp_path):
    lines = [f"v{i} = {i} * {i}" for i in range(200)]  # ~2,600 bytes: over the 256-token context
    client.complete("x", model=FIM_MODEL, max_tokens=1).wait()  # loaded: `models` knows its context
    state = run_nvim(tmp_path, f"""
        require('npud').setup({{ model = {json.dumps(FIM_MODEL)}, max_tokens = 8, bytes_per_token = 1 }})
        vim.api.nvim_buf_set_lines(0, 0, -1, true, {lua_lines(lines)})
        vim.api.nvim_win_set_cursor(0, {{150, 0}})  -- 'v149 = ...': its first character is before
        local before = table.concat(vim.api.nvim_buf_get_text(0, 0, 0, 149, 1, {{}}), '\\n')
        local after = table.concat(vim.api.nvim_buf_get_text(0, 149, 1, 199, #{json.dumps(lines[-1])}, {{}}), '\\n')
        vim.cmd('NpuComplete')
        T.wait_idle()
        local info = {{}}
        local conn_done = false
        require('npud.rpc').connect(require('npud.rpc').socket_path(nil), function(conn)
          require('npud.context').model_info(conn, {json.dumps(FIM_MODEL)}, function(i) info = i; conn:close(); conn_done = true end)
        end, function() conn_done = true end)
        vim.wait(10000, function() return conn_done end, 5)
        local prompt, suffix = require('npud.context').parts(before, after, info, require('npud').config)
        T.dump(OUT, {{ prompt = prompt, suffix = suffix, info = info }})
    """, daemon.socket)
    assert errors(state) == []
    extra = state["extra"]
    assert extra["info"] == {"context_length": FIM_CONTEXT, "fim": True}
    before = "\n".join(lines[:149]) + "\nv"
    prompt, suffix = extra["prompt"], extra["suffix"]
    # the lines nearest the cursor, whole, and room for max_tokens
    assert before.endswith(prompt) and len(prompt) < len(before) and before[-len(prompt) - 1] == "\n"
    # bytes_per_token 1: a budget of 256 - 8 (max_tokens) - 4 (FIM tokens, BOS) bytes, a quarter
    # at most for the suffix; whole lines are at most 17 bytes, so the cut loses less than one
    budget, longest = FIM_CONTEXT - 8 - 4, max(len(x) + 1 for x in lines)
    assert 0 < len(suffix) <= budget // 4 and budget - longest < len(prompt) + len(suffix) <= budget
    after = "149 = 149 * 149\n" + "\n".join(lines[150:])
    assert (after + "\n").startswith(suffix + "\n") and budget // 4 - longest < len(suffix)
    result = newest_result(client)
    assert "error" not in result and result["prompt_tokens"] + 8 <= FIM_CONTEXT
    assert result["max_tokens_clamped_to"] is None
    expected = client.complete(prompt, suffix=suffix, model=FIM_MODEL, max_tokens=8).wait()
    assert result["token_ids"] == expected["token_ids"] and result["prompt_tokens"] == expected["prompt_tokens"]
    lines_after = lines[:149] + ["v" + expected["text"] + lines[149][1:]] + lines[150:]
    assert state["buffer"] == "\n".join(lines_after)


def test_context_budget_arithmetic(tmp_path):
    # text without newlines is cut to the byte; 'é' is two bytes, never split
    state = run_nvim(tmp_path, """
        local parts = require('npud.context').parts
        local a, b = string.rep('a', 1000), string.rep('b', 1000)
        local out = {}
        local function case(before, after, info, opts)
          local prompt, suffix = parts(before, after, info, opts)
          out[#out + 1] = { #prompt, suffix and #suffix or vim.NIL, prompt:sub(1, 2) }
        end
        case(a, b, { context_length = 256, fim = true }, { max_tokens = 8, bytes_per_token = 1 })
        case(a, b, { context_length = 256, fim = true }, { max_tokens = 8, bytes_per_token = 2 })
        case(a, b, { context_length = 256, fim = true }, { max_tokens = 250, bytes_per_token = 1 })
        case(a, b, { context_length = 256, fim = false }, { max_tokens = 8, bytes_per_token = 1 })
        case(a, b, { fim = false }, { max_tokens = 8, bytes_per_token = 1 })
        case(a, b, { context_length = 4096, fim = false }, { max_tokens = 8, bytes_per_token = 1, context_length = 100 })
        case(string.rep('é', 100), b, { context_length = 69, fim = false }, { max_tokens = 4, bytes_per_token = 1 })
        T.dump(OUT, { out = out })
    """, None)
    assert state["extra"]["out"] == [
        [244 - 61, 61, "aa"],  # 256 - 8 max_tokens - 4 reserved; a quarter (61) for the suffix
        [488 - 122, 122, "aa"],  # two bytes a token
        [60 - 15, 15, "aa"],  # max_tokens near the context: the prompt keeps a quarter of it (64 - 4)
        [244, None, "aa"],  # no FIM: no suffix, the prefix has it all
        [1000, None, "aa"],  # not loaded yet: 2048 assumed
        [88, None, "aa"],  # the context_length option wins over the daemon's
        [60, None, "é"],  # 61 bytes would start inside a character
    ]
