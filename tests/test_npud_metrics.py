"""npud/metrics.py: the counters on their own (a real ticket queue, a fake clock), the
Prometheus text read back by prometheus_client's parser, the atomic text file, the `metrics`
method and `stats` of a daemon on the fake engine, `npuctl stats`, and the engine's own stats
(speculation, prefix cache) flowing into the counters on the tiny real checkpoint.

Mutants these tests kill: a quantile rank taken with floor instead of ceil; the rate window
pruned with `<` instead of `<=`; busy time counted for a ticket cancelled while queued; the
text file written in place instead of renamed over; a textfile error logged every interval; an
owner's token rate measured from every user's count at the window's start; the queue counted
for everyone in an owner's view.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import subprocess
import sys

import pytest
import structlog
import trio
from prometheus_client import parser  # the test extra: a real reader of the text format

import test_npud_support as fakes
from npud.clients.client import AsyncClient, BadRequest
from npud.config import DaemonConfigError, MetricsConfig, parse_config
from npud.metrics import WAIT_SAMPLES, Metrics, quantile, render_prometheus, write_atomically
from npud.tickets import Outcome, Priority, TicketQueue
from test_npud_support import DaemonProc, make_config, short_tempdir, start, wait_for


B, I = Priority.BATCH, Priority.INTERACTIVE


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_metrics(**cfg):
    clock = Clock()
    queue = TicketQueue(100, 1e9, clock=clock, wall=clock)
    tokens = [0]
    metrics = Metrics(MetricsConfig(**cfg), queue, lambda: tokens[0], clock=clock)
    return metrics, queue, clock, tokens


def families(text: str) -> dict:
    """{sample name: {frozenset(labels): value}} from prometheus_client's own parser."""
    out: dict = {}
    for family in parser.text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def value(fams: dict, name: str, **labels):
    return fams[name][frozenset(labels.items())]


# -- the counters on their own --------------------------------------------------------------------

def test_grants_and_releases_are_counted_with_their_waits_and_busy_time():
    m, q, clock, _ = make_metrics()
    a = q.enqueue(1, B)
    q.enqueue(2, I)
    c = q.enqueue(3, B)
    clock.now += 2.0
    held = q.grant()  # the interactive ticket, after 2 s
    assert held.job_id == 2
    clock.now += 3.0
    q.release(held, Outcome.DONE)
    q.release(c, Outcome.CANCELLED, "cancelled while queued")  # never held the device
    held = q.grant()
    assert held is a  # waited 5 s
    clock.now += 1.5
    q.release(held, Outcome.PREEMPTED, "quantum")
    again = q.requeue(held, keep_place=False)
    clock.now += 0.5
    assert q.grant() is again  # waited 0.5 s
    clock.now += 0.25
    q.release(again, Outcome.FAULTED, "amdxdna_errors")

    counters = m.counters()
    assert counters["tickets"] == {"granted": 3, "released": {"done": 1, "cancelled": 1, "failed": 0,
                                                               "faulted": 1, "preempted": 1, "joined": 0}}
    waits = {cls: {k: v for k, v in w.items() if k != "buckets"} for cls, w in counters["wait_s"].items()}
    assert waits["interactive"] == {"count": 1, "sum": 2.0, "p50": 2.0, "p90": 2.0, "p99": 2.0}
    assert waits["batch"] == {"count": 2, "sum": 5.5, "p50": 0.5, "p90": 5.0, "p99": 5.0}
    # cumulative buckets: 0.5 s and 5 s lie in the buckets whose bounds they equal
    batch = dict((b, n) for b, n in counters["wait_s"]["batch"]["buckets"])
    assert (batch[0.25], batch[0.5], batch[2.5], batch[5.0], batch["+Inf"]) == (0, 1, 1, 2, 2)
    assert counters["tokens"]["device_busy_s"] == 3.0 + 1.5 + 0.25


def test_quantiles_take_the_nearest_rank():
    values = [float(v) for v in range(1, 11)]
    assert [quantile(values, q) for q in (0.5, 0.9, 0.99)] == [5.0, 9.0, 10.0]
    assert quantile(list(range(1, 101)), 0.99) == 99
    assert quantile([7.0], 0.5) == 7.0
    assert quantile([], 0.5) is None


