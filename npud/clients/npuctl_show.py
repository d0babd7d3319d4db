"""The npuctl commands that read or change one thing: jobs, status, result, cancel, tickets,
device, cache, models, stats."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from npud.clients.client import Client, ConnectionLost, NotRunning, NpudError, PermissionDenied
from npud.clients.npuctl_common import (EXIT_DAEMON, EXIT_OK, UsageError, connect, emit_json, is_tty, open_output,
                                   user_name)
from npud.clients.termout import fmt_bytes, fmt_duration, fmt_rate, fmt_time, load_stage, print_fields, print_table


# -- jobs, status, result, cancel ----------------------------------------------------------------

def _prompts(status: dict) -> str:
    return f"{status.get('done_prompts', 0)}/{status.get('num_prompts', 0)}"


def cmd_jobs(args: argparse.Namespace) -> int:
    with connect(args) as c:
        reply = c.jobs(args.state or None, all_users=args.all_users or None, limit=args.limit, before=args.before)
    if args.json:
        emit_json(reply)
        return EXIT_OK
    rows = [[j["job"], user_name(j.get("owner_uid")), j["state"], j.get("priority"), j.get("model"), _prompts(j),
             j.get("tokens"), _ticket(j), fmt_time(j.get("created_at")), fmt_time(j.get("finished_at")),
             (j.get("error") or {}).get("message")] for j in reply["jobs"]]
    print_table(sys.stdout, ["job", "user", "state", "priority", "model", "prompts", "tokens", "ticket", "created",
                             "finished", "error"], rows, tty=is_tty(sys.stdout))
    return EXIT_OK


def _ticket(j: dict) -> str:
    """The ticket an unfinished job holds, rides or waits with, and its prompts running now:
    jobs that show the same ticket share the device in one batch."""
    ticket = j.get("ticket")
    if ticket is None:
        return "-"
    running = j.get("running_prompts") or []
    return f"{ticket}" + (f" ({len(running)} running)" if running else "")


def _status_fields(s: dict) -> list[tuple[str, Any]]:
    error = s.get("error")
    return [
        ("job", s["job"]), ("user", user_name(s.get("owner_uid"))), ("state", s["state"]),
        ("priority", s.get("priority")), ("model", s.get("model")), ("prompts", _prompts(s)),
        ("tokens", s.get("tokens")), ("tickets", s.get("tickets")), ("ticket", _ticket(s)),
        ("running prompts", " ".join(str(p) for p in s.get("running_prompts") or []) or None),
        ("queue position", s.get("queue_position")),
        ("created", fmt_time(s.get("created_at"))), ("started", fmt_time(s.get("started_at"))),
        ("finished", fmt_time(s.get("finished_at"))), ("cancel requested", s.get("cancel_requested")),
        ("error", None if not error else f"{error.get('message')} ({error.get('code')})"),
    ]


def cmd_status(args: argparse.Namespace) -> int:
    with connect(args) as c:
        status = c.status(args.job)
    if args.json:
        emit_json(status)
    else:
        print_fields(sys.stdout, _status_fields(status))
    return EXIT_OK


def cmd_result(args: argparse.Namespace) -> int:
    out = open_output(args.output) if args.output else None
    try:
        with connect(args) as c:
            reply = c.result(args.job, prompts=args.prompt or None)
        if out is not None:
            for r in reply["results"]:
                out.write(json.dumps(r, ensure_ascii=False) + "\n")
        elif args.json:
            emit_json(reply)
        else:
            for r in reply["results"]:
                if "error" in r:
                    sys.stdout.write(f"--- prompt {r['prompt']}: error: {r['error'].get('message')} "
                                     f"({r['error'].get('code')})\n")
                    continue
                stats = r.get("stats") or {}
                sys.stdout.write(
                    f"--- prompt {r['prompt']}: {r.get('finish_reason')}, {len(r.get('token_ids') or ())} tokens, "
                    f"acceptance {fmt_rate(int(stats.get('accepted') or 0), int(stats.get('drafted') or 0))}"
                    f"{_break_even(stats)}\n")
                text = r.get("text", "")
                sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
            if not reply["results"]:
                sys.stderr.write(f"job {args.job} is {reply['state']} and has no results yet\n")
    finally:
        if out is not None and out is not sys.stdout:
            out.close()
    return EXIT_OK


def cmd_cancel(args: argparse.Namespace) -> int:
    code = EXIT_OK
    replies = []
    with connect(args) as c:
        for job in args.jobs:
            try:
                reply = c.cancel(job)
            except (NotRunning, PermissionDenied, ConnectionLost):
                raise
            except NpudError as exc:
                sys.stderr.write(f"error: {exc.message}\n")
                code = EXIT_DAEMON
                continue
            replies.append(reply)
            if not args.json:
                if reply.get("cancelled"):
                    more = " (it stops at the next round boundary)" if reply.get("state") == "running" else ""
                    sys.stdout.write(f"job {job}: cancelled{more}\n")
                else:
                    sys.stdout.write(f"job {job}: had already ended ({reply.get('state')})\n")
    if args.json:
        emit_json({"jobs": replies})
    return code


# -- tickets ---------------------------------------------------------------------------------------

def _ticket_owners(c: Client, tickets: list[dict]) -> dict[int, int | None]:
    """Job -> owner uid for the tickets' jobs (from the ticket when the daemon sends it)."""
    owners: dict[int, int | None] = {}
    for t in tickets:
        job = t["job"]
        if "owner_uid" in t:
            owners[job] = t["owner_uid"]
        elif job not in owners:
            try:
                owners[job] = c.status(job).get("owner_uid")
            except (NotRunning, PermissionDenied, ConnectionLost):
                raise
            except NpudError:  # pruned, or not ours to read
                owners[job] = None
    return owners


