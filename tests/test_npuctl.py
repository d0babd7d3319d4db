"""npuctl against a real npud process on a tiny model: round trips, output modes (terminal
and not), --json, and every error path with its message and exit code.

The expected values come from the client library talking to the same daemon, and for
generated text from an independent `complete` of the same prompt (greedy decoding on the
host backend is deterministic), so a result written against the wrong input line fails.
"""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

from npud.clients.batchfile import InputError, plan_jobs, read_lines
from npud.clients.client import Client
from npud.clients.npuctl import EXIT_CODES_HELP, build_parser, when
from npud.clients.npuctl_show import TICKET_HEADERS, ticket_row
from npud.clients.termout import Progress, ProgressBar
from npud_fixture import MODEL, REPO, nobody_can_connect, python_env, relay_as_nobody, start_daemon, stop_daemon

pytestmark = pytest.mark.slow  # a real daemon on a real (tiny) model

NPUCTL = [sys.executable, "-m", "npud.clients.npuctl"]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = start_daemon(tmp_path_factory.mktemp("npuctl"))
    yield d
    stop_daemon(d)


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.socket) as c:
        yield c


@pytest.fixture(scope="module")
def done_job(client):
    """A finished two-prompt job."""
    job = client.submit(["def add(a, b):", "The quick brown fox"], max_tokens=5)["job"]
    client.stream(job, tokens=False).wait()
    return job


class Run:
    def __init__(self, returncode: int, stdout: str, stderr: str) -> None:
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr

    @property
    def error_line(self) -> str:
        lines = self.stderr.strip().splitlines()
        return lines[-1] if lines else ""


def npuctl(*args: str, socket_path: str | None, stdin: bytes | None = None, timeout: float = 120) -> Run:
    """Run npuctl with pipes (not a terminal); output decoded as UTF-8 without newline translation."""
    proc = subprocess.run([*NPUCTL, *args], cwd=REPO, env=python_env(socket_path), input=stdin,
                          capture_output=True, timeout=timeout)
    return Run(proc.returncode, proc.stdout.decode("utf-8"), proc.stderr.decode("utf-8"))


def npuctl_on_pty(*args: str, socket_path: str, timeout: float = 120) -> tuple[int, str]:
    """Run npuctl with stdin, stdout and stderr on a pseudo-terminal 100 columns wide."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    proc = subprocess.Popen([*NPUCTL, *args], cwd=REPO, env=python_env(socket_path), stdin=slave, stdout=slave,
                            stderr=slave, start_new_session=True)
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                proc.kill()
                raise AssertionError(f"npuctl {' '.join(args)} did not finish in {timeout} s: {b''.join(chunks)!r}")
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every process holding the terminal has closed it
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    return proc.wait(timeout=30), b"".join(chunks).decode("utf-8")


def write_jsonl(path: Path, lines: list) -> Path:
    """One JSON value per line; "" is a blank line."""
    path.write_text("".join(("" if x == "" else json.dumps(x)) + "\n" for x in lines))
    return path


def reference(client: Client, line: dict, max_tokens: int) -> list[int]:
    """The token ids of an independent interactive completion of an input line."""
    if "prompt" in line:
        stream = client.complete(line["prompt"], max_tokens=max_tokens)
    else:
        stream = client.complete(messages=line["messages"], max_tokens=max_tokens)
    return stream.wait()["token_ids"]


def job_ids(client: Client) -> set[int]:
    return {j["job"] for j in client.jobs(limit=1000)["jobs"]}


# -- submit / wait / result -----------------------------------------------------------------------

MIXED = [
    {"prompt": "def add(a, b):", "id": "first"},
    "",  # a blank line: skipped, but line numbers still count it
    "for i in range(10):",
    {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 5},
    {"prompt": "The quick brown fox", "max_tokens": 3},
]
MIXED_LINES = [1, 3, 4, 5]
MIXED_MAX = [6, 6, 5, 3]  # --max-tokens 6 unless the line says otherwise


def check_mixed_records(client: Client, records: list[dict]) -> None:
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    assert [r["line"] for r in records] == MIXED_LINES
    assert records[0]["id"] == "first" and all("id" not in r for r in records[1:])
    jobs = [r["job"] for r in records]
    # the prompts are one job, the 3-token line with its own max_tokens; the chat is another
    assert jobs[0] == jobs[1] == jobs[3] != jobs[2] and len(set(jobs)) == 2
    assert [r["prompt_in_job"] for r in records] == [0, 1, 0, 2]
    inputs = [MIXED[0], {"prompt": MIXED[2]}, MIXED[3], MIXED[4]]
    for record, line, max_tokens in zip(records, inputs, MIXED_MAX):
        assert "error" not in record
        assert record["token_ids"] == reference(client, line, max_tokens)
        stored = client.result(record["job"], prompts=[record["prompt_in_job"]])["results"][0]
        assert record["text"] == stored["text"] and record["token_ids"] == stored["token_ids"]
        assert client.status(record["job"])["state"] == "done"


def test_submit_wait_without_a_terminal_prints_plain_lines(daemon, client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", MIXED)
    out = tmp_path / "out.jsonl"
    run = npuctl("submit", str(src), "--wait", "--max-tokens", "6", "-o", str(out), socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    assert run.stdout == ""
    assert "\r" not in run.stderr and "\x1b" not in run.stderr
    # the first job of the session finds the model cold: "loading model tiny" comes first then
    lines = [ln for ln in run.stderr.splitlines() if ln != f"loading model {MODEL}"]
    assert [ln.split(" done (")[0] for ln in lines[:4]] == [f"prompt {k}/4" for k in range(1, 5)]
    assert sorted(int(ln.split("(line ")[1].split(",")[0]) for ln in lines[:4]) == MIXED_LINES
    assert lines[4].startswith("done: 4/4 prompts, ") and "tok/s" in lines[4] and "acceptance" in lines[4]
    check_mixed_records(client, [json.loads(x) for x in out.read_text().splitlines()])


def test_submit_wait_on_a_terminal_draws_a_progress_bar(daemon, client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", MIXED)
    out = tmp_path / "out.jsonl"
    rc, screen = npuctl_on_pty("submit", str(src), "--wait", "--max-tokens", "6", "-o", str(out),
                               socket_path=daemon.socket)
    assert rc == 0, screen
    assert "\r[" in screen and "\x1b[K" in screen
    final_bar = screen.split("\r[")[-1]
    assert final_bar.startswith("#" * 10) and " 4/4 prompts " in final_bar and "tok/s" in final_bar
    assert "acceptance" in final_bar
    assert "prompt 1/4 done" not in screen  # the plain lines are for pipes only
    assert "done: 4/4 prompts" in screen
    check_mixed_records(client, [json.loads(x) for x in out.read_text().splitlines()])


def varied_lines(n: int) -> list:
    """n lines whose settings vary line by line: max_tokens, stop, and for every fifth line
    seeded sampling (without speculation, so the seed repeats the output); every seventh
    line says nothing and runs with the command line's settings."""
    lines: list = []
    for i in range(n):
        prompt = f"def f{i}(x):\n    return x + {i}"
        if i % 7 == 0:
            lines.append(prompt)
            continue
        line: dict = {"prompt": prompt, "max_tokens": 1 + i % 6, "id": i}
        if i % 5 == 0:
            line["sampling"] = {"temperature": 0.9, "seed": i}
            line["spec"] = {"method": "none"}
        if i % 4 == 0:
            line["stop"] = ["\n"]
        lines.append(line)
    return lines