def test_wait_quantiles_cover_only_the_most_recent_grants():
    m, q, clock, _ = make_metrics()
    for wait in (100.0, 1.0):
        for _ in range(WAIT_SAMPLES):
            ticket = q.enqueue(1, B)
            clock.now += wait
            q.grant()
            q.release(ticket, Outcome.DONE)
    batch = m.counters()["wait_s"]["batch"]
    assert batch["count"] == 2 * WAIT_SAMPLES and batch["sum"] == WAIT_SAMPLES * 101.0
    assert batch["p50"] == batch["p99"] == 1.0  # the 100 s waits have left the window


def test_tokens_per_second_is_measured_over_the_window():
    m, _, clock, tokens = make_metrics(rate_window_s=10.0)
    for _ in range(4):  # 5 tokens a second
        clock.now += 1.0
        tokens[0] += 5
        m.sample()
    assert m.tokens_per_second() == 5.0  # 4 s since start, shorter than the window
    for _ in range(16):
        clock.now += 1.0
        tokens[0] += 5
        m.sample()
    assert m.tokens_per_second() == 5.0
    for _ in range(5):  # nothing more is generated
        clock.now += 1.0
        m.sample()
    assert m.tokens_per_second() == 2.5  # 25 tokens in the last 10 s
    for _ in range(10):
        clock.now += 1.0
        m.sample()
    assert m.tokens_per_second() == 0.0


def test_prompt_stats_feed_acceptance_and_the_prefix_cache_counters():
    m, *_ = make_metrics()
    m.on_prompt({"drafted": 8, "accepted": 6, "num_cached_tokens": 64})
    m.on_prompt({"drafted": 4, "accepted": 1, "num_cached_tokens": 0})
    m.on_prompt({"drafted": 0, "accepted": 0})  # no prefix cache used: neither hit nor miss
    counters = m.counters()
    assert counters["speculative"] == {"drafted": 12, "accepted": 7, "acceptance": 7 / 12}
    assert counters["prefix_cache"] == {"hits": 1, "misses": 1, "hit_rate": 0.5, "cached_tokens": 64}
    empty, *_ = make_metrics()
    assert empty.counters()["speculative"]["acceptance"] is None
    assert empty.counters()["prefix_cache"]["hit_rate"] is None


def test_a_user_sees_the_prefix_cache_counts_of_their_own_prompts_only():
    m, *_ = make_metrics()
    m.on_prompt({"num_cached_tokens": 96}, 1000)
    m.on_prompt({"num_cached_tokens": 32}, 1000)
    m.on_prompt({"num_cached_tokens": 0}, 1001)
    assert m.counters(1000)["prefix_cache"] == {"hits": 2, "misses": 0, "hit_rate": 1.0, "cached_tokens": 128}
    assert m.counters(1001)["prefix_cache"] == {"hits": 0, "misses": 1, "hit_rate": 0.0, "cached_tokens": 0}
    assert m.counters(1002)["prefix_cache"] == {"hits": 0, "misses": 0, "hit_rate": None, "cached_tokens": 0}
    assert m.counters()["prefix_cache"] == {"hits": 2, "misses": 1, "hit_rate": 2 / 3, "cached_tokens": 128}


