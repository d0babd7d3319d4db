"""End to end through the NPU backend on the pyxrt SIMULATOR (tests/fake_pyxrt.py): a bf16
model served with backend "xrt" decodes the same greedy tokens as on the host, for every
speculative method. Evidence about the backend's protocol and arithmetic, not about an NPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import fake_pyxrt
from checkpoints import build_tiny_checkpoint
from engine.session import GenerateRequest, ServedModel, SpecParams
from kernels import xrt

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from build_npu_designs import gemm_shapes  # noqa: E402

PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("xrt") / "qwen3", "qwen3")


@pytest.fixture(scope="module")
def host_served(ckpt):
    return ServedModel.load("tiny", ckpt, draft_dir=ckpt, weight_format="bf16", backend="host")


@pytest.fixture
def npu_served(ckpt, tmp_path, monkeypatch):
    sim = fake_pyxrt.install(monkeypatch)
    monkeypatch.setattr(xrt, "probe", lambda: (True, "simulated accel0 with tests/fake_pyxrt.py"))
    shapes = [(s.K, s.N) for s in gemm_shapes([ckpt], "bf16")]
    table = fake_pyxrt.write_design_table(tmp_path / "designs", shapes)
    served = ServedModel.load("tiny", ckpt, draft_dir=ckpt, weight_format="bf16", backend="xrt",
                              xrt_design=table, xrt_timeout_ms=1000)
    return served, sim


def drive(session):
    while not session.done:
        session.run_round()
    return session.result()


@pytest.mark.parametrize("method", ["none", "ngram", "draft"])
def test_greedy_output_through_the_simulated_npu_equals_the_host(host_served, npu_served, method):
    served, sim = npu_served
    d = served.describe()
    assert d["backend"] == "xrt-simulator"
    assert set(d["gemm_placement"].values()) == {"npu"} and len(d["gemm_placement"]) == 4
    req = GenerateRequest(prompt=PROMPT, max_tokens=24, spec=SpecParams(method=method, k=4))
    before = sim.runs
    got = drive(served.start(req))
    want = drive(host_served.start(req))
    assert list(got.token_ids) == list(want.token_ids) and got.text == want.text
    assert sim.runs > before  # the GEMMs did go through the simulated device


def test_a_failed_run_mid_generation_raises_a_device_fault(npu_served):
    served, sim = npu_served
    session = served.start(GenerateRequest(prompt=PROMPT, max_tokens=24))
    session.run_round()
    sim.inject("timeout")
    from engine.session import DeviceFault

    with pytest.raises(DeviceFault, match="ERT_CMD_STATE_TIMEOUT"):
        while not session.done:
            session.run_round()