def test_a_file_of_varied_settings_is_one_job_and_each_line_keeps_its_own(daemon, client, tmp_path):
    lines = varied_lines(100)
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    before = job_ids(client)
    run = npuctl("submit", str(src), "--wait", "--max-tokens", "8", "-o", str(out), socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    (job,) = job_ids(client) - before
    assert client.status(job)["num_prompts"] == 100
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in records] == list(range(1, 101)) and {r["job"] for r in records} == {job}
    assert [r["prompt_in_job"] for r in records] == list(range(100))
    for line, record in zip(lines, records):
        own = {} if isinstance(line, str) else line
        prompt = line if isinstance(line, str) else line["prompt"]
        expected = client.complete(prompt, max_tokens=own.get("max_tokens", 8), sampling=own.get("sampling"),
                                   spec=own.get("spec"), stop=own.get("stop")).wait()
        assert (record["text"], record["token_ids"], record["finish_reason"]) == (
            expected["text"], expected["token_ids"], expected["finish_reason"]), record["line"]
    assert {len(r["token_ids"]) for r in records if r["finish_reason"] == "length"} >= {1, 2, 3, 4, 5, 6, 8}


def test_openai_batch_lines_in_and_out(daemon, client, tmp_path):
    lines = [
        {"custom_id": "c-1", "method": "POST", "url": "/v1/completions",
         "body": {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 4, "stop": "\n\n\n"}},
        {"custom_id": "chat-1", "method": "POST", "url": "/v1/chat/completions",
         "body": {"messages": [{"role": "user", "content": "Say hi"}], "max_completion_tokens": 3,
                  "temperature": 0.8, "seed": 11, "npud": {"spec": {"method": "none"}}}},
        {"prompt": "class Point:", "id": "mine", "max_tokens": 2},  # npud's own shape in the same file
        {"custom_id": "too-long", "method": "POST", "url": "/v1/completions",
         "body": {"prompt": "x " * 5000, "max_tokens": 2}},
    ]
    src = write_jsonl(tmp_path / "in.jsonl", lines)
    run = npuctl("submit", str(src), "--wait", "--format", "openai", socket_path=daemon.socket)
    assert run.returncode == 1, run.stderr  # the last line's prompt fails
    assert run.error_line.startswith(f"error: {src}:4: ") and "5001 tokens" in run.error_line
    records = [json.loads(x) for x in run.stdout.splitlines()]
    assert [r["custom_id"] for r in records] == ["c-1", "chat-1", "mine", "too-long"]
    for r in records:
        assert set(r) == {"id", "custom_id", "response", "error"}
    expected = [client.complete("def add(a, b):", max_tokens=4, stop=["\n\n\n"]).wait(),
                client.complete(messages=lines[1]["body"]["messages"], max_tokens=3,
                                sampling={"temperature": 0.8, "seed": 11}, spec={"method": "none"}).wait(),
                client.complete("class Point:", max_tokens=2).wait()]
    for r, exp, obj in zip(records, expected, ["text_completion", "chat.completion", "text_completion"]):
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == obj and body["model"] == "tiny" and isinstance(body["created"], int)
        (choice,) = body["choices"]
        text = choice["text"] if obj == "text_completion" else choice["message"]["content"]
        assert text == exp["text"] and choice["finish_reason"] == exp["finish_reason"]
        assert body["usage"] == {"prompt_tokens": exp["prompt_tokens"], "completion_tokens": len(exp["token_ids"]),
                                 "total_tokens": exp["prompt_tokens"] + len(exp["token_ids"])}
        assert r["id"] == f"batch_req_{body['npud']['job']}_{body['npud']['prompt_in_job']}"
    assert records[1]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    failed = records[3]
    assert failed["error"] is None and failed["response"]["status_code"] == 400
    error = failed["response"]["body"]["error"]
    assert error["code"] == "prompt_too_long" and error["type"] == "invalid_request_error" and error["message"]


