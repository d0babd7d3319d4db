"""npuctl: the command line of npud, built on the client library (npud/clients/client.py).

Exit codes: 0 ok, 1 an error reported by the daemon (or a job that failed), 2 a usage
error (bad arguments, a bad input file), 3 the daemon is unreachable, 130 interrupted.
Errors are printed as `error: <message>` on stderr; with --json also as
`{"error": {"code", "message"}}` on stdout, so a script keeps the daemon's code.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import sys
import textwrap
import time
from collections.abc import Callable
from typing import NoReturn

from npud.clients.client import ConnectionLost, NotRunning, NpudError, PermissionDenied
from npud.clients.npuctl_common import (EXIT_DAEMON, EXIT_INTERRUPTED, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, Failed,
                                   Interrupted, UsageError)
from npud.clients.npuctl_show import (cmd_cache, cmd_cancel, cmd_device, cmd_jobs, cmd_load, cmd_models, cmd_unload, cmd_result, cmd_stats,
                                 cmd_status, cmd_tickets)
from npud.clients.npuctl_chat import cmd_chat
from npud.clients.npuctl_submit import cmd_complete, cmd_submit
from npud.clients.shell_completion import bash_script, zsh_script
from npud import __version__

EXIT_CODES_HELP = """\
exit codes:
  0    success
  1    the daemon reported an error (not found, forbidden, quarantined, ...), or a job
       or prompt being waited for failed or was cancelled
  2    usage error: bad arguments or a bad input file (the message names the line)
  3    the daemon is unreachable: not running, no permission on its socket, or the
       connection dropped
  130  interrupted (Ctrl-C)

environment:
  NPUD_SOCKET  the daemon's socket when --socket is not given (default /run/npud/npud.sock
               if it exists, else a per-user npud's $XDG_RUNTIME_DIR/npud/npud.sock)

Errors are printed as `error: <message>` on stderr; with --json also as one line
{"error": {"code": ..., "message": ...}} on stdout (code: the daemon's error code, or
usage_error, not_running, not_a_socket, permission_denied, connection_lost,
interrupted). A job that failed while --wait followed it is reported in its results
instead. Tables and progress bars are drawn
only on a terminal; otherwise every row or event is one plain line (tables as
tab-separated columns, the column names on the first line). --json prints the daemon's replies as JSON.
"""

SUBMIT_INPUT_HELP = """\
input format (JSONL, one prompt per line; blank lines are skipped):
  {"prompt": "The capital of France is"}
  {"messages": [{"role": "user", "content": "Write a haiku"}], "max_tokens": 64}
  {"prompt": "def fib(n):", "id": "fib", "stop": ["\\n\\n"], "sampling": {"temperature": 0.7, "seed": 1}}
  "a bare JSON string is a prompt too"
  {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
   "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

per-line keys: prompt | messages (exactly one), id (any JSON value, echoed in the
result), model, max_tokens, sampling {temperature, top_k, top_p, seed}, stop, spec
{method, k, fallback_rounds}, use_prefix_cache, priority, logprobs (alternatives per
token), response_format ({"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema"}}), grammar ({"regex": ...} or {"lark": ...}). A line's settings override
the command line's. Lines go to one job unless their model, priority or kind (prompt or
messages) differ, or a job is full (limits.max_prompts_per_job): each prompt keeps its
own settings inside its job.

OpenAI Batch request lines (url /v1/completions or /v1/chat/completions) are read too:
body keys model, prompt | messages, max_tokens (max_completion_tokens), temperature,
top_p, seed, stop, n (1), response_format, and "npud": {top_k, spec, use_prefix_cache,
priority, grammar}.

results (--wait): one JSON object per input line, in input order:
  {"index": 0, "line": 1, "id": ..., "job": 42, "prompt_in_job": 0, "text": "...",
   "token_ids": [...], "prompt_tokens": 9, "finish_reason": "stop", "stats": {...}}
or with "error": {"code", "message"} in place of the text for a prompt that failed.
With --format openai, OpenAI Batch output lines instead:
  {"id": "batch_req_42_0", "custom_id": "r1", "response": {"status_code": 200,
   "request_id": "npud-42-0", "body": {...a (chat) completion object...}}, "error": null}
