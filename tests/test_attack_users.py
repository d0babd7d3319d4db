"""npud under attack by another local user (issue 17): what one uid can learn of another's
work. A daemon process on the fake engine; the other user is a client process running as a
uid of its own (no passwd entry needed: any uid but root is an ordinary user here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from test_npud_support import REPO, DaemonProc, short_tempdir, wait_for, write_fake_checkpoint

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                                reason="needs root (to run a client as another uid) and /usr/bin/python3")

OTHER_UID, NOGROUP = 64011, 65534

AS_OTHER = r"""
import json, sys
from npud.clients import client as npc
c = npc.Client(sys.argv[1], timeout=30)
out = {}
def attempt(name, fn):
    try:
        out[name] = ["ok", fn()]
    except npc.NpudError as exc:
        out[name] = [exc.code, exc.message]
for job in json.loads(sys.argv[2]):
    for method in ("status", "result", "cancel"):
        attempt(f"{method} {job}", lambda: getattr(c, method)(job))
    attempt(f"stream {job}", lambda: c.stream(job).wait())
attempt("stats", lambda: c.stats())
attempt("metrics", lambda: c.metrics())
attempt("broken", lambda: c.complete("a", model="broken", max_tokens=1).wait())
attempt("device", lambda: c.device_status())
print(json.dumps(out))
"""


def as_other(socket: str, jobs: list[int]) -> dict:
    done = subprocess.run(["/usr/bin/python3", "-c", AS_OTHER, socket, json.dumps(jobs)], user=OTHER_UID,
                          group=NOGROUP, extra_groups=[], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, cwd="/", timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_another_users_jobs_look_like_missing_ones_and_nothing_leaks():
    workdir = short_tempdir()
    slow = write_fake_checkpoint(workdir / "fake", tokens_per_round=1, round_sleep_s=0.02)
    (workdir / "broken").mkdir()
    (workdir / "broken" / "fake.json").write_text("{ not json")
    d = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(slow)},
                             {"name": "broken", "checkpoint_dir": str(workdir / "broken")}], fake_engine=True,
                   server={"socket_group": "nogroup", "admin_group": "npud-test-no-such-group"})
    try:
        d.start()
        with d.client() as c:
            job = c.submit(["root's secret prompt"], max_tokens=4000)["job"]
            wait_for(lambda: c.status(job)["state"] == "running", what="root's job to run")
            seen = as_other(d.socket, [job, job + 1000])
            assert c.status(job)["state"] == "running"  # untouched
            d.add_kmsg(d.kmsg_error)  # root's job faults the device (seen when its ticket is released)
            c.cancel(job)
            wait_for(lambda: c.device_status()["quarantine"] is not None, what="the quarantine")
            assert c.device_status()["quarantine"]["job"] == job  # root sees whose job it was
            quarantined = as_other(d.socket, [])["device"][1]["quarantine"]
            assert quarantined["job"] is None and quarantined["ticket"] is None  # others do not
            c.device_clear()
            c.cancel(job)
        # before: `forbidden` for root's job and `not_found` for a missing one told them apart
        for method in ("status", "result", "cancel", "stream"):
            assert seen[f"{method} {job}"] == ["not_found", f"no job {job}"], (method, seen[f"{method} {job}"])
            assert seen[f"{method} {job + 1000}"] == ["not_found", f"no job {job + 1000}"]
        # before: stats and metrics named the job (and ticket) holding the device
        stats = seen["stats"][1]
        assert stats["granted"]["job"] is None and stats["granted"]["ticket"] is None
        assert stats["metrics"]["holding"]["job"] is None
        assert seen["metrics"][1]["holding"]["job"] is None and seen["metrics"][1]["holding"]["ticket"] is None
        # before: the model error carried the checkpoint path and the exception text
        code, message = seen["broken"]
        assert code == "model_error" and "'broken'" in message
        assert str(workdir) not in message and "JSONDecodeError" not in message and "not JSON" not in message
        [failed] = d.events("model_load_failed")
        assert str(workdir / "broken") in failed["checkpoint_dir"]  # the operator still sees it all
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


AS_OTHER_COMPLETE = r"""
import json, sys
from npud.clients import client as npc
c = npc.Client(sys.argv[1], timeout=120)
out = [c.complete(p, max_tokens=1).wait()["stats"].get("num_cached_tokens") for p in json.loads(sys.argv[2])]
out.append(c.cache_list())
out.append([c.metrics()["prefix_cache"], c.stats()["metrics"]["prefix_cache"]])
print(json.dumps(out))
"""


@pytest.mark.slow
def test_the_prefix_cache_tells_no_user_about_anothers_prompts(tmp_path):
    checkpoints = pytest.importorskip("npud.engine.testing.checkpoints", reason="builds the tiny model")
    model = checkpoints.build_tiny_checkpoint(tmp_path / "tiny")
    workdir = short_tempdir()
    d = DaemonProc(workdir, [{"name": "tiny", "checkpoint_dir": str(model), "weight_format": "fp32"}],
                   server={"socket_group": "nogroup", "admin_group": "npud-test-no-such-group"})
    secret = "the launch code is " + " ".join(f"w{i}" for i in range(120))  # several 32-token blocks
    system = "you are a careful assistant. " * 20
    try:
        d.start(timeout=120)
        with d.client() as c:
            assert c.complete(secret, max_tokens=1).wait()["stats"]["num_cached_tokens"] == 0
            assert c.complete(secret + " more", max_tokens=1).wait()["stats"]["num_cached_tokens"] >= 64  # own: kept
            c.cache_pin("system", text=system)  # an operator shares a system prompt
        done = subprocess.run(["/usr/bin/python3", "-c", AS_OTHER_COMPLETE, d.socket,
                               json.dumps([secret + " more", system + " and a question"])],
                              user=OTHER_UID, group=NOGROUP, extra_groups=[],
                              env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, cwd="/", timeout=300)
        assert done.returncode == 0, done.stderr
        guessed, shared, listing, (metrics, stats) = json.loads(done.stdout)
        assert guessed == 0  # before: the cached blocks of root's prompt answered the guess
        assert shared >= 64  # the pinned system prompt serves everyone
        [entry] = listing["models"]
        assert set(entry) == {"model", "pins"}  # no counters of other users' lookups
        # before: metrics and stats counted every user's hits, root's among them
        own = {"hits": 1, "misses": 1, "hit_rate": 0.5, "cached_tokens": shared}
        assert metrics == own and stats == own
        with d.client() as c:  # an operator sees every user's
            assert c.metrics()["prefix_cache"]["hits"] == 2 and c.metrics()["prefix_cache"]["misses"] == 2
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)


AS_OTHER_COUNTERS = r"""
import json, sys
from npud.clients import client as npc
with npc.Client(sys.argv[1], timeout=60) as c:
    done = c.complete("mine", max_tokens=3).wait()
    print(json.dumps([done["tokens"] if "tokens" in done else len(done["token_ids"]), c.stats(), c.metrics(),
                      c.metrics(format="prometheus")["text"]]))