def test_openai_lines_that_are_not_requests_name_the_line(daemon, tmp_path):
    good = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}
    cases = [
        ({**good, "url": "/v1/embeddings"}, '"url" must be "/v1/completions" or "/v1/chat/completions"'),
        ({**good, "body": {"prompt": "x", "n": 2}}, "body: n must be 1"),
        ({**good, "body": {"prompt": "x", "logprobs": 2}}, "body: unsupported key 'logprobs'"),
        ({**good, "body": {"prompt": ["x", "y"]}}, 'body: "prompt" must be one string'),
        ({**good, "custom_id": 3}, '"custom_id" must be a non-empty string'),
        ({**good, "method": "GET"}, '"method" must be "POST"'),
        ({**good, "body": {"messages": []}}, "body: unsupported key 'messages'"),
        (good, "custom_id 'a' is on line 1 too"),
    ]
    for bad, message in cases:
        src = write_jsonl(tmp_path / "bad.jsonl", [good, bad] if bad is good else ["x", bad])
        run = npuctl("submit", str(src), "--wait", "--format", "openai", socket_path=daemon.socket)
        assert run.returncode == 2, bad
        assert run.stderr.startswith(f"error: {src}:2: {message}"), (bad, run.stderr)


def test_submit_prints_job_ids_then_result_reads_them(daemon, client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", MIXED)
    run = npuctl("submit", str(src), "--max-tokens", "6", socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    jobs = [int(x) for x in run.stdout.split()]
    assert len(jobs) == 2 and jobs == sorted(jobs)
    assert [client.status(j)["num_prompts"] for j in jobs] == [3, 1]
    for job in jobs:
        client.stream(job, tokens=False).wait()
    out = tmp_path / "res.jsonl"
    run = npuctl("result", str(jobs[0]), "-o", str(out), socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    assert [json.loads(x) for x in out.read_text().splitlines()] == client.result(jobs[0])["results"]
    run = npuctl("result", str(jobs[0]), socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    stored = client.result(jobs[0])["results"]
    expected = ""
    for r in stored:
        drafted, accepted = r["stats"].get("drafted", 0), r["stats"].get("accepted", 0)
        rate = f"{100 * accepted / drafted:.0f}%" if drafted else "-"
        needed, fallbacks = r["stats"]["break_even_acceptance"], r["stats"]["fallbacks"]
        more = f" and {len(fallbacks) - 1} more" if len(fallbacks) > 1 else ""
        why = ([] if needed is None else [f"break-even {100 * needed:.0f}%"]) + (
            [f"fell back after round {fallbacks[0]['round']}{more}"] if fallbacks else [])
        why = f" ({', '.join(why)})" if why else ""
        expected += f"--- prompt {r['prompt']}: length, {[6, 6, 3][r['prompt']]} tokens, acceptance {rate}{why}\n"
        expected += r["text"] + ("" if r["text"].endswith("\n") else "\n")
    assert run.stdout == expected
    run = npuctl("status", str(jobs[1]), socket_path=daemon.socket)
    assert run.returncode == 0
    fields = dict(ln.split(":", 1) for ln in run.stdout.splitlines())
    assert fields["state"].strip() == "done" and fields["prompts"].strip() == "1/1"
    assert fields["job"].strip() == str(jobs[1])


def test_submit_reads_stdin(daemon, client):
    run = npuctl("submit", "-", "--wait", "--max-tokens", "2", socket_path=daemon.socket,
                 stdin=b'{"prompt": "class Point:"}\n')
    assert run.returncode == 0, run.stderr
    (record,) = [json.loads(x) for x in run.stdout.splitlines()]
    assert record["line"] == 1 and record["token_ids"] == reference(client, {"prompt": "class Point:"}, 2)


def test_complete_streams_the_completion(daemon, client):
    run = npuctl("complete", "def greet(name):", "--max-tokens", "8", socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    expected = client.complete("def greet(name):", max_tokens=8).wait()
    text = expected["text"]
    assert text  # the tiny model says something for this prompt
    assert run.stdout == text + ("" if text.endswith("\n") else "\n")
    assert run.stderr == ""  # the summary line is for terminals
    newest = client.jobs(limit=2)["jobs"]
    assert {j["priority"] for j in newest} == {"interactive"}  # complete is interactive


def test_complete_on_a_terminal_ends_with_a_summary(daemon):
    rc, screen = npuctl_on_pty("complete", "def greet(name):", "--max-tokens", "4", socket_path=daemon.socket)
    assert rc == 0, screen
    assert "[job " in screen and ": 4 tokens, length, " in screen and "tok/s, acceptance" in screen


@pytest.mark.slow
def test_interrupting_complete_cancels_the_job(daemon, client):
    before = job_ids(client)
    # SIGINT at its default in the CLI, as a shell starts a foreground command: a suite started
    # in the background (`.ci/run &`, nohup) inherits SIGINT ignored, Python then installs no
    # KeyboardInterrupt handler, and the CLI would run the completion to its end and exit 0
    proc = subprocess.Popen([*NPUCTL, "complete", "def add(a, b):", "--max-tokens", "3000"], cwd=REPO,
                            env=python_env(daemon.socket), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.read(1)  # it is streaming
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    (job,) = job_ids(client) - before
    deadline = time.monotonic() + 30
    while client.status(job)["state"] not in ("cancelled", "done", "failed") and time.monotonic() < deadline:
        time.sleep(0.05)
    seen = (proc.returncode, client.status(job), out[-200:], err[-400:])  # for a failure to be read
    assert proc.returncode == 130, seen
    assert err.decode().strip().splitlines()[-1] == "error: interrupted; the completion was cancelled", seen
    assert client.status(job)["state"] == "cancelled", seen


@pytest.mark.slow
def test_cancel_a_job_that_submit_is_waiting_for(daemon, client, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["def add(a, b):", "for i in range(3):", "class Point:"])
    out = tmp_path / "out.jsonl"
    before = job_ids(client)
    waiter = subprocess.Popen([*NPUCTL, "submit", str(src), "--wait", "--max-tokens", "3000", "-o", str(out)],
                              cwd=REPO, env=python_env(daemon.socket), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not job_ids(client) - before:
        assert time.monotonic() < deadline and waiter.poll() is None
        time.sleep(0.05)
    (job,) = job_ids(client) - before
    run = npuctl("cancel", str(job), socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f"job {job}: cancelled")
    _, err = waiter.communicate(timeout=60)
    assert waiter.returncode == 1
    assert err.decode().strip().splitlines()[-1] == f"error: job {job} was cancelled"
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["line"] for r in records] == [1, 2, 3]
    cancelled = [r for r in records if r.get("error", {}).get("code") == "cancelled"
                 or r.get("finish_reason") == "cancelled"]
    # the three prompts run batched: the cancel ends those still running (or not yet started);
    # one that had finished keeps its result. Either way every line has its record, and a
    # cancelled one says so
    assert cancelled, records
    assert all(r in cancelled or r.get("finish_reason") in ("stop", "length") for r in records), records
    run = npuctl("cancel", str(job), socket_path=daemon.socket)
    assert run.returncode == 0 and run.stdout == f"job {job}: had already ended (cancelled)\n"


# -- tables and --json ------------------------------------------------------------------------------

def test_tables_are_tab_separated_without_a_terminal(daemon, client, done_job):
    """Piped, a table is tab-separated lines, its column names first (issue 42: `npuctl jobs | ...`
    had no names to tell the columns by)."""
    run = npuctl("tickets", "--job", str(done_job), socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    header, *lines = run.stdout.splitlines()
    assert header.split("\t") == [h.upper() for h in TICKET_HEADERS]
    rows = [ln.split("\t") for ln in lines]
    tickets = client.tickets(job=done_job)["tickets"]
    assert [int(r[0]) for r in rows] == [t["ticket"] for t in tickets] and rows
    for row in rows:
        assert len(row) == len(TICKET_HEADERS)
        assert int(row[1]) == done_job
        assert row[2] == __import__("pwd").getpwuid(os.geteuid()).pw_name
        assert row[8] == "done" and row[10] == "0->0"
    run = npuctl("jobs", socket_path=daemon.socket)
    header, *lines = run.stdout.splitlines()
    assert header.split("\t")[:7] == ["JOB", "USER", "STATE", "PRIORITY", "MODEL", "PROMPTS", "TOKENS"]
    rows = [ln.split("\t") for ln in lines]
    assert [int(r[0]) for r in rows] == [j["job"] for j in client.jobs()["jobs"]]
    run = npuctl("models", socket_path=daemon.socket)
    header, line = run.stdout.splitlines()
    cols = line.split("\t")
    assert header.split("\t")[:2] == ["MODEL", "STATE"]
    assert cols[:2] == ["tiny (default)", "loaded"] and cols[3] == "until evicted" and cols[4] == "fp32"
    run = npuctl("tickets", "--since", "2099-01-01", socket_path=daemon.socket)
    assert run.returncode == 0 and run.stdout == "\t".join(h.upper() for h in TICKET_HEADERS) + "\n"


def test_tables_have_headers_on_a_terminal(daemon, done_job):
    rc, screen = npuctl_on_pty("tickets", "--job", str(done_job), socket_path=daemon.socket)
    assert rc == 0, screen
    header = screen.splitlines()[0].split()
    assert header == [h.upper() for h in TICKET_HEADERS]
    rc, screen = npuctl_on_pty("jobs", "--limit", "1", socket_path=daemon.socket)
    assert screen.splitlines()[0].split()[:3] == ["JOB", "USER", "STATE"]


def test_json_output_parses(daemon, client, done_job, tmp_path):
    def js(*args: str):
        run = npuctl(*args, "--json", socket_path=daemon.socket)
        assert run.returncode == 0, run.stderr
        return json.loads(run.stdout)

    assert js("status", str(done_job))["job"] == done_job
    assert [r["prompt"] for r in js("result", str(done_job))["results"]] == [0, 1]
    assert done_job in [j["job"] for j in js("jobs")["jobs"]]
    assert {t["job"] for t in js("tickets", "--job", str(done_job))["tickets"]} == {done_job}
    assert js("tickets", "--outcome", "done")["tickets"]
    assert js("device")["kind"] == "host"
    assert "tiny" in [m["name"] for m in js("models")["models"]]
    assert js("stats")["uptime_s"] > 0
    assert isinstance(js("cache", "ls")["models"], list)
    assert js("cancel", str(done_job))["jobs"][0]["cancelled"] is False
    result = js("complete", "def add(a, b):", "--max-tokens", "3")
    assert result["finish_reason"] == "length" and len(result["token_ids"]) == 3
    src = write_jsonl(tmp_path / "in.jsonl", ["x = 1"])
    (queued,) = js("submit", str(src), "--max-tokens", "1")["jobs"]
    assert queued["num_prompts"] == 1 and queued["state"] in ("queued", "running", "done")
    # the global position of --json works too
    run = npuctl("--json", "status", str(done_job), socket_path=daemon.socket)
    assert json.loads(run.stdout)["job"] == done_job


def test_device_says_where_the_gemms_run_and_the_firmware(daemon):
    run = npuctl("device", socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in run.stdout.splitlines()
                                                  if ":" in line and not line.startswith(" "))}
    assert fields["backend"] == "host"
    assert fields["gemms"].startswith("host (no ") and "accel" in fields["gemms"]
    assert "firmware" in fields  # "-" on a machine without the NPU's sysfs fw_version


@pytest.mark.skipif(os.geteuid() != 0, reason="device clear succeeds only for root or the admin group")
def test_device_clear_as_root(daemon):
    run = npuctl("device", "clear", "--json", socket_path=daemon.socket)
    assert run.returncode == 0 and json.loads(run.stdout) == {"cleared": False}
    run = npuctl("device", "clear", socket_path=daemon.socket)
    assert run.stdout == "the device was not quarantined\n"


# -- errors ----------------------------------------------------------------------------------------

def test_daemon_down(tmp_path):
    missing = str(tmp_path / "none.sock")
    for args in (["jobs"], ["complete", "hi"], ["status", "1"]):
        run = npuctl(*args, socket_path=missing)
        assert run.returncode == 3
        assert run.stderr == (f"error: npud is not running (nothing listens at {missing}). Start it with "
                              "`sudo systemctl start npud`, or serve a model as yourself with `npud --model PATH`; "
                              "set NPUD_SOCKET if it listens elsewhere.\n")
    # a socket file left behind by a daemon that died: connection refused
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()
    run = npuctl("--socket", str(stale), "stats", socket_path=None)
    assert run.returncode == 3 and run.error_line.startswith("error: npud is not running")


def test_a_socket_path_that_is_not_a_socket(tmp_path):
    regular = tmp_path / "npud.sock"
    regular.write_text("")
    run = npuctl("jobs", socket_path=str(regular))
    assert run.returncode == 3
    assert run.stderr.startswith(f"error: {regular} is not a socket (a regular file); ")
    run = npuctl("jobs", "--json", socket_path=str(regular))
    assert run.returncode == 3 and json.loads(run.stdout)["error"]["code"] == "not_a_socket"


def test_json_errors_keep_the_code_on_stdout(daemon, tmp_path):
    def error_of(*args: str, socket_path: str | None = daemon.socket, exit_code: int) -> dict:
        run = npuctl(*args, socket_path=socket_path)
        assert run.returncode == exit_code, (args, run.stderr)
        (line,) = run.stdout.splitlines()  # one JSON line, nothing else on stdout
        error = json.loads(line)["error"]
        assert set(error) == {"code", "message"}
        assert run.stderr.endswith(f"error: {error['message']}\n")  # the same message for a human
        return error

    assert error_of("status", "999999", "--json", exit_code=1) == {"code": "not_found", "message": "no job 999999"}
    assert error_of("--json", "result", "999999", exit_code=1)["code"] == "not_found"
    error = error_of("complete", "x", "--max-tokens", "0", "--json", exit_code=1)
    assert error["code"] == "bad_request" and "max_tokens" in error["message"]
    missing = str(tmp_path / "none.sock")
    assert error_of("jobs", "--json", socket_path=missing, exit_code=3)["code"] == "not_running"
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"promt": "x"}])
    error = error_of("submit", str(bad), "--json", exit_code=2)
    assert error["code"] == "usage_error" and error["message"].startswith(f"{bad}:1: unknown key 'promt'")
    # an argument argparse rejects: usage_error too, and no usage text on stdout
    error = error_of("status", "abc", "--json", exit_code=2)
    assert error == {"code": "usage_error", "message": "argument JOB: a job id is a positive integer or a 16-hex-digit reference, got 'abc'"}
    # without --json, stdout stays empty
    run = npuctl("status", "999999", socket_path=daemon.socket)
    assert run.returncode == 1 and run.stdout == "" and run.stderr == "error: no job 999999\n"


def test_cache_ls_lists_the_pins(daemon, client):
    text = "You are a careful assistant who writes short Python functions. " * 8  # longer than a cache block
    key = client.cache_pin("house-style", text=text)["entry"]["key"]
    run = npuctl("cache", "ls", socket_path=daemon.socket)
    assert run.returncode == 0, run.stderr
    assert f"house-style\t{key}\n" in run.stdout
    rc, screen = npuctl_on_pty("cache", "ls", socket_path=daemon.socket)
    assert rc == 0 and "PIN" in screen and "KEY" in screen
    assert any(ln.split() == ["house-style", key] for ln in screen.splitlines())


def test_connection_dropped_mid_stream(tmp_path):
    """A daemon that dies while streaming: exit 3 with what was streamed so far on stdout."""
    path = str(tmp_path / "dying.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)

    def serve_one():
        conn, _ = server.accept()
        with conn:
            req = json.loads(conn.makefile("rb").readline())
            conn.sendall(json.dumps({"id": req["id"], "event": "token",
                                     "data": {"prompt": 0, "text": "partial", "token_ids": [1]}}).encode() + b"\n")

    thread = threading.Thread(target=serve_one, daemon=True)
    thread.start()
    try:
        run = npuctl("complete", "hi", socket_path=path, timeout=30)
    finally:
        thread.join(timeout=10)
        server.close()
    assert run.returncode == 3
    assert run.stdout.startswith("partial")
    assert run.error_line == "error: npud closed the connection"


def test_unknown_job(daemon):
    for args in (["status", "999999"], ["result", "999999"], ["cancel", "999999"], ["tickets", "--job", "999999"]):
        run = npuctl(*args, socket_path=daemon.socket)
        if args[0] == "tickets":  # a filter that matches nothing is not an error
            assert run.returncode == 0 and run.stdout == "\t".join(h.upper() for h in TICKET_HEADERS) + "\n"
            continue
        assert run.returncode == 1, args
        assert run.stderr == "error: no job 999999\n"


@pytest.fixture(scope="module")
def unprivileged_socket(daemon):
    """A socket on which npud sees a user that is not an admin and owns none of the jobs."""
    if os.geteuid() != 0:
        yield daemon.socket  # this user is not in the (nonexistent) admin group
        return
    if not nobody_can_connect():
        pytest.skip("running as root without a `nogroup` group: no unprivileged user to test with")
    with relay_as_nobody(daemon.socket, str(daemon.dir / "nobody.sock")) as path:
        yield path


def test_forbidden_admin_methods(daemon, unprivileged_socket):
    assert npuctl("stats", socket_path=unprivileged_socket).returncode == 0  # it does reach the daemon
    run = npuctl("device", "clear", socket_path=unprivileged_socket)
    assert run.returncode == 1
    assert run.stderr == "error: device.clear needs root or the admin group\n"
    run = npuctl("cache", "drop", "somekey", socket_path=unprivileged_socket)
    assert run.returncode == 1 and run.stderr == "error: cache.drop needs root or the admin group\n"
    run = npuctl("jobs", "--all-users", socket_path=unprivileged_socket)
    assert run.returncode == 1 and run.stderr == "error: all_users needs the admin group\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as a second user (nobody)")
def test_other_users_job_is_not_found(daemon, unprivileged_socket, done_job):
    # the same answer as for a job that does not exist, so job ids cannot be probed (issue 17)
    for args in (["status", str(done_job)], ["result", str(done_job)], ["cancel", str(done_job)]):
        run = npuctl(*args, socket_path=unprivileged_socket)
        assert run.returncode == 1, args
        assert run.stderr == f"error: no job {done_job}\n"


BAD_FILES = [
    (['{"prompt": "a"}', "not json"], 2, "not valid JSON: Expecting value (column 1)"),
    (['{"prompt": "a"}', "", '{"prompt": 1}'], 3, '"prompt" must be a string, got an integer'),
    (['{"promt": "a"}'], 1, "unknown key 'promt' (known: prompt, messages, id, model, max_tokens, sampling, "
                            "stop, spec, use_prefix_cache, priority, logprobs, response_format, grammar)"),
    (['{"prompt": "a", "messages": [{"role": "user", "content": "b"}]}'], 1,
     'give exactly one of "prompt" and "messages"'),
    (["[1, 2]"], 1, 'expected an object with "prompt" or "messages" (or a JSON string), got a list'),
    (['{"prompt": "a"}', '{"messages": [{"role": "user"}]}'], 2,
     'messages[0] must be {"role": string, "content": string}'),
    (['{"prompt": "a", "sampling": {"temp": 1}}'], 1,
     "\"sampling\": unknown key 'temp' (known: temperature, top_k, top_p, seed)"),
    (['{"prompt": "a", "max_tokens": "8"}'], 1, '"max_tokens" must be an integer, got a string'),
    # issue 26: these were tracebacks
    (['{"prompt": "a"}', '{"prompt": "a", "max_tokens": ' + "9" * 5001 + "}"], 2, "a number has too many digits"),
    (['{"prompt": "a"}', '{"custom_id": "\\ud800", "method": "POST", "url": "/v1/completions", '
                         '"body": {"model": "m", "prompt": "b"}}'], 2,
     "a string holds a lone UTF-16 surrogate (an escape like \\ud800 without its pair), which is not text"),
]


@pytest.mark.parametrize("lines,bad_line,message", BAD_FILES)
def test_bad_input_file_names_the_line(daemon, client, tmp_path, lines, bad_line, message):
    before = job_ids(client)
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    run = npuctl("submit", str(src), "--wait", socket_path=daemon.socket)
    assert run.returncode == 2
    assert run.stderr == f"error: {src}:{bad_line}: {message}\n"
    assert job_ids(client) == before  # nothing was submitted


def test_bad_input_file_not_utf8_or_empty(daemon, tmp_path):
    src = tmp_path / "latin1.jsonl"
    src.write_bytes(b'"ok"\n{"prompt": "caf\xe9"}\n')
    run = npuctl("submit", str(src), socket_path=daemon.socket)
    assert run.returncode == 2 and run.stderr == f"error: {src}:2: not UTF-8 (byte 16 of the line)\n"
    src = tmp_path / "empty.jsonl"
    src.write_text("\n\n")
    run = npuctl("submit", str(src), socket_path=daemon.socket)
    assert run.returncode == 2 and run.error_line.startswith(f"error: {src}: no prompts")
    run = npuctl("submit", str(tmp_path / "missing.jsonl"), socket_path=daemon.socket)
    assert run.returncode == 2
    assert run.stderr == f"error: cannot read {tmp_path / 'missing.jsonl'}: No such file or directory\n"


def test_a_line_the_daemon_rejects_cancels_the_jobs_before_it(daemon, client, tmp_path):
    # another priority: another job, submitted after the first
    src = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "def add(a, b):", "max_tokens": 3000},
                                              {"prompt": "x", "max_tokens": 0, "priority": "interactive"}])
    before = job_ids(client)
    run = npuctl("submit", str(src), "--wait", socket_path=daemon.socket)
    assert run.returncode == 1
    (first,) = job_ids(client) - before
    assert run.stderr == (f"error: {src}:2: max_tokens: 0 is out of range [1, 4096]; "
                          f"the job(s) submitted before it were cancelled: {first}\n")
    client.stream(first, tokens=False).wait()
    assert client.status(first)["state"] == "cancelled"