def _wait_s(t: dict) -> float | None:
    if t.get("granted_at") is not None and t.get("queued_at") is not None:
        return t["granted_at"] - t["queued_at"]
    if t.get("state") == "queued" and t.get("queued_at") is not None:
        return time.time() - t["queued_at"]
    return None


def ticket_row(t: dict, owner: int | None) -> list[Any]:
    before, after = t.get("errors_at_grant"), t.get("errors_at_release")
    errors = "-" if before is None else f"{before}->{'-' if after is None else after}"
    outcome = t.get("outcome") or t.get("state")
    if t.get("reason") and t.get("outcome") not in (None, "done"):
        outcome = f"{outcome}:{t['reason']}"
    temp = t.get("thermal_c")
    return [t["ticket"], t["job"], user_name(owner), t.get("priority"), fmt_time(t.get("queued_at")),
            fmt_time(t.get("granted_at")), fmt_time(t.get("released_at")), fmt_duration(_wait_s(t)), outcome,
            "-" if temp is None else f"{temp:.1f}C", errors, t.get("tokens"),
            fmt_rate(int(t.get("accepted") or 0), int(t.get("drafted") or 0)), _shared(t)]


def _shared(t: dict) -> str:
    """The sequences that ran in a ticket and, when it was shared, the jobs that rode it:
    "3" (one job, three prompts), "5: 12,14,15" (five sequences of jobs 12, 14 and 15), with
    "+N" for other users' sequences."""
    sequences = t.get("sequences") or []
    if not sequences and not t.get("other_sequences"):
        return "-"
    jobs = t.get("jobs") or []
    out = str(len(sequences) + int(t.get("other_sequences") or 0))
    if len(jobs) > 1 or t.get("other_sequences"):
        out += ": " + ",".join(str(j) for j in jobs)
    if t.get("other_sequences"):
        out += f" +{t['other_sequences']} of others"
    return out


TICKET_HEADERS = ["ticket", "job", "user", "priority", "queued", "granted", "released", "wait", "outcome", "temp",
                  "errors", "tokens", "accept", "sequences"]


def cmd_tickets(args: argparse.Namespace) -> int:
    with connect(args) as c:
        reply = c.tickets(job=args.job, state=args.state, outcome=args.outcome, since=args.since, until=args.until,
                          limit=args.limit)
        if args.json:
            emit_json(reply)
            return EXIT_OK
        owners = _ticket_owners(c, reply["tickets"])
    rows = [ticket_row(t, owners.get(t["job"])) for t in reply["tickets"]]
    print_table(sys.stdout, TICKET_HEADERS, rows, tty=is_tty(sys.stdout))
    return EXIT_OK


# -- device, cache, models, stats --------------------------------------------------------------------