def test_a_user_sees_the_counters_of_their_own_jobs_only():
    clock = Clock()
    q = TicketQueue(100, 1e9, clock=clock, wall=clock)
    tokens = {1000: 0, 1001: 50}  # 1001's before the window: not 1000's rate
    m = Metrics(MetricsConfig(rate_window_s=10.0), q, lambda: sum(tokens.values()), owner_tokens=lambda: tokens,
                clock=clock)
    mine = q.enqueue(1, I, owner_uid=1000)
    q.enqueue(2, B, owner_uid=1001)
    q.enqueue(3, B, owner_uid=1001)
    assert q.counts() == {"interactive": 1, "batch": 2}
    assert q.counts(1000) == {"interactive": 1, "batch": 0} and q.counts(1001) == {"interactive": 0, "batch": 2}
    clock.now += 1.0
    assert q.grant() is mine
    clock.now += 2.0
    tokens[1000] += 20
    m.sample()
    q.release(mine, Outcome.DONE)
    theirs = q.grant()
    clock.now += 4.0
    tokens[1001] += 60
    m.sample()
    q.release(theirs, Outcome.DONE)
    m.on_prompt({"drafted": 4, "accepted": 3, "time_to_first_token_s": 0.2}, 1000)
    m.on_prompt({"drafted": 8, "accepted": 1}, 1001)
    own = m.counters(1000)
    assert own["tickets"] == {"granted": 1, "released": {"done": 1, "cancelled": 0, "failed": 0, "faulted": 0,
                                                          "preempted": 0, "joined": 0}}
    assert own["wait_s"]["interactive"]["count"] == 1 and own["wait_s"]["batch"]["count"] == 0
    assert own["tokens"]["generated"] == 20 and own["tokens"]["device_busy_s"] == 2.0
    assert own["tokens"]["per_second"] == round(20 / 7.0, 3)  # over the 7 s since start
    assert own["speculative"] == {"drafted": 4, "accepted": 3, "acceptance": 0.75}
    assert own["first_token_s"]["count"] == 1
    everyone = m.counters()
    assert everyone["tickets"]["granted"] == 2 and everyone["tokens"]["generated"] == 130
    assert everyone["tokens"]["device_busy_s"] == 6.0 and everyone["speculative"]["drafted"] == 12
    nobody = m.counters(1002)  # a user with no work sees zeros, not the daemon's
    assert nobody["tickets"]["granted"] == 0 and nobody["tokens"]["generated"] == 0
    assert nobody["tokens"]["per_second"] == 0.0


def test_the_metrics_section_is_checked_where_it_is_read():
    assert parse_config({"metrics": {"textfile_path": "/run/npud/metrics/npud.prom"}}).metrics.textfile_interval_s == 15
    bad = [({"textfile_path": "/run/npud/npud.txt"}, "metrics.textfile_path", "end in .prom"),
           ({"textfile_path": "npud.prom"}, "metrics.textfile_path", "absolute"),
           ({"textfile_interval_s": 0}, "metrics.textfile_interval_s", "> 0"),
           ({"rate_window_s": -1.0}, "metrics.rate_window_s", "> 0"),
           ({"interval_s": 5}, "metrics.interval_s", "unknown field")]
    for section, field_name, why in bad:
        with pytest.raises(DaemonConfigError, match=re.escape(why)) as info:
            parse_config({"metrics": section})
        assert info.value.field == field_name


# -- the text format ------------------------------------------------------------------------------

def _snapshot(**overrides) -> dict:
    m, q, clock, tokens = make_metrics()
    ticket = q.enqueue(1, I)
    clock.now += 0.25
    q.grant()
    tokens[0] = 42
    q.release(ticket, Outcome.DONE)
    m.on_prompt({"drafted": 10, "accepted": 4, "num_cached_tokens": 32, "time_to_first_token_s": 0.3})
    snap = {"version": "0.1.0", "device": "host", **m.counters(), "connections": 3,
            "jobs": {"queued": 2, "running": 1}, "queue": {"interactive": 1, "batch": 4},
            "holding": {"ticket": 9, "job": 4, "priority": "batch"},
            "thermal": {"state": "hold", "reading_c": 96.5, "npu_power_w": 1.5}, "gemms": "host",
            "driver_errors": {"count": 2, "available": True, "pre_hang": 1},
            "quarantine": {"quarantined": True, "since": 1.0, "reason": "x"}}
    snap.update(overrides)
    return snap


