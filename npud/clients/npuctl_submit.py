"""`npuctl submit` (a batch job from a JSONL file, optionally waited for) and `npuctl complete`."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Any, TextIO

from npud.clients.batchfile import InputError, JobPlan, Line, output_record, plan_jobs, read_lines
from npud.clients.openai_batch import Endpoint, openai_record
from npud.clients.client import Client, ConnectionLost, NotRunning, NpudError, ShuttingDown
from npud.clients.npuctl_common import (EXIT_OK, Failed, Interrupted, UsageError, connect, emit_json, generation_settings,
                                   is_tty, open_output)
from npud.clients.termout import Progress, ProgressBar, fmt_rate, load_stage


# -- submit ------------------------------------------------------------------------------------

def _lines_label(lines: list[Line]) -> str:
    numbers = [str(line.number) for line in lines[:5]]
    more = f" and {len(lines) - 5} more" if len(lines) > 5 else ""
    return ("line " if len(lines) == 1 else "lines ") + ", ".join(numbers) + more


# the prompt a submit error names: params.prompts[3], params.prompt_settings[3].max_tokens, ...
_PROMPT_PARAM = re.compile(r"params\.(?:prompts|chats|prompt_settings)\[(\d+)\]\.?")


def refusal(name: str, plan: JobPlan, message: str) -> str:
    """A refused submit as a file error, `NAME:LINE: message`: the line of the prompt the
    daemon's message names, else the job's first line (and how many more the job held)."""
    m = _PROMPT_PARAM.search(message)
    if m is not None and int(m.group(1)) < len(plan.lines):
        line = plan.lines[int(m.group(1))]
        return f"{name}:{line.number}: {_PROMPT_PARAM.sub('', message, count=1)}"
    others = len(plan.lines) - 1
    return f"{name}:{plan.lines[0].number}: {message}" + (
        f" (for the job of this line and {others} more)" if others else "")


def _submit_all(c: Client, plans: list[JobPlan], name: str) -> list[dict]:
    """Submit every job, or none: a refused job cancels the ones already queued."""
    statuses: list[dict] = []
    for plan in plans:
        try:
            statuses.append(c.submit(**plan.params()))
        except NpudError as exc:
            message = refusal(name, plan, exc.message)
            cancelled, ended = [], []
            for status in statuses:
                try:
                    reply = c.cancel(status["job"])
                except NpudError:
                    continue
                (cancelled if reply.get("cancelled") else ended).append(str(status["job"]))
            if cancelled:
                message += f"; the job(s) submitted before it were cancelled: {' '.join(cancelled)}"
            if ended:
                message += f"; job(s) {' '.join(ended)} had already finished"
            raise type(exc)(message, exc.code) from None
    return statuses


class PlainReporter:
    """One line per finished prompt on a stream that is not a terminal."""

    def __init__(self, out: TextIO, progress: Progress) -> None:
        self.out = out
        self.p = progress

    def prompt_done(self, line: Line | None, job: int, result: dict | None) -> None:
        where = f"line {line.number}" if line is not None else "?"
        if result is not None and "error" in result:
            what = f"error: {result['error'].get('message')}"
        else:
            what = (result or {}).get("finish_reason", "done")
        self.out.write(f"prompt {self.p.done}/{self.p.total} done ({where}, job {job}, {what}); "
                       f"{self.p.tokens_per_s():.1f} tok/s, acceptance {fmt_rate(self.p.accepted, self.p.drafted)}\n")
        self.out.flush()

    def loading(self, model: str) -> None:
        self.out.write(f"loading model {model}\n")
        self.out.flush()

    def waiting(self, message: str) -> None:
        self.out.write(message + "\n")
        self.out.flush()

    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


class BarReporter:
    def __init__(self, out: TextIO, progress: Progress) -> None:
        self.bar = ProgressBar(out, progress)

    def prompt_done(self, line: Line | None, job: int, result: dict | None) -> None:
        self.bar.update(force=True)

    def loading(self, model: str) -> None:
        self.bar.update(force=True)  # the bar's state says "loading model ..."

    def waiting(self, message: str) -> None:
        self.bar.update(force=True)  # the bar's state says npud is away

    def update(self) -> None:
        self.bar.update()

    def close(self) -> None:
        self.bar.close()


class QuietReporter:
    def prompt_done(self, line: Line | None, job: int, result: dict | None) -> None:
        pass

    def loading(self, model: str) -> None:
        pass

    def waiting(self, message: str) -> None:
        pass

    def update(self) -> None:
        pass

    def close(self) -> None:
        pass


ENDED = ("done", "failed", "cancelled")
RECONNECT_TIMEOUT_S = 300.0  # how long --wait waits for a stopped npud to come back
RECONNECT_INTERVAL_S = 0.5


class Connections:
    """--wait's two connections to npud (one streams a job, the other reads results beside it),
    made again when npud stops: a restart keeps every job in its store and runs on from the
    prompts without a result, so the wait goes on instead of calling the rest cancelled."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.stream = Client(path)
        self.aux = Client(path)

    def close(self) -> None:
        self.stream.close()
        self.aux.close()

    def reconnect(self, jobs: list[int], progress: Progress, reporter: Any) -> None:
        """Wait for npud to listen again (RECONNECT_TIMEOUT_S at most); raises NotRunning saying
        that the jobs are kept when it does not come back."""
        self.close()
        progress.state = "npud stopped: waiting for it to come back"
        reporter.waiting(f"npud stopped; job(s) {' '.join(map(str, jobs))} are kept in its store and run on when "
                         f"it starts again: waiting up to {RECONNECT_TIMEOUT_S:.0f} s (Ctrl-C stops waiting, "
                         "not the jobs)")
        deadline = time.monotonic() + RECONNECT_TIMEOUT_S
        while True:
            time.sleep(RECONNECT_INTERVAL_S)
            try:
                self.stream = Client(self.path)
                self.aux = Client(self.path)
                reporter.waiting("npud is back; following the job(s) again")
                return
            except NotRunning:
                if time.monotonic() > deadline:
                    raise NotRunning(f"npud did not come back within {RECONNECT_TIMEOUT_S:.0f} s; job(s) "
                                     f"{' '.join(map(str, jobs))} are kept in its store and run when it starts "
                                     "again (`npuctl result JOB` reads them then)") from None