def _quarantine(q: dict | None) -> str:
    if not q:
        return "none"
    return (f"since {fmt_time(q.get('since'))}, ticket {q.get('ticket')} of job {q.get('job')}: "
            f"{q.get('reason')}")


def _cache(c: dict) -> str:
    if c.get("trusted"):
        return str(c.get("dir"))
    return f"not used ({c.get('reason')}); running without a cache"


def cmd_device(args: argparse.Namespace) -> int:
    with connect(args) as c:
        if args.action == "clear":
            reply = c.device_clear()
            if args.json:
                emit_json(reply)
            elif reply.get("cleared"):
                sys.stdout.write("quarantine lifted; queued work continues\n")
            else:
                sys.stdout.write("the device was not quarantined\n")
            return EXIT_OK
        d = c.device_status()
    if args.json:
        emit_json(d)
        return EXIT_OK
    thermal = d.get("thermal") or {}
    reading = thermal.get("reading_c")
    errors = d.get("errors") or {}
    gemms = d.get("gemms") or {}
    power = thermal.get("npu_power_w")
    holders = d.get("other_holders") or []
    cache = d.get("cache") or {}
    print_fields(sys.stdout, [
        ("backend", d.get("kind")), ("reason", d.get("reason")),
        ("gemms", f"{gemms.get('site')} ({gemms.get('reason')})" if gemms else None),
        ("nodes", d.get("nodes")), ("driver", d.get("driver")), ("firmware", d.get("fw_version")), ("xrt", d.get("xrt")),
        ("thermal", f"{thermal.get('state')}" + ("" if reading is None else f", {reading:.1f}C")
         + ("" if power is None else f", NPU {power:.2f} W")),
        ("errors", f"{errors.get('count')} (from {errors.get('source')})"
         + (f", {errors['pre_hang_count']} pre-hang warning(s)" if errors.get("pre_hang_count") else "")
         + (f", {errors['foreign_count']} of other processes (not npud's: never a fault)"
            if errors.get("foreign_count") else "")),
        ("also open by", ", ".join(f"{h['comm']} (pid {h['pid']})" for h in holders) if holders else None),
        ("power mode", _power_mode(d.get("power_mode") or {})),
        ("quarantine", _quarantine(d.get("quarantine"))),
        ("cache", _cache(cache) if cache else None),
    ])
    for line in errors.get("pre_hang_lines") or ():
        sys.stdout.write(f"  pre-hang: {line}\n")
    for line in errors.get("foreign_lines") or ():
        sys.stdout.write(f"  other process: {line}\n")
    for line in (d.get("quarantine") or {}).get("lines") or ():
        sys.stdout.write(f"  {line}\n")
    return EXIT_OK


def _power_mode(p: dict) -> str | None:
    """The NPU's power mode line: the mode in force, the one asked for where it differs, and why."""
    if not p.get("current") and not p.get("wanted"):
        return None
    line = p.get("current") or "unknown"
    if p.get("wanted") and p["wanted"] != p.get("current"):
        line += f" (device.power_mode = {p['wanted']}: {p.get('why') or 'not set'})"
    return line


def cmd_cache(args: argparse.Namespace) -> int:
    text = _pin_text(args) if args.action == "pin" else None
    with connect(args) as c:
        if args.action == "ls":
            reply = c.cache_list(args.model)
        elif args.action == "pin":
            reply = c.cache_pin(args.name, text, model=args.model)
        else:
            reply = c.cache_drop(args.key, model=args.model)
    if args.json:
        emit_json(reply)
        return EXIT_OK
    tty = is_tty(sys.stdout)
    if args.action == "ls":
        if not reply["models"]:
            sys.stderr.write("no resident model has a prefix cache\n")
        for m in reply["models"]:
            stats = m.get("stats") or {}
            sys.stdout.write(f"model {m['model']}: " + ", ".join(f"{k} {v}" for k, v in stats.items()) + "\n")
            pins = m.get("pins") or {}  # the daemon sends pins only: its entries are users' prompts
            print_table(sys.stdout, ("pin", "key"), sorted(pins.items()), tty=tty)
    elif args.action == "pin":
        entry = reply.get("entry") or {}
        sys.stdout.write(f"pinned {args.name!r} in model {reply.get('model')}\n")
        print_fields(sys.stdout, [(k, v) for k, v in entry.items() if not isinstance(v, dict)])
    else:
        sys.stdout.write(f"dropped {args.key} from model {reply.get('model')}\n")
    return EXIT_OK