"""


# -- argument types ----------------------------------------------------------------------------

def job_id(text: str) -> int | str:
    """A job id, or the reference an HTTP reply names a job by (16 hex digits: `cmpl-REF`)."""
    if re.fullmatch(r"[0-9a-f]{16}", text):
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a job id is a positive integer or a 16-hex-digit reference, got {text!r}")
    return value


_AGO = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def when(text: str, now: Callable[[], float] = time.time) -> float:
    """A point in time as Unix seconds: `1767000000`, `30m` / `2h` / `1d` ago, or an ISO
    date/time in local time (`2026-11-29`, `2026-11-29T09:30`)."""
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    m = _AGO.match(text)
    if m:
        return now() - float(m.group(1)) * _UNITS[m.group(2)]
    try:
        return dt.datetime.fromisoformat(text).timestamp()
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected Unix seconds, a time ago like 30m, 2h or 1d, or an ISO date/time like 2026-11-29T09:30, "
            f"got {text!r}") from None


# -- the parser --------------------------------------------------------------------------------------

class ArgumentError(UsageError):
    """A command line argparse rejects; `usage` is the usage line of the (sub)command."""

    def __init__(self, message: str, usage: str) -> None:
        super().__init__(message)
        self.usage = usage


class Parser(argparse.ArgumentParser):
    """argparse with npuctl's error format and exit code (main() reports the error, so that
    --json reports it as JSON too)."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(message, self.format_usage())


def _common(sub: bool) -> argparse.ArgumentParser:
    # On the subcommands the defaults are SUPPRESS, so `npuctl --json jobs` and
    # `npuctl jobs --json` both work and neither overwrites the other.
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", default=argparse.SUPPRESS if sub else False,
                   help="print machine-readable JSON (the daemon's reply) instead of text")
    p.add_argument("--socket", metavar="PATH", default=argparse.SUPPRESS if sub else None,
                   help="the daemon's socket (default: $NPUD_SOCKET, else /run/npud/npud.sock if it exists, "
                        "else $XDG_RUNTIME_DIR/npud/npud.sock)")
    return p


def _generation_options() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("generation settings (default: the daemon's)")
    g.add_argument("--model", help="a model name from `npuctl models` (default: the daemon's default model)")
    g.add_argument("--max-tokens", type=int, metavar="N", help="tokens to generate at most per prompt (default 128)")
    g.add_argument("--temperature", type=float, metavar="T", help="sampling temperature; 0 is greedy (the default)")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (0: all)")
    g.add_argument("--top-p", type=float, metavar="P", help="nucleus sampling mass in (0, 1]")
    g.add_argument("--seed", type=int, help="sampling seed, for reproducible sampled output")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop when TEXT is generated (repeatable)")
    g.add_argument("--spec", choices=("auto", "none", "ngram", "draft", "dflash", "assistant"),
                   help="speculative decoding: auto (default), none, ngram (prompt lookup), draft (draft model), "
                        "dflash (the model's DFlash block drafter) or assistant (its Gemma 4 assistant)")
    g.add_argument("--spec-k", type=int, metavar="K", help="tokens drafted per round, 1..16 (default 16 for prompt lookup, else 4)")
    g.add_argument("--no-prefix-cache", action="store_true", help="do not reuse or store cached prompt prefixes")
    return p


