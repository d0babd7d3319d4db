"""End to end through the NPU backend on the pyxrt SIMULATOR (tests/fake_pyxrt.py), in the NPU
worker process: a bf16 model served with backend "xrt" decodes the same greedy tokens as on
the host, for every speculative method; through the whole daemon, a worker that aborts,
segfaults or hangs mid-round quarantines the device while the daemon goes on answering, and
the job finishes on the host with the host's output. Evidence about the backend's protocol,
arithmetic and isolation, not about an NPU."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import trio

import fake_pyxrt
import test_npud_support as fakes
from npud.clients.client import AsyncClient, DeviceQuarantined
from npud.engine.testing.checkpoints import build_tiny_checkpoint
from npud.engine.api import DeviceFault, GenerateRequest, GenerationParams, SpecParams
from npud.engine.loader import load_model
from npud.kernels import xrt, xrt_worker
from npud.config import parse_config
from npud.daemon import Daemon

gemm_shapes = fake_pyxrt.build_tool().gemm_shapes

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("xrt") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def host_served(ckpt):
    return load_model("tiny", ckpt, draft_dir=ckpt, weight_format="bf16", backend="host")


@pytest.fixture
def control(tmp_path, monkeypatch):
    """The simulator's control file, read by the NPU worker (fake_pyxrt's docstring)."""
    fake_pyxrt.install(monkeypatch)
    monkeypatch.setattr(xrt, "probe", lambda: (True, "simulated accel0 with tests/fake_pyxrt.py"))
    monkeypatch.setattr(xrt_worker, "REPLY_GRACE_S", 1.0)
    path = tmp_path / "control.json"
    monkeypatch.setenv("FAKE_PYXRT_CONTROL", str(path))
    return path


def passes(served) -> int:
    """The NPU passes run so far by `served`'s backend (asked of its worker: only while idle)."""
    return served.model.backend.device.stats()["passes"]


@pytest.fixture
def npu_served(ckpt, tmp_path, control):
    shapes = [(s.K, s.N) for s in gemm_shapes([ckpt], "bf16")]
    # npu1 tiling, M = 16 rows a pass: the prompt's prefill takes more than one pass, and N is
    # padded to 16-column multiples (tile_n 4 x 4 columns)
    table = fake_pyxrt.write_design_table(tmp_path / "designs", shapes, device="npu1", M=16, tile=(4, 8, 4),
                                          columns=4)
    served = load_model("tiny", ckpt, draft_dir=ckpt, weight_format="bf16", backend="xrt",
                        xrt_design=table, xrt_timeout_ms=1000)
    yield served, control
    served.model.backend.close()


def drive(session):
    while not session.done:
        session.run_round()
    return session.result()


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_greedy_output_through_the_simulated_npu_equals_the_host(host_served, npu_served, method):
    served, _ = npu_served
    d = served.describe()
    assert d["backend"] == "xrt-simulator"
    assert set(d["gemm_placement"].values()) == {"npu"} and len(d["gemm_placement"]) == 4
    assert set(d["gemm_tolerance"].values()) == {"bf16-exact-products"}  # npu1
    req = GenerateRequest(prompt=PROMPT, params=GenerationParams(max_tokens=24,
                                                                 spec=SpecParams(method=method, k=4)))
    before = passes(served)
    got = drive(served.start(req))
    want = drive(host_served.start(req))
    assert got.prompt_tokens > 16  # several passes of M rows
    assert list(got.token_ids) == list(want.token_ids) and got.text == want.text
    assert passes(served) > before  # the GEMMs did go through the simulated device


def test_a_failed_run_mid_generation_raises_a_device_fault(npu_served):
    served, control = npu_served
    session = served.start(GenerateRequest(prompt=PROMPT, params=GenerationParams(max_tokens=24)))
    session.run_round()
    control.write_text(json.dumps({"mode": "timeout"}))
    with pytest.raises(DeviceFault, match="ERT_CMD_STATE_TIMEOUT"):
        while not session.done:
            session.run_round()


# -- through the whole daemon: socket, jobs, tickets, device owner, engine, simulated NPU -----

PROMPTS = ["def add(a, b):\n    return a + b\n", "for i in range(10):\n"]


async def _wait_state(c, job, states):
    with trio.fail_after(120):
        while (status := await c.status(job))["state"] not in states:
            await trio.sleep(0.02)
    return status


def _texts(served) -> list[str]:
    return [drive(served.start(GenerateRequest(prompt=p, params=GenerationParams(max_tokens=16)))).text
            for p in PROMPTS]