def _pin_text(args: argparse.Namespace) -> str:
    if (args.text is None) == (args.file is None):
        raise UsageError("cache pin: give the prefix as TEXT or with --file (- for stdin), not both")
    if args.text is not None:
        return args.text
    if args.file == "-":
        return sys.stdin.read()
    try:
        with open(args.file, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise UsageError(f"cannot read {args.file}: {exc.strerror}") from None


def cmd_models(args: argparse.Namespace) -> int:
    with connect(args) as c:
        reply = c.models()
        default = c.hello("npuctl").get("default_model")
    if args.json:
        emit_json(reply)
        return EXIT_OK
    rows = []
    for m in reply["models"]:
        info = (m.get("describe") or {}).get("checkpoint") or {}
        mix = ", ".join(f"{t} {n}" for t, n in (info.get("quant_mix") or {}).items())
        params = info.get("parameters")
        rows.append([m["name"] + (" (default)" if m["name"] == default else ""),
                     f"loading ({load_stage(m['loading'])})" if m.get("loading")
                     else m.get("state") or ("loaded" if m.get("resident") else "unloaded"),
                     fmt_bytes(m.get("memory_bytes") or m.get("nbytes")), _keep_alive(m),
                     mix or m.get("weight_format"), info.get("architecture") or (m.get("describe") or {}).get("model_type"),
                     f"{params / 1e6:.0f}M" if params else None,
                     fmt_bytes(info.get("file_bytes")), m.get("max_context"),
                     m.get("checkpoint_dir"), m.get("draft_dir")])
    print_table(sys.stdout, ["model", "state", "memory", "keep-alive", "format", "arch", "params", "file",
                             "context", "checkpoint", "draft"], rows, tty=is_tty(sys.stdout))
    for m in reply["models"]:  # a model whose last load failed, and why
        if m.get("load_error"):
            print(f"{m['name']} does not load: {m['load_error']}")
        for line in placement_lines(m.get("describe") or {}):
            print(f"{m['name']}: {line}")
    return EXIT_OK


def placement_lines(d: dict) -> list[str]:
    """Where a loaded model's layers run and why, layers placed alike on one line: its backend and
    the reason, then "layers 0-27: npu: attn.q, ...; host: mlp.down (the host is faster (...))"."""
    layers = d.get("layer_placement") or {}
    if not layers and not str(d.get("backend", "")).startswith("xrt") and not d.get("gemm_costs"):
        return []
    lines = [f"backend {d.get('backend')} ({d.get('backend_reason')})"]
    groups: list[tuple[list[int], dict]] = []
    for index, placed in sorted(layers.items(), key=lambda kv: int(kv[0])):
        if groups and groups[-1][1] == placed and groups[-1][0][-1] == int(index) - 1:
            groups[-1][0].append(int(index))
        else:
            groups.append(([int(index)], placed))
    for indices, placed in groups:
        on_npu = [name for name, where in placed.items() if where.startswith("npu")]
        hosts: dict[str, list[str]] = {}
        for name, where in placed.items():
            if not where.startswith("npu"):
                hosts.setdefault(where, []).append(name)
        span = str(indices[0]) if len(indices) == 1 else f"{indices[0]}-{indices[-1]}"
        parts = ([f"npu: {', '.join(on_npu)}"] if on_npu else []) + [
            f"host: {', '.join(names)} ({why})" for why, names in hosts.items()]
        lines.append(f"layer{'s' if len(indices) > 1 else ''} {span}: " + "; ".join(parts))
    return lines


def _keep_alive(m: dict) -> str:
    """How long the model stays once idle, and when an idle one goes."""
    keep = m.get("keep_alive_s")
    if keep is None:
        return "until evicted"
    left = m.get("idle_unload_in_s")
    return fmt_duration(keep) + ("" if left is None else f" ({fmt_duration(left)} left)")


def cmd_load(args: argparse.Namespace) -> int:
    with connect(args) as c:
        reply = c.models_load(args.model, keep_alive=args.keep_alive)
    if args.json:
        emit_json(reply)
    elif reply.get("load_ms") is None:
        sys.stdout.write(f"{reply['name']} was already loaded ({fmt_bytes(reply.get('memory_bytes'))})\n")
    else:
        sys.stdout.write(f"{reply['name']} loaded in {fmt_duration(reply['load_ms'] / 1000)} "
                         f"({fmt_bytes(reply.get('memory_bytes'))})\n")
    return EXIT_OK


def cmd_unload(args: argparse.Namespace) -> int:
    with connect(args) as c:
        reply = c.models_unload(args.model)
    if args.json:
        emit_json(reply)
    else:
        sys.stdout.write(f"{reply['name']} {'unloaded' if reply['unloaded'] else 'was not loaded'}\n")
    return EXIT_OK


def _counts(d: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (d or {}).items()) or "none"


def _waits(w: dict | None) -> str:
    if not w or not w.get("count"):
        return "none yet"
    return (f"p50 {fmt_duration(w.get('p50'))}, p90 {fmt_duration(w.get('p90'))}, "
            f"p99 {fmt_duration(w.get('p99'))} (of {w['count']})")


def _metrics_fields(m: dict) -> list[tuple[str, Any]]:
    """The `metrics` object of `stats` (counters since the daemon started, and gauges)."""
    tickets = m.get("tickets") or {}
    waits = m.get("wait_s") or {}
    tokens = m.get("tokens") or {}
    spec = m.get("speculative") or {}
    cache = m.get("prefix_cache") or {}
    thermal = m.get("thermal") or {}
    errors = m.get("driver_errors") or {}
    reading = thermal.get("reading_c")
    hit_rate = cache.get("hit_rate")
    return [
        ("since start", f"{tickets.get('granted', 0)} tickets granted; released "
                        + _counts({k: v for k, v in (tickets.get("released") or {}).items() if v})),
        ("wait interactive", _waits(waits.get("interactive"))),
        ("wait batch", _waits(waits.get("batch"))),
        ("tokens/s", f"{tokens.get('per_second', 0):.1f} over the last {tokens.get('window_s', 0):g}s; "
                     f"device busy {fmt_duration(tokens.get('device_busy_s'))}"),
        ("acceptance", f"{fmt_rate(int(spec.get('accepted') or 0), int(spec.get('drafted') or 0))} "
                       f"({spec.get('accepted', 0)} of {spec.get('drafted', 0)} drafted tokens accepted)"),
        ("prefix cache", f"{cache.get('hits', 0)} hits, {cache.get('misses', 0)} misses "
                         f"(hit rate {'-' if hit_rate is None else f'{100 * hit_rate:.0f}%'}), "
                         f"{cache.get('cached_tokens', 0)} tokens reused"),
        ("thermal", f"{thermal.get('state')}" + ("" if reading is None else f", {reading:.1f}C")),
        ("driver errors", f"{errors.get('count')}" + ("" if errors.get("available") else " (kernel log unreadable)")),
    ]


def cmd_stats(args: argparse.Namespace) -> int:
    with connect(args) as c:
        s = c.stats()
    if args.json:
        emit_json(s)
        return EXIT_OK
    granted = s.get("granted")
    queue = s.get("queue") or {}
    print_fields(sys.stdout, [
        ("version", s.get("version")), ("uptime", fmt_duration(s.get("uptime_s"))),
        ("connections", s.get("connections")), ("jobs", _counts(s.get("jobs"))),
        ("tickets", _counts(s.get("tickets"))), ("tokens generated", s.get("tokens_generated")),
        ("queue", f"{queue.get('interactive', 0)} interactive, {queue.get('batch', 0)} batch"),
        ("holding the device", "nobody" if not granted else
         f"ticket {granted.get('ticket')} of job {granted.get('job')} ({granted.get('priority')})"),
        ("quarantined", s.get("quarantined")),
        *(_metrics_fields(s["metrics"]) if s.get("metrics") else ()),
    ])
    return EXIT_OK


def _break_even(stats: dict) -> str:
    """" (break-even 23%, fell back after round 3)" from a prompt's speculation stats, or ""."""
    needed, fallbacks = stats.get("break_even_acceptance"), stats.get("fallbacks") or ()
    parts = [] if needed is None else [f"break-even {100 * needed:.0f}%"]
    if fallbacks:
        parts.append(f"fell back after round {fallbacks[0].get('round')}"
                     + (f" and {len(fallbacks) - 1} more" if len(fallbacks) > 1 else ""))
    return f" ({', '.join(parts)})" if parts else ""