"""


def test_a_non_admin_sees_the_counters_of_their_own_work_only():
    workdir = short_tempdir()
    slow = write_fake_checkpoint(workdir / "fake", tokens_per_round=1, round_sleep_s=0.02)
    d = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(slow)}], fake_engine=True,
                   server={"socket_group": "nogroup", "admin_group": "npud-test-no-such-group"})
    try:
        d.start()
        with d.client() as c:
            for i in range(2):
                c.complete(f"root's {i}", max_tokens=5).wait()
            running = c.submit(["root's long one"], max_tokens=4000)["job"]
            queued = c.submit(["root's next"], max_tokens=5)["job"]
            wait_for(lambda: c.status(running)["state"] == "running", what="root's job to run")
            done = subprocess.run(["/usr/bin/python3", "-c", AS_OTHER_COUNTERS, d.socket], user=OTHER_UID,
                                  group=NOGROUP, extra_groups=[], env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
                                  capture_output=True, text=True, cwd="/", timeout=120)
            assert done.returncode == 0, done.stderr
            tokens, stats, metrics, text = json.loads(done.stdout)
            everyone = c.stats()
            c.cancel(running)
            c.cancel(queued)
        assert tokens == 3
        # before: every user's jobs, tickets, tokens, queue, connections and waits
        assert stats["jobs"] == {"done": 1}
        assert sum(stats["tickets"].values()) == 1 and set(stats["tickets"]) <= {"done", "joined"}  # rode root's?
        assert stats["tokens_generated"] == 3 and stats["connections"] == 1
        assert stats["queue"] == {"interactive": 0, "batch": 0} and stats["store"]["unsaved_jobs"] == 0
        for m in (metrics, stats["metrics"]):
            assert m["tokens"]["generated"] == 3 and m["tickets"]["granted"] <= 1
            assert sum(m["tickets"]["released"].values()) == 1
            assert m["wait_s"]["interactive"]["count"] == 1 and m["wait_s"]["batch"]["count"] == 0
            assert m["jobs"] == {"queued": 0, "running": 0} and m["queue"] == {"interactive": 0, "batch": 0}
            assert m["connections"] == 1
            assert m["holding"] == {"ticket": None, "job": None, "priority": "batch", "state": "granted"}
        assert "npud_tokens_generated_total 3.0" in text and 'npud_jobs_active{state="queued"} 0.0' in text
        assert 'npud_jobs_active{state="running"} 0.0' in text
        # the device's own state is everyone's: held, at which priority
        assert "npud_device_held 1.0" in text
        # an operator sees every user's
        assert everyone["tokens_generated"] >= 10 + 3 and everyone["jobs"]["done"] >= 3
        assert everyone["jobs"]["running"] == 1  # root's long one
        assert everyone["metrics"]["tickets"]["granted"] >= 3 and everyone["metrics"]["jobs"]["running"] == 1
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