def test_a_refused_prompt_names_its_line_in_the_one_file_error_format(daemon, client, tmp_path):
    before = job_ids(client)
    src = write_jsonl(tmp_path / "in.jsonl", ["a", "", {"prompt": "b", "max_tokens": 2},
                                              {"prompt": "c", "sampling": {"top_p": 2}}])
    run = npuctl("submit", "-", socket_path=daemon.socket, stdin=src.read_bytes())
    assert run.returncode == 1  # the daemon's refusal, in the format of the client's own file errors
    assert run.stderr == "error: <stdin>:4: sampling.top_p: 2.0 is out of range (0.0, 1.0]\n"
    run = npuctl("submit", "-", socket_path=daemon.socket, stdin=b'"a"\n{"promt": "b"}\n')
    assert run.returncode == 2 and run.stderr.startswith("error: <stdin>:2: unknown key 'promt'")
    # a setting of the command line is the whole job's: its first line, and how many more
    run = npuctl("submit", str(src), "--max-tokens", "0", socket_path=daemon.socket)
    assert run.returncode == 1
    assert run.stderr == (f"error: {src}:1: params.max_tokens: 0 is out of range [1, 4096] "
                          "(for the job of this line and 2 more)\n")
    assert job_ids(client) == before


def test_usage_errors(daemon, tmp_path):
    src = write_jsonl(tmp_path / "in.jsonl", ["x"])
    cases = [
        (["status", "abc"], "error: argument JOB: a job id is a positive integer or a 16-hex-digit reference, got 'abc'"),
        (["cancel", "0"], "error: argument JOB: a job id is a positive integer or a 16-hex-digit reference, got '0'"),
        (["frobnicate"], "error: argument COMMAND: invalid choice: 'frobnicate'"),
        (["submit", str(src), "-o", str(tmp_path / "o")], "error: -o/--output needs --wait"),
        (["tickets", "--since", "yesterday"], "error: argument --since: expected Unix seconds"),
        (["cache", "pin", "name"], "error: cache pin: give the prefix as TEXT or with --file"),
        (["submit", str(src), "--wait", "-o", str(tmp_path / "no" / "dir" / "o")],
         f"error: cannot write {tmp_path / 'no' / 'dir' / 'o'}: No such file or directory"),
        ([], "error: the following arguments are required: COMMAND"),
    ]
    for args, start in cases:
        run = npuctl(*args, socket_path=daemon.socket)
        assert run.returncode == 2, args
        assert run.error_line.startswith(start), (args, run.stderr)