def build_parser() -> Parser:
    common = _common(sub=True)
    gen = _generation_options()
    parser = Parser(
        prog="npuctl", parents=[_common(sub=False)], formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill("Talk to npud, the local LLM daemon: submit batch jobs, stream completions, "
                                  "and inspect the queue, the tickets, the device and the caches.", 88),
        epilog=EXIT_CODES_HELP)
    parser.add_argument("--version", action="version", version=f"npuctl {__version__}")
    subs = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    def add(name: str, func: Callable[[argparse.Namespace], int], help: str, description: str,
            parents: tuple = (), epilog: str = "") -> Parser:
        p = subs.add_parser(name, help=help, description=textwrap.fill(description, 88), parents=[common, *parents],
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog=(epilog + "\n" if epilog else "") + EXIT_CODES_HELP)
        p.set_defaults(func=func)
        return p

    p = add("submit", cmd_submit, "queue a batch job from a JSONL file",
            "Queue the prompts of FILE (JSONL, npud's lines or OpenAI Batch requests; - reads stdin) as a batch "
            "job and print its id (one id per line when the lines need several jobs). With --wait, follow the job(s): a progress bar (prompts "
            "done, tokens/s, acceptance) on a terminal, one line per finished prompt otherwise, both on "
            "stderr; then write the results as JSONL in input order to -o FILE (default stdout).",
            parents=(gen,), epilog=SUBMIT_INPUT_HELP)
    p.add_argument("file", metavar="FILE", help="JSONL input, one prompt per line; - for stdin")
    p.add_argument("--wait", action="store_true", help="wait for the job(s) and write the results")
    p.add_argument("-o", "--output", metavar="OUT", help="with --wait: write the results to OUT (default stdout)")
    p.add_argument("--format", choices=("npud", "openai"), default="npud",
                   help="with --wait: the shape of the result lines, npud's (the default) or the OpenAI Batch "
                        "output's")
    p.add_argument("--priority", choices=("batch", "interactive"), help="queue class (default batch)")

    p = add("complete", cmd_complete, "stream a completion of a prompt",
            "Stream an interactive completion of PROMPT to stdout as it is generated (interactive priority: "
            "it goes before batch work). Ctrl-C cancels it. On a terminal a summary (tokens, tok/s, "
            "acceptance) follows on stderr; --json prints only the final result object.",
            parents=(gen,), epilog="example:\n  npuctl complete --max-tokens 32 'def fibonacci(n):'\n")
    p.add_argument("prompt", metavar="PROMPT", help="the prompt text; - reads it from stdin")
    p.add_argument("--system", metavar="TEXT",
                   help="send a chat (system TEXT, user PROMPT) through the model's chat template")

    p = add("chat", cmd_chat, "chat with a model in the terminal",
            "Chat with MODEL (default: the daemon's default model) as `ollama run` does: type a message, "
            "the reply streams as it is generated, and each turn sends the whole conversation through the "
            "model's chat template (named once, after the first reply). Lines are edited with readline and "
            "kept in $XDG_STATE_HOME/npud/chat_history. /system TEXT sets the system message, /reset forgets "
            "the conversation, /save FILE writes it as JSON, /help lists the commands, /bye or Ctrl-D leaves; "
            "a line of three double quotes begins and ends a message of several lines. Ctrl-C stops a reply "
            "(its job is cancelled) and the session goes on. A reply runs until the model ends its turn, at "
            "most --max-tokens (default: the daemon's limits.max_tokens). Without a terminal, each line of "
            "stdin is one message.",
            parents=(gen,), epilog="example:\n  npuctl chat gemma-3-270m\n  >>> Name a colour.\n")
    p.add_argument("chat_model", metavar="MODEL", nargs="?", help="a model name from `npuctl models`")
    p.add_argument("--system", metavar="TEXT", help="the conversation's system message")
    p.add_argument("--verbose", action="store_true", help="after each reply, its tokens, finish and tok/s on stderr")

    p = add("jobs", cmd_jobs, "list jobs",
            "List jobs, newest first: yours, or everyone's with --all-users (admin). Columns: job, user, state, "
            "priority, model, prompts done/total, tokens, ticket (the one an unfinished job waits with, holds or "
            "rides: jobs with the same ticket share the device in one batch; with its prompts running now), "
            "created, finished, error.")
    p.add_argument("--state", action="append", choices=("queued", "running", "done", "failed", "cancelled"),
                   help="only jobs in this state (repeatable)")
    p.add_argument("--all-users", action="store_true", help="every user's jobs (needs the admin group)")
    p.add_argument("--limit", type=int, metavar="N", help="at most N jobs (1..1000, default 50)")
    p.add_argument("--before", type=job_id, metavar="JOB", help="only jobs older than JOB (for paging)")

    p = add("status", cmd_status, "show one job",
            "Show a job's state, progress, ticket and running prompts, queue position, times and error.")
    p.add_argument("job", type=job_id, metavar="JOB", help="a job id, from `npuctl submit` or `npuctl jobs`")

    p = add("result", cmd_result, "print a job's results",
            "Print the results a job has so far, in prompt order: a header line and the text of each "
            "prompt; --json prints the daemon's reply; -o writes one JSON result per line.")
    p.add_argument("job", type=job_id, metavar="JOB", help="a job id, from `npuctl submit` or `npuctl jobs`")
    p.add_argument("--prompt", type=int, action="append", metavar="I", help="only prompt I, 0-based (repeatable)")
    p.add_argument("-o", "--output", metavar="OUT", help="write the results as JSONL to OUT (- for stdout)")

    p = add("cancel", cmd_cancel, "cancel jobs",
            "Cancel jobs: a queued job at once, a running one at its next round boundary.")
    p.add_argument("jobs", type=job_id, nargs="+", metavar="JOB", help="the ids of the jobs to cancel")

    p = add("tickets", cmd_tickets, "show the ticket history (device holds)",
            "Show the history of device holds, newest first, as a table: ticket, job, user, priority, "
            "queued/granted/released times, wait, outcome (with the reason for preempted or failed), "
            "temperature at grant, amdxdna error counts at grant->release, tokens, acceptance, sequences (how "
            "many prompts ran under the ticket and, when it was shared in a batch, the jobs that rode it). "
            "Non-admin users see the tickets of their own jobs and those their jobs rode.",
            epilog="times for --since/--until: Unix seconds, a time ago (30s, 10m, 2h, 1d), or an ISO date/time "
                   "in local time (2026-11-29, 2026-11-29T09:30)")
    p.add_argument("--since", type=when, metavar="TIME", help="only tickets queued at or after TIME")
    p.add_argument("--until", type=when, metavar="TIME", help="only tickets queued before TIME")
    p.add_argument("--job", type=job_id, metavar="JOB", help="only the tickets JOB held or rode")
    p.add_argument("--outcome", choices=("done", "cancelled", "failed", "faulted", "preempted", "joined"),
                   help="only released tickets with this outcome")
    p.add_argument("--state", choices=("queued", "granted", "released"), help="only tickets in this state")
    p.add_argument("--limit", type=int, metavar="N", help="at most N tickets (1..1000, default 100)")

    p = add("device", cmd_device, "show the device, or clear its quarantine",
            "Show the compute backend (npu or host, and why), where the GEMMs run (npu or host, and why), its "
            "nodes, driver and firmware, the thermal state and NPU power, the amdxdna error and pre-hang warning "
            "counts and the quarantine state. `npuctl device clear` lifts a quarantine (admin).")
    p.add_argument("action", nargs="?", choices=("status", "clear"), default="status",
                   help="status (the default) or clear")

    p = add("cache", cmd_cache, "list, pin or drop prefix-cache entries",
            "The prefix caches of the resident models. ls: counters (admin) and pinned entries; "
            "pin NAME (TEXT | --file F): compute the prefix TEXT and keep it under NAME (admin); "
            "drop KEY: remove an entry (admin).")
    cache = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = cache.add_parser("ls", help="list caches and pins", parents=[common],
                         description="List the caches: counters (to an admin) and the pinned entries, NAME and KEY.")
    c.add_argument("--model", help="only this model")
    c = cache.add_parser("pin", help="pin a prefix under a name (admin)", parents=[common],
                         description="Compute the prefix TEXT in MODEL and pin it under NAME.")
    c.add_argument("name", metavar="NAME", help="the name to pin the prefix under")
    c.add_argument("text", metavar="TEXT", nargs="?", help="the prefix text (or use --file)")
    c.add_argument("--file", metavar="FILE", help="read the prefix from FILE (- for stdin)")
    c.add_argument("--model", help="the model (default: the daemon's default)")
    c = cache.add_parser("drop", help="drop an entry (admin)", parents=[common], description="Drop entry KEY.")
    c.add_argument("key", metavar="KEY", help="the entry's key, from `npuctl cache ls`")
    c.add_argument("--model", help="the model (default: the daemon's default)")

    add("models", cmd_models, "list the configured models",
        "List the configured models: whether each is loaded, unloaded, loading or failed (its last load), "
        "its memory, keep-alive, weight format, size, context length, checkpoint and draft model.")
    p = add("load", cmd_load, "load a model now",
            "Load MODEL now rather than on its first request (any user may: a request would load it too). "
            "--keep-alive sets how long it stays loaded once no job uses it (seconds or a duration such as "
            "5m or 1h; negative: until memory is needed), for every later request that does not say.")
    p.add_argument("model", metavar="MODEL", help="a model name from `npuctl models`")
    p.add_argument("--keep-alive", metavar="DURATION", help="e.g. 300, 5m, 1h30m, -1")
    p = add("unload", cmd_unload, "unload a model (admin)",
            "Unload MODEL, freeing its memory; refused while a queued or running job uses it. Its next "
            "request loads it again.")
    p.add_argument("model", metavar="MODEL", help="a model name from `npuctl models`")
    add("stats", cmd_stats, "show daemon counters",
        "Show the daemon's uptime, connections, jobs and tickets by state, tokens generated, the queue and "
        "who holds the device; then, since the daemon started, tickets by outcome, wait-time quantiles per "
        "class, tokens/s, speculative acceptance, prefix-cache hits, the thermal reading and the amdxdna "
        "error count.")

    p = subs.add_parser("completion", help="print a shell completion script (bash or zsh)",
                        formatter_class=argparse.RawDescriptionHelpFormatter,
                        description=textwrap.fill("Print the completion script of SHELL for npuctl, generated from "
                                                  "its options, on stdout.", 88),
                        epilog="examples:\n  source <(npuctl completion bash)          # in ~/.bashrc\n"
                               "  npuctl completion zsh > ~/.zfunc/_npuctl   # ~/.zfunc in $fpath before compinit\n")
    p.add_argument("shell", choices=("bash", "zsh"), metavar="SHELL", help="bash or zsh")
    p.set_defaults(func=cmd_completion)
    return parser