def _follow(conns: Connections, plans: list[JobPlan], statuses: list[dict], progress: Progress,
            reporter: Any) -> list[dict]:
    """Stream each job to its end, feeding the progress; returns the final job statuses.

    Jobs are followed one after another; a prompt that finished while another job was being
    followed (or before the stream began) is reported when its job's turn comes. A stream that
    ends before its job did (npud stopped: its drain ends every follower) or a connection that
    drops is followed again once npud is back.
    """
    finals = []
    jobs = [s["job"] for s in statuses]
    for plan, status in zip(plans, statuses):
        job = status["job"]
        reported: set[int] = set()

        def report(results: list[dict]) -> None:
            for r in results:
                if r["prompt"] in reported:
                    continue
                reported.add(r["prompt"])
                progress.on_result(job, r)
                progress.done_by_job[job] = len(reported)
                line = plan.lines[r["prompt"]] if 0 <= r["prompt"] < len(plan.lines) else None
                reporter.prompt_done(line, job, r)

        progress.job = job
        progress.state = status["state"]
        while True:
            try:
                final = _stream_job(conns, job, progress, reporter, report)
            except (ConnectionLost, NotRunning, ShuttingDown):
                final = None
            if final is not None and final.get("state") in ENDED:
                break
            conns.reconnect(jobs, progress, reporter)
        progress.state = final.get("state", "done")
        if len(reported) < final.get("done_prompts", 0):
            report(conns.aux.result(job)["results"])
        finals.append(final)
    return finals