def test_help_is_complete():
    parser = build_parser()
    top = parser.format_help()
    commands = ["submit", "complete", "jobs", "status", "result", "cancel", "tickets", "device", "cache",
                "models", "stats"]
    for name in commands:
        assert f"    {name} " in top, name
    assert EXIT_CODES_HELP in top and "NPUD_SOCKET" in top
    run = npuctl("--help", socket_path=None)
    assert run.returncode == 0 and run.stdout.startswith("usage: npuctl")
    for name in commands:
        run = npuctl(name, "--help", socket_path=None)
        assert run.returncode == 0, name
        assert "--json" in run.stdout and "exit codes:" in run.stdout, name
    assert "per-line keys:" in npuctl("submit", "--help", socket_path=None).stdout
    for action in ("ls", "pin", "drop"):
        assert npuctl("cache", action, "--help", socket_path=None).returncode == 0


# -- the pieces, without a daemon ----------------------------------------------------------------------

def test_plan_jobs_groups_by_model_priority_and_kind_and_splits_at_the_job_limit():
    text = ['"a"', '"b"', '{"prompt": "c", "max_tokens": 2}', '"d"', '{"prompt": "e", "model": "n"}',
            '{"messages": [{"role": "user", "content": "f"}]}', '{"prompt": "g", "sampling": {"seed": 5}}',
            '{"prompt": "h", "priority": "interactive"}']
    lines = read_lines(text, "in", {"max_tokens": 4})
    plans = plan_jobs(lines, 2)
    assert [[ln.number for ln in p.lines] for p in plans] == [[1, 2], [3, 4], [5], [6], [7], [8]]
    assert [p.params() for p in plans][:2] == [{"max_tokens": 4, "prompts": ["a", "b"]},
                                               {"max_tokens": 4, "prompts": ["c", "d"],
                                                "prompt_settings": [{"max_tokens": 2}, None]}]
    assert plans[2].params() == {"max_tokens": 4, "model": "n", "prompts": ["e"]}
    assert plans[3].params() == {"max_tokens": 4, "chats": [[{"role": "user", "content": "f"}]]}
    assert plans[5].params() == {"max_tokens": 4, "priority": "interactive", "prompts": ["h"]}
    plans = plan_jobs(lines, 1024)
    assert [[ln.number for ln in p.lines] for p in plans] == [[1, 2, 3, 4, 7], [5], [6], [8]]
    assert plans[0].params()["prompt_settings"] == [None, None, {"max_tokens": 2}, None, {"sampling": {"seed": 5}}]