def test_the_text_format_parses_back_to_the_snapshot():
    snap = _snapshot()
    fams = families(render_prometheus(snap))
    assert value(fams, "npud_info", version="0.1.0", device="host") == 1
    assert value(fams, "npud_connections") == 3
    assert value(fams, "npud_jobs_active", state="queued") == 2
    assert value(fams, "npud_queue_depth", **{"class": "batch"}) == 4
    assert value(fams, "npud_device_held") == 1
    assert value(fams, "npud_tickets_granted_total") == 1
    assert value(fams, "npud_tickets_released_total", outcome="done") == 1
    assert value(fams, "npud_tickets_released_total", outcome="faulted") == 0
    assert value(fams, "npud_ticket_wait_recent_seconds", quantile="0.99", **{"class": "interactive"}) == 0.25
    assert value(fams, "npud_ticket_wait_recent_seconds_count", **{"class": "interactive"}) == 1
    assert value(fams, "npud_ticket_wait_recent_seconds_sum", **{"class": "interactive"}) == 0.25
    assert math.isnan(value(fams, "npud_ticket_wait_recent_seconds", quantile="0.5", **{"class": "batch"}))
    # the histograms: cumulative buckets, since start
    assert value(fams, "npud_ticket_wait_seconds_bucket", le="0.1", **{"class": "interactive"}) == 0
    assert value(fams, "npud_ticket_wait_seconds_bucket", le="0.25", **{"class": "interactive"}) == 1
    assert value(fams, "npud_ticket_wait_seconds_bucket", le="+Inf", **{"class": "interactive"}) == 1
    assert value(fams, "npud_ticket_wait_seconds_count", **{"class": "batch"}) == 0
    assert value(fams, "npud_first_token_seconds_bucket", le="0.25") == 0
    assert value(fams, "npud_first_token_seconds_bucket", le="0.5") == 1
    assert value(fams, "npud_first_token_seconds_sum") == 0.3
    assert value(fams, "npud_tokens_generated_total") == 42
    assert value(fams, "npud_spec_acceptance_ratio") == 0.4
    assert value(fams, "npud_prefix_cache_lookups_total", result="hit") == 1
    assert value(fams, "npud_prefix_cache_cached_tokens_total") == 32
    assert value(fams, "npud_thermal_celsius") == 96.5
    assert value(fams, "npud_thermal_state", state="hold") == 1
    assert value(fams, "npud_thermal_state", state="ok") == 0
    assert value(fams, "npud_driver_errors_total") == 2
    assert value(fams, "npud_driver_prehang_warnings_total") == 1
    assert value(fams, "npud_npu_power_watts") == 1.5 and value(fams, "npud_gemms_on_npu") == 0
    assert value(fams, "npud_device_quarantined") == 1


def test_label_values_are_escaped_and_missing_readings_are_nan():
    odd = 'npu "x"\\y\nz'
    snap = _snapshot(device=odd, thermal={"state": "no_sensor", "reading_c": None, "npu_power_w": None})
    fams = families(render_prometheus(snap))
    assert value(fams, "npud_info", version="0.1.0", device=odd) == 1
    assert math.isnan(value(fams, "npud_thermal_celsius")) and math.isnan(value(fams, "npud_npu_power_watts"))
    assert value(fams, "npud_thermal_state", state="no_sensor") == 1


def test_the_text_file_is_replaced_whole(tmp_path):
    path = tmp_path / "collector" / "npud.prom"  # the directory is made on the first write
    write_atomically(str(path), "a 1\n")
    first = path.stat()
    write_atomically(str(path), "a 2\n")
    second = path.stat()
    assert path.read_text() == "a 2\n"
    assert first.st_ino != second.st_ino  # a new file renamed over the old, never rewritten in place
    assert stat.S_IMODE(second.st_mode) == 0o644
    assert os.listdir(path.parent) == ["npud.prom"]  # no temporary file is left behind
    (tmp_path / "file").write_text("")
    with pytest.raises(OSError):
        write_atomically(str(tmp_path / "file" / "npud.prom"), "a 1\n")


# -- a daemon on the fake engine ------------------------------------------------------------------

@pytest.fixture
def workdir():
    d = short_tempdir()
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def wait_until(predicate, what: str, timeout: float = 10.0):
    with trio.fail_after(timeout):
        while not (result := await predicate()):
            await trio.sleep(0.01)
    return result


async def done(c, job: int, states=("done",)) -> dict:
    async def reached():
        status = await c.status(job)
        return status if status["state"] in states else None
    return await wait_until(reached, f"job {job} in {states}")


