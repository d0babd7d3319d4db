"""Counters and gauges of a running npud: the `metrics` method, `npuctl stats`, HTTP
`/metrics`, and the Prometheus text file for node_exporter's textfile collector.

The text format is written by prometheus_client (metric families built from a snapshot and
rendered by its `generate_latest`), so the exposition's escaping and layout are the
reference implementation's. Latencies are histograms (fixed buckets, cumulative since
start, so rate() and histogram_quantile() work across scrapes) beside the recent-window
quantiles that `stats` shows.

Counters count from the daemon's start (Prometheus's rate() copes with restarts); the
store's history (`stats`: jobs and tickets by state, over `store.retention_days`) is the
longer view. Gauges are read from the daemon's parts when a snapshot is taken.
"""

from __future__ import annotations

import bisect
import collections
import math
import os
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import structlog
import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    SummaryMetricFamily)
from prometheus_client.samples import Sample

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
# upper bounds (seconds) of the latency histograms' buckets; +Inf is implied
WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
FIRST_TOKEN_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    """Observations counted into fixed buckets (each bucket counts the values <= its bound)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def to_wire(self) -> dict:
        """{"count", "sum", "buckets": [[upper bound or "+Inf", cumulative count], ...]}."""
        cumulative, out = 0, []
        for bound, n in zip((*self.bounds, "+Inf"), self.counts):
            cumulative += n
            out.append([bound, cumulative])
        return {"count": self.count, "sum": round(self.sum, 6), "buckets": out}


def quantile(sorted_values: list[float], q: float) -> float | None:
    """The nearest-rank q-quantile of ascending values (None for none)."""
    if not sorted_values:
        return None
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


class Account:
    """One set of counters: every user's work (the daemon's), or one owner's jobs' only."""

    def __init__(self) -> None:
        self.granted = 0
        self.released = {o: 0 for o in Outcome}
        self.waits = {p: collections.deque(maxlen=WAIT_SAMPLES) for p in Priority}
        self.wait_sum_s = {p: 0.0 for p in Priority}
        self.wait_count = {p: 0 for p in Priority}
        self.wait_hist = {p: Histogram(WAIT_BUCKETS) for p in Priority}
        self.first_token = Histogram(FIRST_TOKEN_BUCKETS)
        self.busy_s = 0.0
        self.drafted = 0
        self.accepted = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.cached_tokens = 0

    def on_ticket(self, ticket: Ticket) -> None:
        if ticket.state is TicketState.GRANTED:
            self.granted += 1
            wait = max(0.0, ticket.granted_at - ticket.queued_at)
            self.waits[ticket.priority].append(wait)
            self.wait_sum_s[ticket.priority] += wait
            self.wait_count[ticket.priority] += 1
            self.wait_hist[ticket.priority].observe(wait)
        elif ticket.state is TicketState.RELEASED:
            self.released[ticket.outcome] += 1
            if ticket.outcome is Outcome.JOINED:  # its wait ended when its job joined a running batch
                wait = max(0.0, ticket.released_at - ticket.queued_at)
                self.waits[ticket.priority].append(wait)
                self.wait_sum_s[ticket.priority] += wait
                self.wait_count[ticket.priority] += 1
            if ticket.granted_at is not None:  # a ticket cancelled while queued never held the device
                self.busy_s += max(0.0, ticket.released_at - ticket.granted_at)

    def on_prompt(self, stats: dict) -> None:
        self.drafted += int(stats.get("drafted") or 0)
        self.accepted += int(stats.get("accepted") or 0)
        first = stats.get("time_to_first_token_s")
        if first is not None:
            self.first_token.observe(float(first))
        cached = stats.get("num_cached_tokens")
        if cached is None:  # the prompt did not use the prefix cache
            return
        if cached:
            self.cache_hits += 1
            self.cached_tokens += int(cached)
        else:
            self.cache_misses += 1


class Metrics:
    """The counters, fed by the ticket queue (grants, releases) and the device owner (prompts):
    every user's (`all`) and, beside them, each owner's own (`owners`: what a user who is not an
    admin is shown, so that no counter tells of another user's work)."""

    def __init__(self, cfg: MetricsConfig, queue: TicketQueue, tokens: Callable[[], int], *,
                 owner_tokens: Callable[[], dict[int, int]] = dict,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.tokens = tokens  # tokens generated since start
        self.owner_tokens = owner_tokens  # the same per owner uid
        self.clock = clock
        self.started = clock()
        self.all = Account()
        self.owners: dict[int, Account] = {}  # one per uid that had work, for the daemon's life
        self._samples: collections.deque[tuple[float, int, dict[int, int]]] = collections.deque(
            [(self.started, tokens(), dict(owner_tokens()))])
        self._textfile_error: str | None = None
        queue.observers.append(self.on_ticket)

    def account(self, owner_uid: int) -> Account:
        return self.owners.setdefault(owner_uid, Account())

    # -- what feeds the counters -----------------------------------------------------------------

    def on_ticket(self, ticket: Ticket) -> None:
        """A queue observer: count grants (with their wait) and releases (with their work), as
        every user's and as the ticket's owner's."""
        self.all.on_ticket(ticket)
        self.account(ticket.owner_uid).on_ticket(ticket)

    def on_prompt(self, stats: dict, owner_uid: int | None = None) -> None:
        """A prompt (of a job of `owner_uid`) finished with these engine stats."""
        self.all.on_prompt(stats)
        if owner_uid is not None:
            self.account(owner_uid).on_prompt(stats)

    def sample(self) -> None:
        """Record the token counters now; samples older than the rate window are dropped."""
        now = self.clock()
        self._samples.append((now, self.tokens(), dict(self.owner_tokens())))
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.cfg.rate_window_s:
            self._samples.popleft()

    def tokens_per_second(self, owner_uid: int | None = None) -> float:
        """Tokens generated per second over the last rate_window_s (since start, if shorter):
        every user's, or `owner_uid`'s jobs' only."""
        t0, n0, by_owner = self._samples[0]
        elapsed = self.clock() - t0
        if owner_uid is None:
            now = self.tokens()
        else:
            now, n0 = self.owner_tokens().get(owner_uid, 0), by_owner.get(owner_uid, 0)
        return (now - n0) / elapsed if elapsed > 0 else 0.0

    # -- reading them ----------------------------------------------------------------------------

    def cache_counters(self, owner_uid: int | None = None) -> dict:
        """The prefix-cache counters of every prompt, or of `owner_uid`'s prompts only."""
        a = self.all if owner_uid is None else self.owners.get(owner_uid) or Account()
        hits, misses = a.cache_hits, a.cache_misses
        return {"hits": hits, "misses": misses, "hit_rate": _ratio(hits, hits + misses),
                "cached_tokens": a.cached_tokens}

    def counters(self, owner_uid: int | None = None) -> dict:
        """Every counter: of every user's work, or of `owner_uid`'s jobs only when given (the
        tickets of their jobs, their prompts, the tokens generated for them)."""
        a = self.all if owner_uid is None else self.owners.get(owner_uid) or Account()
        waits = {}
        for p in Priority:
            ordered = sorted(a.waits[p])
            waits[p.label] = {"count": a.wait_count[p], "sum": round(a.wait_sum_s[p], 6),
                              **{f"p{round(q * 100)}": quantile(ordered, q) for q in QUANTILES},
                              "buckets": a.wait_hist[p].to_wire()["buckets"]}
        generated = self.tokens() if owner_uid is None else self.owner_tokens().get(owner_uid, 0)
        return {
            "uptime_s": round(self.clock() - self.started, 3),
            "tickets": {"granted": a.granted, "released": {o.value: n for o, n in a.released.items()}},
            "wait_s": waits,
            "tokens": {"generated": generated, "per_second": round(self.tokens_per_second(owner_uid), 3),
                       "window_s": self.cfg.rate_window_s, "device_busy_s": round(a.busy_s, 3)},
            "speculative": {"drafted": a.drafted, "accepted": a.accepted,
                            "acceptance": _ratio(a.accepted, a.drafted)},
            "prefix_cache": self.cache_counters(owner_uid),
            "first_token_s": a.first_token.to_wire(),
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
    returns them. With `owner_uid` (a non-admin's view) the counters are that user's jobs' own
    and the caller passes their own `jobs` and `connections`; the queue counts their tickets.
    Every user's otherwise."""
    quarantine = queue.quarantine
    granted = queue.granted
    return {
        "version": __version__,
        "device": device_kind,
        **metrics.counters(owner_uid),
        "connections": connections,
        "jobs": jobs,
        "queue": queue.counts(owner_uid),
        "holding": None if granted is None else {"ticket": granted.id, "job": granted.job_id,
                                                 "priority": granted.priority.label},
        "gemms": gemms,
        "thermal": {"state": thermal.state, "reading_c": thermal.reading_c, "npu_power_w": thermal.npu_power_w},
        "driver_errors": {"count": errors.count, "available": errors.available, "pre_hang": errors.pre_hang_count,
                          "foreign": errors.foreign_count},
        "quarantine": {"quarantined": quarantine is not None,
                       "since": None if quarantine is None else quarantine.since,
                       "reason": None if quarantine is None else quarantine.reason},
    }


# -- Prometheus text exposition format, written by prometheus_client -----------------------------------


def _num(v: float | int | bool | None) -> float:
    """A snapshot value as a sample value: None (no reading) is NaN, a bool 1 or 0."""
    return math.nan if v is None else float(v)


def _gauge(name: str, help_text: str, value: object = None, *, labels: tuple[str, ...] = (),
           samples: list[tuple[list[str], object]] = ()) -> GaugeMetricFamily:
    fam = GaugeMetricFamily(name, help_text, labels=labels or None)
    if not labels:
        fam.add_metric([], _num(value))
    for values, v in samples:
        fam.add_metric(values, _num(v))
    return fam


def _counter(name: str, help_text: str, value: object = None, *, labels: tuple[str, ...] = (),
             samples: list[tuple[list[str], object]] = ()) -> CounterMetricFamily:
    fam = CounterMetricFamily(name, help_text, labels=labels or None)  # the _total suffix is its own
    if not labels:
        fam.add_metric([], _num(value))
    for values, v in samples:
        fam.add_metric(values, _num(v))
    return fam


def _buckets(wire: list) -> list[tuple[str, float]]:
    return [(b if isinstance(b, str) else repr(float(b)), float(n)) for b, n in wire]


def families(s: dict) -> list:
    """A snapshot as prometheus_client metric families, one per counter, gauge or histogram."""
    out = [
        _gauge("npud_info", "The npud version and the compute device it drives.", labels=("version", "device"),
               samples=[([s["version"], s["device"]], 1)]),
        _gauge("npud_uptime_seconds", "Seconds since npud started.", s["uptime_s"]),
        _gauge("npud_connections", "Open client connections.", s["connections"]),
        _gauge("npud_jobs_active", "Unfinished jobs by state.", labels=("state",),
               samples=[([k], v) for k, v in s["jobs"].items()]),
        _gauge("npud_queue_depth", "Queued tickets by priority class.", labels=("class",),
               samples=[([k], v) for k, v in s["queue"].items()]),
        _gauge("npud_device_held", "1 while a ticket holds the device.", s["holding"] is not None),
        _counter("npud_tickets_granted_total", "Tickets granted since start.", s["tickets"]["granted"]),
        _counter("npud_tickets_released_total", "Tickets released since start, by outcome.", labels=("outcome",),
                 samples=[([k], v) for k, v in s["tickets"]["released"].items()]),
    ]
    wait = HistogramMetricFamily("npud_ticket_wait_seconds", "Time from queued to granted, since start.",
                                 labels=("class",))
    recent = SummaryMetricFamily("npud_ticket_wait_recent_seconds",
                                 f"Time from queued to granted; quantiles over the last {WAIT_SAMPLES} grants "
                                 "of the class (count and sum since start).", labels=("class",))
    for cls, w in s["wait_s"].items():
        if "buckets" in w:
            wait.add_metric([cls], _buckets(w["buckets"]), float(w["sum"]))
        recent.add_metric([cls], count_value=w["count"], sum_value=float(w["sum"]))
        for q in QUANTILES:
            recent.samples.append(Sample("npud_ticket_wait_recent_seconds", {"class": cls, "quantile": str(q)},
                                         _num(w[f"p{round(q * 100)}"])))
    out += [wait, recent]
    if "first_token_s" in s:
        first = s["first_token_s"]
        ttft = HistogramMetricFamily("npud_first_token_seconds",
                                     "From a prompt's start on the device to its first token (prefill included).")
        ttft.add_metric([], _buckets(first["buckets"]), float(first["sum"]))
        out.append(ttft)
    tok, spec, cache = s["tokens"], s["speculative"], s["prefix_cache"]
    thermal, errors = s["thermal"], s["driver_errors"]
    states = list(THERMAL_STATES) + [thermal["state"]] * (thermal["state"] not in THERMAL_STATES)
    out += [
        _counter("npud_tokens_generated_total", "Tokens generated since start.", tok["generated"]),
        _gauge("npud_tokens_per_second", f"Tokens generated per second over the last {tok['window_s']} s.",
               tok["per_second"]),
        _counter("npud_device_busy_seconds_total", "Seconds tickets held the device.", tok["device_busy_s"]),
        _counter("npud_spec_drafted_tokens_total", "Draft tokens proposed by speculative decoding.", spec["drafted"]),
        _counter("npud_spec_accepted_tokens_total", "Draft tokens accepted by the target model.", spec["accepted"]),
        _gauge("npud_spec_acceptance_ratio", "Accepted over drafted tokens since start (NaN before any).",
               spec["acceptance"]),
        _counter("npud_prefix_cache_lookups_total", "Finished prompts by prefix-cache result.", labels=("result",),
                 samples=[(["hit"], cache["hits"]), (["miss"], cache["misses"])]),
        _counter("npud_prefix_cache_cached_tokens_total", "Prompt tokens restored from the prefix cache.",
                 cache["cached_tokens"]),
        _gauge("npud_prefix_cache_hit_ratio", "Hits over lookups since start (NaN before any).", cache["hit_rate"]),
        _gauge("npud_thermal_celsius", "The hottest configured sensor (NaN without a reading).", thermal["reading_c"]),
        _gauge("npud_thermal_state", "1 for the thermal guard's current state.", labels=("state",),
               samples=[([st], st == thermal["state"]) for st in states]),
        _gauge("npud_npu_power_watts", "The NPU's power (hwmon amdxdna NPU_power; NaN without the sensor).",
               thermal["npu_power_w"]),
        _gauge("npud_gemms_on_npu", "1 while the loaded models' GEMMs run on the NPU, 0 on the host.",
               s["gemms"] == "npu"),
        _counter("npud_driver_errors_total", "amdxdna error lines naming npud's processes since start.",
                 errors["count"]),
        # a gauge: a line is moved to npud's own when the worker it names turns out to be npud's
        _gauge("npud_driver_foreign_errors", "amdxdna error lines of other processes since start (no fault).",
               errors.get("foreign", 0)),
        _counter("npud_driver_prehang_warnings_total",
                 "amdxdna warnings that come before a hang or a firmware reset, since start.", errors["pre_hang"]),
        _gauge("npud_driver_errors_available", "1 if the kernel log could be read.", errors["available"]),
        _gauge("npud_device_quarantined", "1 while the device is quarantined after a driver error.",
               s["quarantine"]["quarantined"]),
    ]
    return out


class _Snapshot:
    """A collector of one snapshot's families (describe() is empty: nothing is collected twice)."""

    def __init__(self, fams: list) -> None:
        self.fams = fams

    def describe(self) -> list:
        return []

    def collect(self) -> list:
        return self.fams


def render_prometheus(s: dict) -> str:
    """A snapshot in the Prometheus text format (0.0.4), as prometheus_client writes it."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families(s)))
    return generate_latest(registry).decode("utf-8")


CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format's media type, for HTTP