def test_plan_jobs_keeps_requests_within_the_line_limit_and_names_a_line_too_large():
    # before: a job too large for the daemon's line limit was refused as a whole and reported
    # at its first line, whichever line was too large
    big = "x" * 3000
    lines = read_lines(['"a"', '"b"', f'"{big}"', f'"{big}"', '"c"'], "in", {})
    plans = plan_jobs(lines, 1024, 4096 + 3100)
    assert [[ln.number for ln in p.lines] for p in plans] == [[1, 2, 3], [4, 5]]
    lines = read_lines(['"a"', '"b"', '"' + "x" * 70000 + '"'], "in", {})
    with pytest.raises(InputError, match=r"^line 3: about 70016 bytes of JSON, more than a request may carry "
                                         r"\(the daemon's limits.max_line_bytes = 65536\)"):
        plan_jobs(lines, 1024, 65536)


def test_line_settings_merge_over_the_command_line():
    (line,) = read_lines(['{"prompt": "a", "sampling": {"seed": 3}, "stop": ["x"]}'], "in",
                         {"sampling": {"temperature": 0.5, "seed": 1}, "stop": ["y"], "model": "m"})
    assert line.settings == {"sampling": {"temperature": 0.5, "seed": 3}, "stop": ["x"], "model": "m"}
    # what is sent: the command line's as the job's, the line's own as its prompt_settings entry
    assert line.job_settings == {"sampling": {"temperature": 0.5, "seed": 1}, "stop": ["y"], "model": "m"}
    assert line.own == {"sampling": {"seed": 3}, "stop": ["x"]}
    with pytest.raises(InputError, match=r"^in: no prompts"):
        read_lines(["", "  "], "in", {})