def cmd_completion(args: argparse.Namespace) -> int:
    script = bash_script if args.shell == "bash" else zsh_script
    sys.stdout.write(script(build_parser()))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    as_json = "--json" in argv[:argv.index("--")] if "--" in argv else "--json" in argv
    try:
        args = build_parser().parse_args(argv)
    except ArgumentError as exc:
        if not as_json:
            sys.stderr.write(exc.usage)
        return _fail(EXIT_USAGE, "usage_error", str(exc), as_json)
    try:
        return args.func(args)
    except UsageError as exc:
        return _fail(EXIT_USAGE, "usage_error", str(exc), args.json)
    except (NotRunning, PermissionDenied, ConnectionLost) as exc:
        return _fail(EXIT_UNREACHABLE, exc.code, exc.message, args.json)
    except NpudError as exc:
        return _fail(EXIT_UNREACHABLE if exc.code == "connection_failed" else EXIT_DAEMON, exc.code, exc.message,
                     args.json)
    except Failed as exc:  # the results (or the result) printed already carry the errors
        return _fail(EXIT_DAEMON, "failed", str(exc), False)
    except (Interrupted, KeyboardInterrupt) as exc:
        return _fail(EXIT_INTERRUPTED, "interrupted", str(exc) or "interrupted", args.json)
    except BrokenPipeError:
        # the reader went away (`npuctl jobs | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _fail(exit_code: int, code: str, message: str, as_json: bool) -> int:
    """Report an error: `error: MESSAGE` on stderr, and with --json `{"error": {"code",
    "message"}}` as one line on stdout; returns the exit code."""
    if as_json:
        sys.stdout.write(json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    sys.stderr.write(f"error: {message}\n")
    return exit_code


if __name__ == "__main__":
    sys.exit(main())
