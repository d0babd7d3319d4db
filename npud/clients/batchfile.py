"""The input of `npuctl submit`: a JSONL file of prompts with per-line settings, grouped into jobs.

A line is npud's own shape (`{"prompt"| "messages", "max_tokens", ...}`) or an OpenAI Batch
request (npud/clients/openai_batch.py). A job has one model and one priority, and holds each
prompt's own generation settings (`prompt_settings`, docs/protocol.md), so lines go to
different jobs only when their model, priority or kind (prompts or chats) differ, or a job
is full; the results are put back in input order. Only the shape of a line is checked here,
with its line number; values are the daemon's to judge.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from npud.clients.openai_batch import Endpoint, from_openai_line, is_openai_line

JOB_SETTINGS = ("model", "priority")  # one per job
PROMPT_SETTINGS = ("max_tokens", "sampling", "stop", "spec", "use_prefix_cache", "logprobs", "response_format",
                   "grammar")  # one per prompt
SETTINGS = ("model", *PROMPT_SETTINGS[:5], "priority", *PROMPT_SETTINGS[5:])
LINE_KEYS = ("prompt", "messages", "id", *SETTINGS)
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")
SPEC_KEYS = ("method", "k", "fallback_rounds")


class InputError(ValueError):
    """A line of the input file that is not a prompt; the message names the file and line."""


@dataclass(slots=True, frozen=True)
class Line:
    number: int  # 1-based line in the file
    index: int  # 0-based position among the prompts (blank lines do not count)
    prompt: str | None
    messages: list[dict] | None
    job_settings: dict  # the job params this line needs: the CLI's settings, its own model and priority
    own: dict  # the line's own PROMPT_SETTINGS, sent as its prompt_settings entry
    user_id: Any = None  # the line's optional "id" (an OpenAI line's custom_id), echoed in its result
    endpoint: Endpoint | None = None  # an OpenAI Batch line's url

    @property
    def settings(self) -> dict:
        """What this prompt runs with: the line's settings over the command line's."""
        return merge_settings(self.job_settings, self.own)


@dataclass(slots=True)
class JobPlan:
    """One `submit`: lines with the same job settings and the same kind (prompts or chats)."""

    settings: dict
    lines: list[Line] = field(default_factory=list)

    @property
    def kind(self) -> str:
        return "prompts" if self.lines[0].prompt is not None else "chats"

    def params(self) -> dict:
        """The params of the `submit` request for this job."""
        if self.kind == "prompts":
            body: dict = {"prompts": [line.prompt for line in self.lines]}
        else:
            body = {"chats": [line.messages for line in self.lines]}
        if any(line.own for line in self.lines):
            body["prompt_settings"] = [line.own or None for line in self.lines]
        return {**self.settings, **body}


def _type(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "an integer",
            float: "a number"}.get(type(value), "null" if value is None else type(value).__name__)


def _check_object(where: str, value: Any, keys: tuple[str, ...]) -> dict:
    if not isinstance(value, dict):
        raise InputError(f"{where}: expected an object, got {_type(value)}")
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(keys)})")
    return value


def _check_line(where: str, obj: Any) -> dict:
    if isinstance(obj, str):
        return {"prompt": obj}
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected an object with \"prompt\" or \"messages\" (or a JSON string), "
                         f"got {_type(obj)}")
    unknown = sorted(set(obj) - set(LINE_KEYS))
    if unknown:
        raise InputError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(LINE_KEYS)})")
    if ("prompt" in obj) == ("messages" in obj):
        raise InputError(f"{where}: give exactly one of \"prompt\" and \"messages\"")
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        raise InputError(f"{where}: \"prompt\" must be a string, got {_type(obj['prompt'])}")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise InputError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}}")
        for i, m in enumerate(messages):
            if not (isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["role"], str)
                    and isinstance(m["content"], str)):
                raise InputError(f"{where}: messages[{i}] must be {{\"role\": string, \"content\": string}}")
    if "model" in obj and not isinstance(obj["model"], str):
        raise InputError(f"{where}: \"model\" must be a string, got {_type(obj['model'])}")
    if "max_tokens" in obj and (isinstance(obj["max_tokens"], bool) or not isinstance(obj["max_tokens"], int)):
        raise InputError(f"{where}: \"max_tokens\" must be an integer, got {_type(obj['max_tokens'])}")
    if "stop" in obj and not (isinstance(obj["stop"], list) and all(isinstance(s, str) for s in obj["stop"])):
        raise InputError(f"{where}: \"stop\" must be a list of strings")
    if "use_prefix_cache" in obj and not isinstance(obj["use_prefix_cache"], bool):
        raise InputError(f"{where}: \"use_prefix_cache\" must be true or false")
    if "priority" in obj and obj["priority"] not in ("batch", "interactive"):
        raise InputError(f"{where}: \"priority\" must be \"batch\" or \"interactive\"")
    for key in ("response_format", "grammar"):  # structured output: their contents are the daemon's to judge
        if key in obj and not isinstance(obj[key], dict):
            raise InputError(f"{where}: \"{key}\" must be an object, got {_type(obj[key])}")
    if "logprobs" in obj and (isinstance(obj["logprobs"], bool) or not isinstance(obj["logprobs"], int)):
        raise InputError(f"{where}: \"logprobs\" must be an integer, got {_type(obj['logprobs'])}")
    if "sampling" in obj:
        _check_object(f"{where}: \"sampling\"", obj["sampling"], SAMPLING_KEYS)
    if "spec" in obj:
        _check_object(f"{where}: \"spec\"", obj["spec"], SPEC_KEYS)
    return obj


def merge_settings(defaults: dict, line: dict) -> dict:
    """The line's settings over the command line's; `sampling` and `spec` merge key by key."""
    out = {k: v for k, v in defaults.items() if v is not None}
    for key in SETTINGS:
        if key not in line:
            continue
        if key in ("sampling", "spec"):
            out[key] = {**out.get(key, {}), **line[key]}
        else:
            out[key] = line[key]
    return out


def read_lines(raw_lines: Iterable[bytes | str], name: str, defaults: dict) -> list[Line]:
    """Parse the input (lines of a file opened in binary mode, or strings); raises
    InputError("NAME:LINE: ...") for the first bad line, or for no prompts at all."""
    lines: list[Line] = []
    custom_ids: dict[str, int] = {}
    for number, raw in enumerate(raw_lines, start=1):
        where = f"{name}:{number}"
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InputError(f"{where}: not UTF-8 (byte {exc.start + 1} of the line)") from None
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise InputError(f"{where}: not valid JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:
            raise InputError(f"{where}: nested too deeply") from None
        except ValueError:  # Python's bound on integer digits (4,300)
            raise InputError(f"{where}: a number has too many digits") from None
        try:  # an escape like \ud800 without its pair is no character: it cannot be sent or written
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise InputError(f"{where}: a string holds a lone UTF-16 surrogate (an escape like \\ud800 "
                             "without its pair), which is not text") from None
        endpoint = user_id = None
        if is_openai_line(obj):
            try:
                user_id, endpoint, obj = from_openai_line(obj)
            except ValueError as exc:
                raise InputError(f"{where}: {exc}") from None
            if user_id in custom_ids:
                raise InputError(f"{where}: custom_id {user_id!r} is on line {custom_ids[user_id]} too "
                                 "(each request needs its own)")
            custom_ids[user_id] = number
        obj = _check_line(where, obj)
        job = {k: v for k, v in defaults.items() if v is not None}
        job.update({k: obj[k] for k in JOB_SETTINGS if k in obj})
        lines.append(Line(number, len(lines), obj.get("prompt"), obj.get("messages"), job,
                          {k: obj[k] for k in PROMPT_SETTINGS if k in obj},
                          obj.get("id") if endpoint is None else user_id, endpoint))
    if not lines:
        raise InputError(f"{name}: no prompts (one JSON object per line: "
                         "{\"prompt\": \"...\"} or {\"messages\": [...]})")
    return lines


ENVELOPE_BYTES = 4096  # a request's id, method, job settings and JSON punctuation, generously


def line_bytes(line: Line) -> int:
    """About how many bytes the line adds to a submit request (its prompt or chat, its settings)."""
    return len(json.dumps([line.prompt if line.prompt is not None else line.messages, line.own]).encode()) + 8


def plan_jobs(lines: list[Line], max_prompts_per_job: int, max_line_bytes: int | None = None) -> list[JobPlan]:
    """Group lines into jobs by job settings (model, priority) and kind, in order of first
    appearance, at most `max_prompts_per_job` prompts each (and, given the daemon's
    `max_line_bytes`, requests that fit in it); their other settings go with each prompt.
    Raises InputError naming a line too large for any request."""
    budget = None if max_line_bytes is None else max_line_bytes - ENVELOPE_BYTES
    groups: dict[str, list[JobPlan]] = {}
    sizes: dict[int, int] = {}
    order: list[JobPlan] = []
    for line in lines:
        size = line_bytes(line)
        if budget is not None and size > budget:
            raise InputError(f"line {line.number}: about {size} bytes of JSON, more than a request may carry "
                             f"(the daemon's limits.max_line_bytes = {max_line_bytes})")
        key = json.dumps([line.prompt is not None, line.job_settings], sort_keys=True)
        plans = groups.setdefault(key, [])
        if not plans or len(plans[-1].lines) >= max_prompts_per_job or (
                budget is not None and sizes[id(plans[-1])] + size > budget):
            plans.append(JobPlan(line.job_settings))
            sizes[id(plans[-1])] = 0
            order.append(plans[-1])
        plans[-1].lines.append(line)
        sizes[id(plans[-1])] += size
    return order


def output_record(line: Line, job: int, result: dict | None, missing: dict | None = None) -> dict:
    """The output line for an input line: its position, line number, id and job, then the
    daemon's prompt result (its `prompt`, the index inside the job, becomes `prompt_in_job`),
    or `missing` as the error when the job ended without a result for it."""
    record: dict = {"index": line.index, "line": line.number}
    if line.user_id is not None:
        record["id"] = line.user_id
    record["job"] = job
    if result is None:
        record["error"] = missing or {"code": "missing", "message": "the job has no result for this prompt"}
        return record
    body = dict(result)
    record["prompt_in_job"] = body.pop("prompt", None)
    record.update(body)
    return record