def _stream_job(conns: Connections, job: int, progress: Progress, reporter: Any, report) -> dict:
    """Follow one job's events until its stream ends; returns the status the stream ends with
    (an unfinished one when npud stopped)."""
    stream = conns.stream.stream(job)
    for ev in stream:
        d = ev.data
        if ev.name == "token":
            progress.on_tokens(job, d.get("prompt", 0), len(d.get("token_ids") or ()))
        elif ev.name == "ticket":
            progress.state = d.get("outcome") or ("running" if d.get("state") == "granted" else d.get("state"))
        elif ev.name == "model_loading":  # a cold start: the wait is the load, not generation
            progress.state = f"loading model {d.get('model')}"
            reporter.loading(str(d.get("model")))
        elif ev.name == "model_load_progress":
            progress.state = f"loading model {d.get('model')} ({load_stage(d)})"
        elif ev.name == "model_loaded":
            progress.load_s += float(d.get("load_ms") or 0) / 1000
            progress.state = "running"
        elif ev.name == "progress" and "prompt" in d:  # a prompt finished
            report(conns.aux.result(job, prompts=[d["prompt"]])["results"])
        elif ev.name == "progress":  # the counts when the stream began
            progress.state = d.get("state", progress.state)
            if d.get("done_prompts"):
                report(conns.aux.result(job)["results"])
        reporter.update()
    return stream.result


def cmd_submit(args: argparse.Namespace) -> int:
    if args.output is not None and not args.wait:
        raise UsageError("-o/--output needs --wait (without it, read the results later with `npuctl result JOB`)")
    if args.format != "npud" and not args.wait:
        raise UsageError("--format needs --wait (it is the shape of the results)")
    name = "<stdin>" if args.file == "-" else args.file
    defaults = generation_settings(args) | _priority(args)
    try:
        if args.file == "-":
            lines = read_lines(sys.stdin.buffer, name, defaults)
        else:
            with open(args.file, "rb") as f:
                lines = read_lines(f, name, defaults)
    except OSError as exc:
        raise UsageError(f"cannot read {name}: {exc.strerror}") from None
    except InputError as exc:
        raise UsageError(str(exc)) from None
    out = open_output(args.output) if args.wait else sys.stdout
    try:
        with connect(args) as c:
            hello = c.hello("npuctl")
            try:
                plans = plan_jobs(lines, int(hello["limits"]["max_prompts_per_job"]),
                                  hello["limits"].get("max_line_bytes"))
            except InputError as exc:
                raise UsageError(f"{name}:{str(exc).removeprefix('line ')}") from None
            statuses = _submit_all(c, plans, name)
            if not args.wait:
                _print_submitted(args, statuses, plans)
                return EXIT_OK
            return _wait(args, c, plans, statuses, len(lines), out)
    finally:
        if out is not sys.stdout:
            out.close()


def _priority(args: argparse.Namespace) -> dict:
    return {"priority": args.priority} if args.priority else {}


def _print_submitted(args: argparse.Namespace, statuses: list[dict], plans: list[JobPlan]) -> None:
    if args.json:
        emit_json({"jobs": statuses})
    elif is_tty(sys.stdout):
        for status, plan in zip(statuses, plans):
            pos = status.get("queue_position")
            where = f", queue position {pos}" if pos is not None else ""
            sys.stdout.write(f"job {status['job']}: {status['num_prompts']} prompt(s) ({_lines_label(plan.lines)}), "
                             f"{status['state']}{where}\n")
    else:
        for status in statuses:
            sys.stdout.write(f"{status['job']}\n")