async def test_the_metrics_method_counts_what_the_daemon_did(nursery, workdir):
    fakes.write_fake_checkpoint(workdir / "slow", tokens_per_round=1, round_sleep_s=0.02)
    (workdir / "temp").write_text("41500\n")
    cfg = make_config(workdir, knobs={"tokens_per_round": 2},
                      models=[{"name": "fake", "checkpoint_dir": str(workdir / "fake")},
                              {"name": "slow", "checkpoint_dir": str(workdir / "slow")}],
                      thermal={"enabled": True, "psutil_chips": [], "hwmon_dir": "", "paths": [str(workdir / "temp")],
                               "poll_interval_s": 0.05})
    daemon = await start(nursery, cfg)
    async with await AsyncClient.connect(cfg.server.socket_path) as c:
        first = (await c.submit(["one two", "three"], max_tokens=4))["job"]
        await done(c, first)
        completion = await c.complete("four", max_tokens=3).wait()
        assert len(completion["token_ids"]) == 3
        m = await c.metrics()
        assert m["tickets"]["granted"] == 2
        assert m["tickets"]["released"] == {"done": 2, "cancelled": 0, "failed": 0, "faulted": 0, "preempted": 0,
                                            "joined": 0}
        assert m["wait_s"]["interactive"]["count"] == 1 and m["wait_s"]["batch"]["count"] == 1
        assert m["tokens"]["generated"] == 4 + 4 + 3
        assert m["thermal"] == {"state": "ok", "reading_c": 41.5, "npu_power_w": None}
        assert m["driver_errors"] == {"count": 0, "available": True, "pre_hang": 0, "foreign": 0}
        assert m["gemms"] == "host"
        assert m["holding"] is None and m["queue"] == {"interactive": 0, "batch": 0}

        # the device held by a long job, two more waiting behind it, then a driver error
        running = (await c.submit(["long"], model="slow", max_tokens=2000))["job"]
        await wait_until(lambda: _holding(c, running), "the long job to hold the device")
        waiting = [(await c.submit([f"w{i}"], max_tokens=2))["job"] for i in range(2)]
        m = await c.metrics()
        assert m["queue"] == {"interactive": 0, "batch": 2}
        assert m["jobs"] == {"queued": 2, "running": 1}
        assert m["holding"]["job"] == running and m["holding"]["priority"] == "batch"
        with open(workdir / "kmsg", "a") as f:
            f.write(f"3,1,1,-;{fakes.KMSG_ERROR}\n")
        m = await wait_until(lambda: _quarantined(c), "the quarantine")
        assert m["driver_errors"]["count"] == 1
        assert m["tickets"]["released"]["faulted"] == 1
        assert m["holding"] is None and m["queue"] == {"interactive": 0, "batch": 3}  # the faulted job requeued

        # the text format from the method says the same as the JSON
        text = (await c.metrics(format="prometheus"))["text"]
        fams = families(text)
        assert value(fams, "npud_device_quarantined") == 1
        assert value(fams, "npud_driver_errors_total") == 1
        assert value(fams, "npud_queue_depth", **{"class": "batch"}) == 3
        assert value(fams, "npud_tickets_released_total", outcome="faulted") == 1
        assert value(fams, "npud_thermal_celsius") == 41.5

        assert (await c.device_clear())["cleared"] is True
        for job in [running, *waiting]:
            await c.cancel(job)
        for job in waiting:
            await done(c, job, ("done", "cancelled"))
        await done(c, running, ("cancelled",))
        m = await c.metrics()
        assert m["quarantine"]["quarantined"] is False
        # a fresh store: its ticket history is exactly what happened since start
        history = (await c.tickets(limit=1000))["tickets"]
        assert m["tickets"]["granted"] == sum(1 for t in history if t["granted_at"] is not None)
        outcomes = [t["outcome"] for t in history]
        assert m["tickets"]["released"] == {o.value: outcomes.count(o.value) for o in Outcome}
        assert m["tokens"]["generated"] == sum(t["tokens"] for t in history)
    daemon.request_stop()


