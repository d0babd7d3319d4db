"""The NPU layer group (npud/kernels/layers.py, npud/kernels/xrt.py NpuLayerGroup) on the pyxrt
SIMULATOR in the NPU worker: one worker round trip per layer (the first layer's projections run on
the host beside the embedding) instead of one per linear, with the bits of the per-op path, for a Qwen3 and a
Gemma 3 (sandwich norms, sliding windows, GELU) model, npu1 and npu2 (bfp16) designs alike."""

from __future__ import annotations

import numpy as np
import pytest

import fake_pyxrt
from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.engine.packed import layer_group_for
from npud.engine.testing.checkpoints import build_tiny_checkpoint
from npud.kernels import xrt
from npud.kernels.select import default_backend
from test_gemma3 import BASE, build_gemma3_checkpoint

gemm_shapes = fake_pyxrt.build_tool().gemm_shapes
TILINGS = {"npu1": dict(device="npu1", M=16, tile=(4, 8, 4), columns=4), "npu2": dict(device="npu2")}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("layers")
    return {"qwen3": build_tiny_checkpoint(root / "qwen3", "qwen3"),
            "gemma3": build_gemma3_checkpoint(root / "gemma3", BASE)}


@pytest.fixture
def sim(monkeypatch):
    return fake_pyxrt.install(monkeypatch)


def _model(ckpt, tmp_path, device):
    table = fake_pyxrt.write_design_table(tmp_path / "designs", [(s.K, s.N) for s in gemm_shapes([ckpt], "bf16")],
                                          one_xclbin=True, **TILINGS[device])
    backend = xrt.load_backend(table, default_backend(), strict=True)
    return Model.load(ckpt, "bf16", backend)


def _decode(model, prompt, steps):
    """Prefill, then greedy steps; every pass's logits (their bits) and the backend's round trips
    of each decode step."""
    f = Forward(model)
    logits = [f.prefill(prompt)]
    trips = []
    for _ in range(steps):
        before = model.backend.device.round_trips
        logits.append(f.step(int(np.argmax(logits[-1])), f.positions_held))
        trips.append(model.backend.device.round_trips - before)
    return [lg.view(np.uint32).copy() for lg in logits], trips


@pytest.mark.parametrize("device", ["npu1", "npu2"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_one_round_trip_per_layer_and_the_bits_of_the_per_op_path(ckpts, tmp_path, sim, arch, device):
    model = _model(ckpts[arch], tmp_path, device)
    try:
        layers = model.config.num_layers
        prompt = [(i * 37 + 11) % 320 for i in range(20)]
        assert layer_group_for(model) is not None
        grouped, trips = _decode(model, prompt, 6)
        assert trips == [layers] * 6  # one call per layer; layer 0's projections on the host
        model._layer_group = None  # the per-op path: one call per linear, layer 0's q, k, v on the host
        per_op, trips_per_op = _decode(model, prompt, 6)
        assert trips_per_op == [7 * layers - 3 + 1] * 6
        assert all(np.array_equal(a, b) for a, b in zip(grouped, per_op))
    finally:
        model.backend.close()


def test_a_linear_off_the_npu_keeps_the_per_op_path(ckpts, tmp_path, sim, monkeypatch):
    # the MLP's down projection (K=128) loses on cost: that layer's stretch needs the host's GEMM
    monkeypatch.setattr(xrt, "measure_costs",
                        lambda runner, *a: (2e-3, 1e-3) if runner.design.K == 128 else (1e-6, 1e-3))
    table = fake_pyxrt.write_design_table(tmp_path / "designs", [(s.K, s.N) for s in gemm_shapes([ckpts["qwen3"]],
                                                                                                  "bf16")])
    model = Model.load(ckpts["qwen3"], "bf16", xrt.load_backend(table, default_backend()))
    try:
        assert layer_group_for(model) is None
    finally:
        model.backend.close()


def test_a_pass_that_taps_layers_keeps_the_per_op_path_and_its_taps(ckpts, tmp_path, sim):
    # a DFlash drafter reads the base's hidden rows after some layers: the layer group returns no
    # such rows, so a pass asked for taps runs op by op and hands them over, the same bits either way
    model = _model(ckpts["qwen3"], tmp_path, "npu1")
    try:
        prompt = [(i * 37 + 11) % 320 for i in range(12)]
        taps = []
        f = Forward(model)
        f.set_layer_taps((0, 1), taps)
        before = model.backend.device.round_trips
        tapped = f.prefill(prompt)
        assert model.backend.device.round_trips - before == 7 * model.config.num_layers - 3 + 1  # op by op
        assert len(taps) == 1 and taps[0].shape == (len(prompt), 2 * model.config.hidden_size)
        plain = Forward(model).prefill(prompt)  # no taps: the layer group
        assert np.array_equal(tapped.view(np.uint32), plain.view(np.uint32))
    finally:
        model.backend.close()


def test_layer_0_s_projections_run_on_the_host_said_and_named_in_the_numerics(ckpts, tmp_path, sim):
    # the one stretch with no worker call before it: placed on the host at load (before any pass),
    # where() says why, the numerics identity names it, and the other layers' q, k, v stay on the NPU
    model = _model(ckpts["qwen3"], tmp_path, "npu2")
    try:
        b, layers = model.backend, model.weights.layers
        for name in ("q", "k", "v"):
            assert b.where(getattr(layers[0].attn, name)) == xrt.FIRST_ON_HOST
            assert b.where(getattr(layers[1].attn, name)) == "npu"
        assert b.where(layers[0].attn.o) == "npu" and b.where(layers[0].mlp.down) == "npu"
        assert "/first_projections=host" in b.numerics_id()
        assert model._layer_group is not None  # built by Model.load, not by the first pass
        # with the activations every GEMM of the backend reads: rounded to bf16
        q = layers[0].attn.q
        x = np.random.default_rng(3).standard_normal((3, q.in_features)).astype(np.float32)
        want = b.host.linear(xrt.bf16_round(x), q)
        assert np.array_equal(b.linear(x, q).view(np.uint32), want.view(np.uint32))
        assert not np.array_equal(b.host.linear(x, q).view(np.uint32), want.view(np.uint32))
    finally:
        model.backend.close()


def test_a_layer_group_queues_the_linears_of_one_input(ckpts, tmp_path, sim):
    # q, k and v (of layer i + 1), gate and up: started together, one wait each after the last start
    table = fake_pyxrt.write_design_table(tmp_path / "designs", [(s.K, s.N) for s in gemm_shapes([ckpts["qwen3"]],
                                                                                                  "bf16")],
                                          one_xclbin=True, device="npu2")
    model = Model.load(ckpts["qwen3"], "bf16", xrt.load_backend(table, default_backend(), strict=True,
                                                                 isolation="inline"))
    try:
        f = Forward(model)
        logits = f.prefill([5, 6, 7, 8])
        sim.max_queued = 0
        f.step(int(np.argmax(logits)), f.positions_held)
        assert sim.max_queued == 3 and sim.queued == 0  # one chunk, one pass each: q, k, v at once
    finally:
        model.backend.close()