def _wait(args: argparse.Namespace, c: Client, plans: list[JobPlan], statuses: list[dict], total: int,
          out: TextIO) -> int:
    progress = Progress(total)
    if args.json:
        reporter: Any = QuietReporter()
    elif is_tty(sys.stderr):
        reporter = BarReporter(sys.stderr, progress)
    else:
        reporter = PlainReporter(sys.stderr, progress)
    jobs = [s["job"] for s in statuses]
    conns = Connections(c.path)
    try:
        finals = _follow(conns, plans, statuses, progress, reporter)
        results = {job: {r["prompt"]: r for r in conns.aux.result(job)["results"]} for job in jobs}
    except KeyboardInterrupt:
        reporter.close()
        raise Interrupted(f"interrupted; the job(s) keep running: {' '.join(map(str, jobs))} "
                          f"(`npuctl result JOB` reads them later, `npuctl cancel JOB` stops them)") from None
    finally:
        conns.close()
    reporter.close()
    name = "<stdin>" if args.file == "-" else args.file
    problems = []
    records: list[tuple[int, dict]] = []  # (the line's position in the input, its record)
    for plan, final in zip(plans, finals):
        job = final["job"]
        error = final.get("error")
        if final["state"] == "failed":
            problems.append(f"job {job} failed: {(error or {}).get('message', 'no reason given')}")
        elif final["state"] == "cancelled":
            problems.append(f"job {job} was cancelled")
        missing = error or {"code": "cancelled", "message": f"job {job} was {final['state']} before this prompt ran"}
        for i, line in enumerate(plan.lines):
            result = results[job].get(i)
            if args.format == "openai":
                record = openai_record(custom_id=line.user_id, endpoint=line.endpoint or _endpoint(line), job=job,
                                       prompt=i, line=line.number, model=final.get("model"),
                                       created=int(final.get("created_at") or time.time()), result=result,
                                       missing=missing)
            else:
                record = output_record(line, job, result, None if result is not None else missing)
            records.append((line.index, record))
            if result is not None and "error" in result:
                problems.append(f"{name}:{line.number}: {result['error'].get('message')}")
    for _, record in sorted(records, key=lambda r: r[0]):  # jobs hold lines out of order: input order again
        out.write(json.dumps(record, ensure_ascii=False) + "\n")
    out.flush()
    if not args.json:
        sys.stderr.write(f"done: {progress.summary()}\n")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise Failed("; ".join(problems[:3]) + more)
    return EXIT_OK


def _endpoint(line: Line) -> Endpoint:
    """The OpenAI endpoint an npud line stands for: a chat or a plain completion."""
    return Endpoint.COMPLETIONS if line.prompt is not None else Endpoint.CHAT


# -- complete ------------------------------------------------------------------------------------

def cmd_complete(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    settings = generation_settings(args)
    if args.system is not None:
        settings["messages"] = [{"role": "system", "content": args.system}, {"role": "user", "content": text}]
    else:
        settings["prompt"] = text
    with connect(args) as c:
        stream = c.complete(**settings)
        streamed = []
        started = time.monotonic()
        try:
            for ev in stream:
                if ev.name == "model_loading" and is_tty(sys.stderr) and not args.json:
                    sys.stderr.write(f"[loading model {ev.data.get('model')}]\n")
                elif ev.name == "model_loaded":  # load time is not generation time
                    started += float(ev.data.get("load_ms") or 0) / 1000
                elif ev.name == "token" and not args.json:
                    piece = ev.data.get("text", "")
                    streamed.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            if streamed:
                sys.stdout.write("\n")
            raise Interrupted("interrupted; the completion was cancelled") from None
        result = stream.result
    elapsed = time.monotonic() - started
    if args.json:
        emit_json(result)
    else:
        text = "".join(streamed)
        if text and not text.endswith("\n"):
            sys.stdout.write("\n")
        sys.stdout.flush()
        if is_tty(sys.stderr):
            stats = result.get("stats") or {}
            n = len(result.get("token_ids") or ())
            sys.stderr.write(f"[job {result.get('job')}: {n} tokens, {result.get('finish_reason')}, "
                             f"{n / elapsed if elapsed > 0 else 0:.1f} tok/s, acceptance "
                             f"{fmt_rate(int(stats.get('accepted') or 0), int(stats.get('drafted') or 0))}]\n")
    if result.get("finish_reason") == "cancelled":
        raise Failed(f"job {result.get('job')} was cancelled")
    return EXIT_OK