async def _holding(c, job: int):
    m = await c.metrics()
    return m if m["holding"] is not None and m["holding"]["job"] == job else None


async def _quarantined(c):
    """The metrics once the device is quarantined and the faulted ticket released (the
    quarantine is set first, so that nothing is granted in between)."""
    m = await c.metrics()
    return m if m["quarantine"]["quarantined"] and m["tickets"]["released"]["faulted"] else None


async def test_stats_keeps_its_fields_and_carries_the_metrics(nursery, workdir):
    cfg = make_config(workdir)
    daemon = await start(nursery, cfg)
    async with await AsyncClient.connect(cfg.server.socket_path) as c:
        job = (await c.submit(["a"], max_tokens=2))["job"]
        await done(c, job)
        stats = await c.stats()
        # what `stats` returned before the metrics, for clients written against it
        assert {"uptime_s", "version", "connections", "jobs", "tickets", "tokens_generated", "queue", "granted",
                "quarantined"} < set(stats)
        assert stats["jobs"] == {"done": 1} and stats["tickets"] == {"done": 1} and stats["tokens_generated"] == 2
        metrics = await c.metrics()
        assert set(stats["metrics"]) == set(metrics)
        assert stats["metrics"]["tickets"] == metrics["tickets"]
        assert stats["metrics"]["tokens"]["generated"] == 2
        with pytest.raises(BadRequest, match="format"):
            await c.call("metrics", {"format": "xml"})
    daemon.request_stop()


async def test_the_text_file_follows_the_daemon_and_goes_when_it_stops(workdir):
    path = workdir / "collector" / "npud.prom"
    cfg = make_config(workdir, metrics={"textfile_path": str(path), "textfile_interval_s": 0.05})
    async with trio.open_nursery() as nursery:
        daemon = await start(nursery, cfg)
        async with await AsyncClient.connect(cfg.server.socket_path) as c:
            await wait_until(_exists(path), "the text file")
            first = path.open()  # the file as first written: a replacing write leaves it as it was
            assert value(families(first.read()), "npud_tokens_generated_total") == 0
            job = (await c.submit(["a b c"], max_tokens=6))["job"]
            await done(c, job)

            async def counted():
                fams = families(path.read_text())
                return fams if value(fams, "npud_tokens_generated_total") == 6 else None

            fams = await wait_until(counted, "the text file to count the job")
            assert value(fams, "npud_tickets_released_total", outcome="done") == 1
            # replaced by a rename, never rewritten in place: what was first opened still reads 0
            # (an inode comparison is not enough: a freed inode number comes back)
            first.seek(0)
            assert value(families(first.read()), "npud_tokens_generated_total") == 0
            first.close()
            assert stat.S_IMODE(path.stat().st_mode) == 0o644

            async def no_temporary_left():  # a write in progress has one for a moment; a leak stays
                return sorted(os.listdir(path.parent)) == ["npud.prom"]

            await wait_until(no_temporary_left, "the temporary files gone")
        daemon.request_stop()
    assert not path.exists()  # a stopped daemon leaves no stale numbers to export


def _exists(path):
    async def check():
        return path.exists()
    return check


async def test_a_text_file_that_cannot_be_written_is_reported_once(workdir):
    blocker = workdir / "blocker"
    blocker.write_text("a file where the directory should be")
    path = blocker / "npud.prom"
    cfg = make_config(workdir, metrics={"textfile_path": str(path), "textfile_interval_s": 0.02})
    with structlog.testing.capture_logs() as logs:
        async with trio.open_nursery() as nursery:
            daemon = await start(nursery, cfg)
            async with await AsyncClient.connect(cfg.server.socket_path) as c:
                await trio.sleep(0.3)  # about 15 failed writes
                job = (await c.submit(["still served"], max_tokens=2))["job"]
                await done(c, job)
                failures = [e for e in logs if e["event"] == "metrics_textfile_failed"]
                assert len(failures) == 1 and failures[0]["path"] == str(path)
                blocker.unlink()  # the directory can be made now

                async def written():  # the log line comes after the rename, back on the event loop
                    return any(e["event"] == "metrics_textfile_written" for e in logs)

                await wait_until(written, "the text file")
                assert path.exists()
                assert [e["event"] for e in logs if e["event"].startswith("metrics_textfile")] == [
                    "metrics_textfile_failed", "metrics_textfile_written"]
            daemon.request_stop()