def _npu_texts(ckpt, workdir) -> list[str]:
    """PROMPTS' texts on the daemon's design table (npu2's stock build quantises in bfp16 blocks,
    so they are not the host's: a text says which of the two computed it)."""
    served = load_model("tiny", ckpt, weight_format="bf16", backend="xrt", xrt_design=_table(workdir, ckpt))
    try:
        return _texts(served)
    finally:
        served.model.backend.close()


def _table(workdir, ckpt):
    return fake_pyxrt.write_design_table(workdir / "designs", [(s.K, s.N) for s in gemm_shapes([ckpt], "bf16")])


def _daemon_config(workdir, ckpt, backend):
    table = _table(workdir, ckpt)
    (workdir / "kmsg").touch()
    return parse_config({
        "server": {"socket_path": str(workdir / "s.sock")}, "store": {"state_dir": str(workdir / "state")},
        "thermal": {"enabled": False}, "errors": {"source": str(workdir / "kmsg"), "poll_interval_s": 0.05},
        "device": {"backend": backend, "xrt_design": str(table), "xrt_timeout_ms": 1000},
        # one prompt at a time: the faults below are placed by counting one prompt's device passes
        "batching": {"max_batch": 1},
        "models": [{"name": "tiny", "checkpoint_dir": str(ckpt), "weight_format": "bf16"}]})


async def _warm_up(c, daemon, on_npu) -> int:
    """Run PROMPTS once on the simulated NPU; returns the passes one prompt takes."""
    job = (await c.submit(PROMPTS, max_tokens=16))["job"]
    await _wait_state(c, job, ("done",))
    assert [r["text"] for r in (await c.result(job))["results"]] == on_npu
    [model] = (await c.models())["models"]
    assert model["describe"]["backend"] == "xrt-simulator"
    return passes(daemon.registry.resident("tiny")) // 2  # the device is idle: its worker may be asked


