"""Counters and gauges of a running npud: the `metrics` method, `npuctl stats`, and the
Prometheus text file for node_exporter's textfile collector.

Counters count from the daemon's start (Prometheus's rate() copes with restarts); the
store's history (`stats`: jobs and tickets by state, over `store.retention_days`) is the
longer view. Gauges are read from the daemon's parts when a snapshot is taken.
"""

from __future__ import annotations

import collections
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import trio

from npud import __version__
from npud.config import MetricsConfig
from npud.tickets import Outcome, Priority, Ticket, TicketQueue, TicketState

if TYPE_CHECKING:
    from npud.guards import ErrorCountGuard, ThermalGuard

log = structlog.get_logger(__name__)

QUANTILES = (0.5, 0.9, 0.99)
WAIT_SAMPLES = 1024  # the most recent waits of each class that the quantiles are taken over
SAMPLE_INTERVAL_S = 1.0  # how often the token counter is sampled for tokens per second
THERMAL_STATES = ("ok", "hold", "abort", "no_sensor", "disabled")


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile of ascending values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


class Metrics:
    """The counters, fed by the ticket queue (grants, releases) and the device owner (prompts)."""

    def __init__(self, cfg: MetricsConfig, queue: TicketQueue, tokens: Callable[[], int], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.tokens = tokens  # tokens generated since start
        self.clock = clock
        self.started = clock()
        self.granted = 0
        self.released = {o: 0 for o in Outcome}
        self.waits = {p: collections.deque(maxlen=WAIT_SAMPLES) for p in Priority}
        self.wait_sum_s = {p: 0.0 for p in Priority}
        self.wait_count = {p: 0 for p in Priority}
        self.busy_s = 0.0
        self.drafted = 0
        self.accepted = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.cached_tokens = 0
        # the same three per owner: whether a prompt hit tells of the cache's other entries,
        # so a user is shown the counts of their own prompts only (see counters)
        self.cache_by_owner: dict[int, list[int]] = {}  # uid -> [hits, misses, cached_tokens]
        self._samples: collections.deque[tuple[float, int]] = collections.deque([(self.started, tokens())])
        self._textfile_error: str | None = None
        queue.observers.append(self.on_ticket)

    # -- what feeds the counters -----------------------------------------------------------------

    def on_ticket(self, ticket: Ticket) -> None:
        """A queue observer: count grants (with their wait) and releases (with their work)."""
        if ticket.state is TicketState.GRANTED:
            self.granted += 1
            wait = max(0.0, ticket.granted_at - ticket.queued_at)
            self.waits[ticket.priority].append(wait)
            self.wait_sum_s[ticket.priority] += wait
            self.wait_count[ticket.priority] += 1
        elif ticket.state is TicketState.RELEASED:
            self.released[ticket.outcome] += 1
            if ticket.outcome is Outcome.JOINED:  # its wait ended when its job joined a running batch
                wait = max(0.0, ticket.released_at - ticket.queued_at)
                self.waits[ticket.priority].append(wait)
                self.wait_sum_s[ticket.priority] += wait
                self.wait_count[ticket.priority] += 1
            if ticket.granted_at is not None:  # a ticket cancelled while queued never held the device
                self.busy_s += max(0.0, ticket.released_at - ticket.granted_at)

    def on_prompt(self, stats: dict, owner_uid: int | None = None) -> None:
        """A prompt (of a job of `owner_uid`) finished with these engine stats."""
        self.drafted += int(stats.get("drafted") or 0)
        self.accepted += int(stats.get("accepted") or 0)
        cached = stats.get("num_cached_tokens")
        if cached is None:  # the prompt did not use the prefix cache
            return
        mine = self.cache_by_owner.setdefault(owner_uid, [0, 0, 0]) if owner_uid is not None else [0, 0, 0]
        if cached:
            self.cache_hits += 1
            self.cached_tokens += int(cached)
            mine[0] += 1
            mine[2] += int(cached)
        else:
            self.cache_misses += 1
            mine[1] += 1

    def sample(self) -> None:
        """Record the token counter now; samples older than the rate window are dropped."""
        now = self.clock()
        self._samples.append((now, self.tokens()))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.cfg.rate_window_s:
            self._samples.popleft()

    def tokens_per_second(self) -> float:
        """Tokens generated per second over the last rate_window_s (since start, if shorter)."""
        t0, n0 = self._samples[0]
        elapsed = self.clock() - t0
        return (self.tokens() - n0) / elapsed if elapsed > 0 else 0.0

    # -- reading them ----------------------------------------------------------------------------

    def cache_counters(self, owner_uid: int | None = None) -> dict:
        """The prefix-cache counters of every prompt, or of `owner_uid`'s prompts only."""
        if owner_uid is None:
            hits, misses, cached = self.cache_hits, self.cache_misses, self.cached_tokens
        else:
            hits, misses, cached = self.cache_by_owner.get(owner_uid, (0, 0, 0))
        return {"hits": hits, "misses": misses, "hit_rate": _ratio(hits, hits + misses), "cached_tokens": cached}

    def counters(self, owner_uid: int | None = None) -> dict:
        """Every counter; the prefix cache's of `owner_uid`'s prompts only, when given."""
        waits = {}
        for p in Priority:
            ordered = sorted(self.waits[p])
            waits[p.label] = {"count": self.wait_count[p], "sum": round(self.wait_sum_s[p], 6),
                              **{f"p{round(q * 100)}": quantile(ordered, q) for q in QUANTILES}}
        return {
            "uptime_s": round(self.clock() - self.started, 3),
            "tickets": {"granted": self.granted, "released": {o.value: n for o, n in self.released.items()}},
            "wait_s": waits,
            "tokens": {"generated": self.tokens(), "per_second": round(self.tokens_per_second(), 3),
                       "window_s": self.cfg.rate_window_s, "device_busy_s": round(self.busy_s, 3)},
            "speculative": {"drafted": self.drafted, "accepted": self.accepted,
                            "acceptance": _ratio(self.accepted, self.drafted)},
            "prefix_cache": self.cache_counters(owner_uid),
        }

    # -- the Prometheus text file ----------------------------------------------------------------

    def reconfigure(self, cfg: MetricsConfig) -> None:
        if cfg.textfile_path != self.cfg.textfile_path:
            self.remove_textfile()  # stale numbers under the old name would be exported for ever
        self.cfg = cfg

    def remove_textfile(self) -> None:
        if self.cfg.textfile_path:
            try:
                os.unlink(self.cfg.textfile_path)
            except OSError:
                pass

    async def run(self, describe: Callable[[], dict], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Sample the token counter every second and write the text file every textfile_interval_s."""
        task_status.started()
        next_write = self.clock()
        while True:
            self.sample()
            if self.cfg.textfile_path and self.clock() >= next_write:
                await self._write_textfile(render_prometheus(describe()))
                next_write = self.clock() + self.cfg.textfile_interval_s
            wait = SAMPLE_INTERVAL_S
            if self.cfg.textfile_path:
                wait = min(wait, max(0.0, next_write - self.clock()))
            await trio.sleep(wait)

    async def _write_textfile(self, text: str) -> None:
        path = self.cfg.textfile_path
        try:
            await trio.to_thread.run_sync(write_atomically, path, text)
        except OSError as exc:
            error = f"{exc.strerror or type(exc).__name__}: {exc.filename or path}"
            if error != self._textfile_error:  # once per new problem, not every interval
                log.error("metrics_textfile_failed", path=path, error=error)
            self._textfile_error = error
            return
        if self._textfile_error is not None:
            log.info("metrics_textfile_written", path=path)
        self._textfile_error = None


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text` so that a reader sees the old file or the new one, never a
    part: written to a temporary file in the same directory (named so the textfile collector,
    which reads *.prom, skips it) and renamed over. Raises OSError."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; node_exporter runs as another user
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def snapshot(metrics: Metrics, queue: TicketQueue, *, device_kind: str, jobs: dict[str, int], connections: int,
             thermal: "ThermalGuard", errors: "ErrorCountGuard", gemms: str, owner_uid: int | None = None) -> dict:
    """The counters with the gauges of the running daemon (`jobs`: unfinished jobs by state;
    `gemms`: "npu" or "host", where the loaded models' GEMMs run), as the `metrics` method
    returns them; the prefix cache's counters are `owner_uid`'s own when given (a non-admin's
    view), every user's otherwise."""
    quarantine = queue.quarantine
    granted = queue.granted
    return {
        "version": __version__,
        "device": device_kind,
        **metrics.counters(owner_uid),
        "connections": connections,
        "jobs": jobs,
        "queue": queue.counts(),
        "holding": None if granted is None else {"ticket": granted.id, "job": granted.job_id,
                                                 "priority": granted.priority.label},
        "gemms": gemms,
        "thermal": {"state": thermal.state, "reading_c": thermal.reading_c, "npu_power_w": thermal.npu_power_w},
        "driver_errors": {"count": errors.count, "available": errors.available, "pre_hang": errors.pre_hang_count},
        "quarantine": {"quarantined": quarantine is not None,
                       "since": None if quarantine is None else quarantine.since,
                       "reason": None if quarantine is None else quarantine.reason},
    }


# -- Prometheus text exposition format (version 0.0.4) ------------------------------------------------

def _value(v: float | int | bool | None) -> str:
    if v is None:
        return "NaN"
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, float):
        if math.isnan(v):
            return "NaN"
        if math.isinf(v):
            return "+Inf" if v > 0 else "-Inf"
        return repr(v)
    return str(v)


def _escape(label_value: str) -> str:
    return label_value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, Any]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items()) + "}"


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str,
               samples: list[tuple[dict[str, Any], Any]] | Any) -> None:
        """One metric family; `samples` is a value or a list of (labels, value)."""
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        if not isinstance(samples, list):
            samples = [({}, samples)]
        for labels, value in samples:
            self.lines.append(f"{name}{_labels(labels)} {_value(value)}")