async def test_npuctl_stats_shows_the_metrics(nursery, workdir):
    cfg = make_config(workdir)
    daemon = await start(nursery, cfg)
    async with await AsyncClient.connect(cfg.server.socket_path) as c:
        for prompts in (["a"], ["b", "c"]):
            await done(c, (await c.submit(prompts, max_tokens=3))["job"])

    def npuctl(*args):
        env = {k: v for k, v in os.environ.items() if not k.startswith("NPUD_")}
        env["PYTHONPATH"] = str(fakes.REPO)
        return subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "--socket", cfg.server.socket_path, *args],
                              capture_output=True, text=True, env=env, timeout=60)

    run = await trio.to_thread.run_sync(npuctl, "stats")
    assert run.returncode == 0, run.stderr
    fields = dict(line.split(":", 1) for line in run.stdout.splitlines())
    fields = {k: v.strip() for k, v in fields.items()}
    assert fields["tokens generated"] == "9"  # the rows from before the metrics are still there
    assert fields["since start"] == "2 tickets granted; released done 2"
    assert fields["wait batch"].endswith("(of 2)") and fields["wait interactive"] == "none yet"
    tokens_line = r"\d+\.\d over the last 60s; device busy (\d+ms|\d+\.\ds)"
    assert re.fullmatch(tokens_line, fields["tokens/s"]), fields["tokens/s"]
    assert fields["acceptance"] == "- (0 of 0 drafted tokens accepted)"
    assert fields["prefix cache"] == "0 hits, 0 misses (hit rate -), 0 tokens reused"
    assert fields["thermal"] == "disabled" and fields["driver errors"] == "0"
    run = await trio.to_thread.run_sync(npuctl, "stats", "--json")
    assert json.loads(run.stdout)["metrics"]["tickets"]["granted"] == 2
    daemon.request_stop()


# -- the engine's stats on the tiny real checkpoint -----------------------------------------------

@pytest.mark.slow
def test_speculation_and_prefix_cache_counts_come_from_the_engine(tmp_path_factory):
    pytest.importorskip("torch", reason="npud/engine/testing/checkpoints.py builds the tiny model with torch")
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    model = build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")
    # one prompt at a time: two copies of a prompt that start in one batched round both look the
    # cache up before either has offered its blocks (npud/engine/batch.py), so neither would restore
    d = DaemonProc(short_tempdir(), [{"name": "tiny", "checkpoint_dir": str(model), "weight_format": "fp32"}],
                   batching={"max_batch": 1})
    # long enough for several 32-token cache blocks, repetitive enough for n-gram drafts
    prompt = "def add(a, b):\n    return a + b\n\n" * 6
    try:
        d.start()
        with d.client() as c:
            job = c.submit([prompt, prompt, "x = 1"], max_tokens=24, spec={"method": "ngram"})["job"]
            wait_for(lambda: c.status(job)["state"] == "done", 120, what="the job")
            results = c.result(job)["results"]
            m = c.metrics()
        stats = [r["stats"] for r in results]
        cached = [s["num_cached_tokens"] for s in stats]
        assert cached[1] > 0  # the second copy of the prompt restored the first one's blocks
        assert m["prefix_cache"]["hits"] == sum(1 for n in cached if n > 0)
        assert m["prefix_cache"]["misses"] == sum(1 for n in cached if n == 0)
        assert m["prefix_cache"]["cached_tokens"] == sum(cached)
        assert sum(s["drafted"] for s in stats) > 0
        assert m["speculative"]["drafted"] == sum(s["drafted"] for s in stats)
        assert m["speculative"]["accepted"] == sum(s["accepted"] for s in stats)
        assert m["tokens"]["generated"] == sum(len(r["token_ids"]) for r in results)
    finally:
        d.stop()
        shutil.rmtree(d.dir, ignore_errors=True)