def test_when_parses_times():
    assert when("1767000000") == 1767000000.0
    assert when("90m", now=lambda: 10_000.0) == 10_000.0 - 5400
    assert when("2d", now=lambda: 200_000.0) == 200_000.0 - 172_800
    import datetime as dt
    assert when("2026-11-29T09:30") == dt.datetime(2026, 11, 29, 9, 30).timestamp()


def test_ticket_row():
    t = {"ticket": 7, "job": 3, "priority": "batch", "state": "released", "outcome": "preempted",
         "reason": "quantum", "queued_at": 100.0, "granted_at": 101.5, "released_at": 103.0, "thermal_c": 61.5,
         "errors_at_grant": 0, "errors_at_release": 2, "tokens": 40, "drafted": 32, "accepted": 24}
    row = ticket_row(t, None)
    assert row[0:4] == [7, 3, None, "batch"]
    assert row[7:] == ["1.5s", "preempted:quantum", "61.5C", "0->2", 40, "75%", "-"]
    assert row[13] == "-"  # no sequences recorded (a ticket stored before batching)
    shared = {**t, "jobs": [3, 5], "sequences": [{"job": 3, "prompt": 0}, {"job": 3, "prompt": 1},
                                                  {"job": 5, "prompt": 0}], "other_sequences": 0}
    assert ticket_row(shared, None)[13] == "3: 3,5"
    assert ticket_row({**shared, "jobs": [3], "sequences": shared["sequences"][:2]}, None)[13] == "2"
    assert ticket_row({**shared, "jobs": [5], "sequences": shared["sequences"][2:], "other_sequences": 2},
                      None)[13] == "3: 5 +2 of others"
    queued = {"ticket": 8, "job": 3, "priority": "batch", "state": "queued", "queued_at": time.time() - 3}
    assert ticket_row(queued, None)[8] == "queued" and ticket_row(queued, None)[10] == "-"