def render_prometheus(s: dict) -> str:
    """A snapshot in the Prometheus text format, one family per counter or gauge."""
    t = _Text()
    t.family("npud_info", "gauge", "The npud version and the compute device it drives.",
             [({"version": s["version"], "device": s["device"]}, 1)])
    t.family("npud_uptime_seconds", "gauge", "Seconds since npud started.", s["uptime_s"])
    t.family("npud_connections", "gauge", "Open client connections.", s["connections"])
    t.family("npud_jobs_active", "gauge", "Unfinished jobs by state.",
             [({"state": k}, v) for k, v in s["jobs"].items()])
    t.family("npud_queue_depth", "gauge", "Queued tickets by priority class.",
             [({"class": k}, v) for k, v in s["queue"].items()])
    t.family("npud_device_held", "gauge", "1 while a ticket holds the device.", s["holding"] is not None)
    t.family("npud_tickets_granted_total", "counter", "Tickets granted since start.", s["tickets"]["granted"])
    t.family("npud_tickets_released_total", "counter", "Tickets released since start, by outcome.",
             [({"outcome": k}, v) for k, v in s["tickets"]["released"].items()])
    wait_lines = []
    for cls, w in s["wait_s"].items():
        wait_lines += [({"class": cls, "quantile": str(q)}, w[f"p{round(q * 100)}"]) for q in QUANTILES]
    t.family("npud_ticket_wait_seconds", "summary",
             f"Time from queued to granted; quantiles over the last {WAIT_SAMPLES} grants of the class.", wait_lines)
    for cls, w in s["wait_s"].items():
        t.lines.append(f"npud_ticket_wait_seconds_sum{_labels({'class': cls})} {_value(float(w['sum']))}")
        t.lines.append(f"npud_ticket_wait_seconds_count{_labels({'class': cls})} {_value(w['count'])}")
    tok = s["tokens"]
    t.family("npud_tokens_generated_total", "counter", "Tokens generated since start.", tok["generated"])
    t.family("npud_tokens_per_second", "gauge", f"Tokens generated per second over the last {tok['window_s']} s.",
             float(tok["per_second"]))
    t.family("npud_device_busy_seconds_total", "counter", "Seconds tickets held the device.",
             float(tok["device_busy_s"]))
    spec = s["speculative"]
    t.family("npud_spec_drafted_tokens_total", "counter", "Draft tokens proposed by speculative decoding.",
             spec["drafted"])
    t.family("npud_spec_accepted_tokens_total", "counter", "Draft tokens accepted by the target model.",
             spec["accepted"])
    t.family("npud_spec_acceptance_ratio", "gauge", "Accepted over drafted tokens since start (NaN before any).",
             spec["acceptance"])
    cache = s["prefix_cache"]
    t.family("npud_prefix_cache_lookups_total", "counter", "Finished prompts by prefix-cache result.",
             [({"result": "hit"}, cache["hits"]), ({"result": "miss"}, cache["misses"])])
    t.family("npud_prefix_cache_cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache.",
             cache["cached_tokens"])
    t.family("npud_prefix_cache_hit_ratio", "gauge", "Hits over lookups since start (NaN before any).",
             cache["hit_rate"])
    thermal = s["thermal"]
    t.family("npud_thermal_celsius", "gauge", "The hottest configured sensor (NaN without a reading).",
             thermal["reading_c"])
    states = list(THERMAL_STATES) + [thermal["state"]] * (thermal["state"] not in THERMAL_STATES)
    t.family("npud_thermal_state", "gauge", "1 for the thermal guard's current state.",
             [({"state": st}, st == thermal["state"]) for st in states])
    t.family("npud_npu_power_watts", "gauge", "The NPU's power (hwmon amdxdna NPU_power; NaN without the sensor).",
             thermal["npu_power_w"])
    t.family("npud_gemms_on_npu", "gauge", "1 while the loaded models' GEMMs run on the NPU, 0 on the host.",
             s["gemms"] == "npu")
    errors = s["driver_errors"]
    t.family("npud_driver_errors_total", "counter", "amdxdna error lines in the kernel log since start.",
             errors["count"])
    t.family("npud_driver_prehang_warnings_total", "counter",
             "amdxdna warnings that come before a hang or a firmware reset, since start.", errors["pre_hang"])
    t.family("npud_driver_errors_available", "gauge", "1 if the kernel log could be read.", errors["available"])
    t.family("npud_device_quarantined", "gauge", "1 while the device is quarantined after a driver error.",
             s["quarantine"]["quarantined"])
    return "\n".join(t.lines) + "\n"