async def test_the_daemon_serves_through_the_simulated_npu_and_faults_a_failed_run(ckpt, host_served, control):
    workdir = fakes.short_tempdir()
    try:
        cfg = _daemon_config(workdir, ckpt, "xrt")  # the NPU or nothing: the job waits for the clear
        on_npu = _npu_texts(ckpt, workdir)
        assert on_npu != _texts(host_served)  # bfp16 blocks: the texts tell the NPU's from the host's
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(Daemon(cfg).run)
            async with await AsyncClient.connect(cfg.server.socket_path) as c:
                per_prompt = await _warm_up(c, daemon, on_npu)
                # a run that times out in the middle of the second prompt of the next job
                control.write_text(json.dumps({"mode": "timeout", "after": per_prompt + per_prompt // 2}))
                job = (await c.submit(PROMPTS, max_tokens=16))["job"]
                with trio.fail_after(120):
                    while daemon.queue.quarantine is None:
                        await trio.sleep(0.02)
                assert "ERT_CMD_STATE_TIMEOUT" in daemon.queue.quarantine.reason
                assert not daemon.queue.quarantine.host_fallback
                status = await _wait_state(c, job, ("queued",))
                assert status["done_prompts"] == 1
                assert [r["prompt"] for r in (await c.result(job))["results"]] == [0]
                with pytest.raises(DeviceQuarantined):
                    await c.complete("x", max_tokens=2).wait()
                assert (await c.device_clear())["cleared"]
                await _wait_state(c, job, ("done",))
                assert [r["text"] for r in (await c.result(job))["results"]] == on_npu  # redone from prompt 1
                outcomes = [(t["outcome"], t["reason"]) for t in daemon.store.tickets(job_id=job)]
                assert outcomes == [("done", None), ("faulted", "npu_run_failed")]
            daemon.request_stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.mark.parametrize("mode, said", [("crash", "killed by SIGABRT"), ("segfault", "killed by SIGSEGV"),
                                        ("hang", "and was killed")])  # hung in layer_begin / layer_step
async def test_a_worker_killed_mid_round_quarantines_and_the_job_finishes_on_the_host(ckpt, host_served, control,
                                                                                      mode, said):
    workdir = fakes.short_tempdir()
    try:
        cfg = _daemon_config(workdir, ckpt, "auto")
        on_npu, on_host = _npu_texts(ckpt, workdir), _texts(host_served)
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(Daemon(cfg).run)
            async with await AsyncClient.connect(cfg.server.socket_path) as c, \
                    await AsyncClient.connect(cfg.server.socket_path) as other:
                per_prompt = await _warm_up(c, daemon, on_npu)
                worker = daemon.registry.resident("tiny").model.backend.device
                control.write_text(json.dumps({"mode": mode, "after": per_prompt + per_prompt // 2}))
                job = (await c.submit(PROMPTS, max_tokens=16))["job"]
                answered = {"before": 0, "after": 0}
                done = trio.Event()

                async def the_other_client():  # answered all along, the fault included
                    while not done.is_set():
                        with trio.fail_after(30):
                            await other.device_status()
                        answered["after" if daemon.queue.quarantine is not None else "before"] += 1
                        await trio.sleep(0.01)

                nursery.start_soon(the_other_client)
                await _wait_state(c, job, ("done",))  # no clear: the host took over
                done.set()
                assert worker.proc.poll() is not None and worker.lost  # the worker is gone, killed if hung
                q = daemon.queue.quarantine
                assert q.host_fallback and said in q.reason
                # prompt 0 was committed from the NPU; prompt 1, faulted, was redone from its start on
                # the host: the host-only output
                assert [r["text"] for r in (await c.result(job))["results"]] == [on_npu[0], on_host[1]]
                outcomes = [(t["outcome"], t["reason"]) for t in daemon.store.tickets(job_id=job)]
                assert outcomes == [("done", None), ("faulted", "npu_run_failed")]
                [model] = (await c.models())["models"]
                assert model["describe"]["backend"].startswith("host")
                assert answered["before"] > 0 and answered["after"] > 0
            daemon.request_stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# a driver line naming the process that runs the simulator (the NPU worker), and lines of others
OWN_LINE = "amdxdna 0000:c5:00.1: [drm] *ERROR* job_timeout: timing out hwctx.{pid}.1 job 12"
FOREIGN_LINES = ["amdxdna 0000:c5:00.1: [drm] *ERROR* aie2_tdr_detect: TDR timeout detected",
                 "amdxdna 0000:c5:00.1: [drm] *ERROR* aie2_alloc_resource: Allocate AIE resource failed, ret -16",
                 "amdxdna 0000:c5:00.1: [drm] *ERROR* job_timeout: timing out hwctx.1.3 job 4"]


@pytest.mark.parametrize("whose", ["own", "foreign"])
async def test_an_error_line_faults_only_when_it_names_npuds_worker_and_then_the_job_finishes_on_the_host(
        ckpt, host_served, control, whose):
    """FastFlowLM or `xrt-smi validate` beside npud: their driver lines are counted and the job
    goes on on the NPU; a line naming npud's worker faults the ticket and, under "auto", the job
    is redone on the host with the host-only output while the quarantine waits for an operator."""
    workdir = fakes.short_tempdir()
    try:
        cfg = _daemon_config(workdir, ckpt, "auto")
        on_npu, on_host = _npu_texts(ckpt, workdir), _texts(host_served)
        async with trio.open_nursery() as nursery:
            daemon = await nursery.start(Daemon(cfg).run)
            async with await AsyncClient.connect(cfg.server.socket_path) as c:
                per_prompt = await _warm_up(c, daemon, on_npu)
                worker = daemon.registry.resident("tiny").model.backend.device
                assert worker.pid in (await c.device_status())["errors"]["own_pids"]  # claimed at the load
                # the driver prints them in the middle of the second prompt
                control.write_text(json.dumps({"mode": "kmsg", "after": per_prompt + per_prompt // 2,
                                               "path": str(workdir / "kmsg"),
                                               "lines": [OWN_LINE] if whose == "own" else FOREIGN_LINES}))
                job = (await c.submit(PROMPTS, max_tokens=16))["job"]
                await _wait_state(c, job, ("done",))  # no clear in either case
                texts = [r["text"] for r in (await c.result(job))["results"]]
                # foreign: all on the NPU; own: prompt 1, faulted, redone from its start on the host
                assert texts == (on_npu if whose == "foreign" else [on_npu[0], on_host[1]])
                outcomes = [(t["outcome"], t["reason"]) for t in daemon.store.tickets(job_id=job)]
                [model] = (await c.models())["models"]
                errors = (await c.device_status())["errors"]
                if whose == "foreign":
                    assert outcomes == [("done", None)] and daemon.queue.quarantine is None
                    assert (errors["count"], errors["foreign_count"]) == (0, len(FOREIGN_LINES))
                    assert model["describe"]["backend"] == "xrt-simulator"  # still on the NPU
                else:
                    assert outcomes == [("done", None), ("faulted", "amdxdna_errors")]
                    q = daemon.queue.quarantine
                    assert q.host_fallback and q.lines == (OWN_LINE.format(pid=worker.pid),)
                    assert errors["count"] == 1 and model["describe"]["backend"].startswith("host")
                    assert (await c.device_clear())["cleared"]  # the operator's word: back to the NPU
                    job = (await c.submit(PROMPTS[:1], max_tokens=16))["job"]
                    await _wait_state(c, job, ("done",))
                    [model] = (await c.models())["models"]
                    assert model["describe"]["backend"] == "xrt-simulator"
            daemon.request_stop()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


# -- real hardware -----------------------------------------------------------------------------


NPU_DESIGN = os.environ.get("NPUD_XRT_DESIGN")
NPU_MODEL = os.environ.get("NPUD_NPU_MODEL")  # a bf16 checkpoint whose shapes the design table covers


@pytest.mark.npu
@pytest.mark.skipif(not (NPU_DESIGN and NPU_MODEL and xrt.probe()[0]),
                    reason="needs an amdxdna NPU, pyxrt, NPUD_XRT_DESIGN=<design.json> and NPUD_NPU_MODEL=<its "
                           "bf16 checkpoint> (docs/npu.md)")
def test_npu_speculative_output_equals_plain_output_on_the_device():
    # on the NPU greedy output need not equal the host's (bf16 activations), but batch
    # invariance makes every speculative method give the device's own plain greedy text
    served = load_model("npu", NPU_MODEL, draft_dir=NPU_MODEL, weight_format="bf16", backend="xrt",
                        xrt_design=NPU_DESIGN)
    assert served.describe()["backend"] == "xrt"
    assert all(p.startswith("npu") for p in served.describe()["gemm_placement"].values())
    texts = {m: drive(served.start(GenerateRequest(prompt=PROMPT, params=GenerationParams(
                 max_tokens=48, spec=SpecParams(method=m, k=4))))).text
             for m in ("none", "ngram", "draft")}
    assert len(set(texts.values())) == 1, texts


def test_under_auto_a_model_whose_npu_placement_loses_everywhere_runs_on_the_host_and_says_so(ckpt, host_served,
                                                                                               tmp_path, control,
                                                                                               monkeypatch):
    monkeypatch.setattr(xrt, "measure_costs", lambda *a: (2e-3, 1e-3))  # the host faster on every shape
    shapes = [(s.K, s.N) for s in gemm_shapes([ckpt], "bf16")]
    table = fake_pyxrt.write_design_table(tmp_path / "designs", shapes)
    served = load_model("tiny", ckpt, draft_dir=ckpt, weight_format="bf16", backend="auto", xrt_design=table)
    d = served.describe()
    assert d["backend"] == "host" and d["npu_worker_pid"] is None
    assert d["backend_reason"].startswith("host backend: the NPU was slower than the host on every GEMM shape")
    assert set(d["gemm_costs"]) == {f"{k}x{n} bf16" for k, n in shapes}
    assert all(c == {"rows": 1, "npu_ms": 2.0, "host_ms": 1.0} for c in d["gemm_costs"].values())
    req = GenerateRequest(prompt=PROMPT, params=GenerationParams(max_tokens=16, spec=SpecParams(method="draft", k=4)))
    assert drive(served.start(req)).text == drive(host_served.start(req)).text


def test_describe_says_where_each_layer_runs_and_why(ckpt, tmp_path, control, monkeypatch):
    # the shapes of K=128 (the attention's output projection, the MLP's down projection) lose; the rest win
    monkeypatch.setattr(xrt, "measure_costs",
                        lambda runner, *a: (2e-3, 1e-3) if runner.design.K == 128 else (1e-6, 1e-3))
    table = fake_pyxrt.write_design_table(tmp_path / "designs", [(s.K, s.N) for s in gemm_shapes([ckpt], "bf16")])
    served = load_model("tiny", ckpt, weight_format="bf16", backend="auto", xrt_design=table)
    try:
        d = served.describe()
        assert d["backend"] == "xrt-simulator"
        layers = d["layer_placement"]
        assert set(layers) == {"0", "1"}
        for placed in layers.values():
            for name in ("attn.o", "mlp.down"):
                assert placed[name].startswith("the host is faster (1-row pass: NPU 2.000 ms, host 1.000 ms)")
            assert all(placed[n] == "npu" for n in ("attn.q", "attn.k", "attn.v", "mlp.gate", "mlp.up"))
    finally:
        served.model.backend.close()