def test_progress_counts_tokens_once():
    clock = iter([0.0, 2.0, 2.0, 2.0, 2.0]).__next__
    p = Progress(4, clock=clock)
    p.on_tokens(5, 0, 3)
    p.on_tokens(5, 1, 2)
    p.on_result(5, {"prompt": 0, "token_ids": [1, 2, 3, 4], "stats": {"drafted": 4, "accepted": 3}})
    p.done_by_job[5] = 1
    assert p.tokens == 6 and (p.drafted, p.accepted) == (4, 3)
    assert p.tokens_per_s() == 3.0
    bar = ProgressBar(None, p).line(80)
    width = bar.index("]") - 1
    assert bar[1:width + 1] == "#" * (width // 4) + "-" * (width - width // 4)
    assert " 1/4 prompts       3.0 tok/s  acceptance  75% " in bar and len(bar) <= 79


def test_the_progress_bar_keeps_its_width():
    now = [1.0]
    p = Progress(120, clock=lambda: now[0])
    p.started = 0.0
    bar = ProgressBar(None, p)
    lines = [bar.line(200)]
    for step, state in enumerate(["queued", "running", "preempted", "running", "done"]):
        p.state, p.job = state, 7 if step < 2 else 1234
        p.on_tokens(p.job, step, 10 ** (step + 1))  # tok/s grows by digits
        p.done_by_job = {p.job: min(120, 3 ** (step + 1))}
        p.drafted, p.accepted = 10 * step, 9 * step
        now[0] += 0.5
        lines.append(bar.line(200))
    assert len({len(line) for line in lines}) == 1, lines
    assert len({line.index("]") for line in lines}) == 1
    assert len({line.index("tok/s") for line in lines}) == 1
    assert lines[-1].startswith("[" + "#" * 30 + "]") and " 120/120 prompts " in lines[-1]
    assert lines[1].startswith("[" + "-" * 30 + "]") and "   3/120 prompts " in lines[1]
    assert len(bar.line(40)) == 39  # a narrow terminal cuts the line


def test_result_lines_say_the_break_even_and_the_fallbacks():
    from npud.clients.npuctl_show import _break_even

    assert _break_even({}) == "" and _break_even({"break_even_acceptance": None, "fallbacks": []}) == ""
    fell = {"break_even_acceptance": 0.234, "fallbacks": [{"round": 3}, {"round": 9}]}
    assert _break_even(fell) == " (break-even 23%, fell back after round 3 and 1 more)"
    assert _break_even({"break_even_acceptance": None, "fallbacks": [{"round": 2}]}) == " (fell back after round 2)"


def test_models_says_where_each_layer_runs_and_why():
    from npud.clients.npuctl_show import placement_lines

    slow = "the host is faster (1-row pass: NPU 2.000 ms, host 1.000 ms)"
    layer = {"attn.q": "npu", "attn.o": slow, "mlp.down": slow}
    d = {"backend": "xrt", "backend_reason": "designs from /d/design.json",
         "layer_placement": {"0": layer, "1": dict(layer), "2": {"attn.q": "npu", "attn.o": "npu", "mlp.down": "npu"}}}
    assert placement_lines(d) == ["backend xrt (designs from /d/design.json)",
                                  f"layers 0-1: npu: attn.q; host: attn.o, mlp.down ({slow})",
                                  "layer 2: npu: attn.q, attn.o, mlp.down"]
    lost = {"backend": "host", "backend_reason": "host backend: the NPU was slower ...", "layer_placement": {},
            "gemm_costs": {"64x64 bf16": {"rows": 1, "npu_ms": 2.0, "host_ms": 1.0}}}
    assert placement_lines(lost) == ["backend host (host backend: the NPU was slower ...)"]
    assert placement_lines({"backend": "host", "backend_reason": "host backend requested"}) == []
