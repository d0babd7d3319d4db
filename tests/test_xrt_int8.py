"""int8 weights on the array, on the pyxrt SIMULATOR (tests/fake_pyxrt.py): an int8 model's
weights go to int8 designs, whose outputs stay within the stated bound of the host's int8 GEMM
(docs/npu.md, "Exactness"), follow the written-down arithmetic bit for bit, and a wrong
arithmetic anywhere on the way (the array's sums, the quantization beside it, the scaling
back) fails the start-up check. Evidence about the arithmetic and the protocol, not about an NPU."""

from __future__ import annotations

import os

import numpy as np
import pytest
import structlog

import fake_pyxrt
from npud.engine.weights import quantize_int8_rows
from npud.kernels import xrt, xrt_device
from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.select import default_backend
from npud.kernels.xrt_check import U, tolerance
from npud.kernels.xrt_design import INT8_MAX_K, DesignTable

# an npu1 and an npu2 tiling that the int8 kernels take (m, n multiples of 16, k of 8)
TILINGS = {"npu1": dict(device="npu1", M=64, tile=(16, 32, 16), columns=2),
           "npu2": dict(device="npu2", M=64, tile=(16, 32, 16), columns=4)}


@pytest.fixture
def sim(monkeypatch):
    state = fake_pyxrt.install(monkeypatch)
    yield state
    assert state.violations == []


@pytest.fixture(scope="module")
def host():
    return default_backend()


def int8_weight(n, k, seed=0, bias=False):
    rng = np.random.default_rng(seed)
    q, scale = quantize_int8_rows((rng.standard_normal((n, k)) / np.sqrt(k)).astype(np.float32))
    return LinearWeight(WeightFormat.INT8, q, scale, rng.standard_normal(n).astype(np.float32) if bias else None)


def table(tmp_path, shapes, device="npu2", **kw):
    return fake_pyxrt.write_design_table(tmp_path, shapes, weight_format="int8", **{**TILINGS[device], **kw})


def load(path, host, **kw):
    return xrt.load_backend(path, host, isolation="inline", **kw)


def documented(x: np.ndarray, w: LinearWeight) -> np.ndarray:
    """The array's int8 arithmetic as docs/npu.md writes it down, one value at a time: per row
    d = fl(max|x| / 127), id = fl(1 / d), xq_k = round-half-away(fl(x_k id)); isum = sum_k xq_k q_nk
    exactly; y = fl(fl(float(isum) d) s_n) (+ bias, rounded)."""
    f = np.float32
    out = np.empty((x.shape[0], w.out_features), np.float32)
    q64 = w.data.astype(np.int64)
    for m, row in enumerate(x.astype(np.float32)):
        d = f(np.abs(row).max()) / f(127)
        inv = f(1) / d if d != 0 else f(0)
        xq = []
        for v in row:
            t = f(v) * inv
            xq.append(int(np.sign(t)) * int(np.floor(abs(float(t)) + 0.5)))  # |t| is exact in float64
        isum = q64 @ np.array(xq, np.int64)
        for n in range(w.out_features):
            y = f(f(f(int(isum[n])) * d) * w.scale[n])
            out[m, n] = y + w.bias[n] if w.bias is not None else y
    return out


@pytest.mark.parametrize("device", ["npu1", "npu2"])
def test_int8_weights_run_on_the_array_within_the_bound_of_the_host_and_as_written_down(tmp_path, sim, host, device):
    k, n = 96, 80  # K past one tile_k, N padded up to the tiles, a partial last pass of rows
    backend = load(table(tmp_path, [(k, n)], device), host)
    w = int8_weight(n, k, bias=True)
    prepared = backend.prepare_linear(w)
    assert backend.where(prepared) == "npu" and backend.describe_tolerance() == {f"{k}x{n} int8": "int8-rows"}
    rng = np.random.default_rng(1)
    ties = np.resize(np.float32([127, 0.5, -0.5, 1.5, -2.5, 3.5, 126.5, -126.5]), k)  # d = 1: x id lands on halves
    for rows in (1, 5, 64, 2 * 64 + 3):
        x = rng.standard_normal((rows, k)).astype(np.float32) * np.float32(3)
        x[rows // 2] = ties
        got = backend.linear(x, prepared)
        want = host.linear(x, prepared)  # the host's int8 GEMM of the same weight, fp32 activations
        bound = tolerance(x, w.data.astype(np.float32), "int8-rows", w.scale)
        bound += 2 * U * (np.abs(want) + np.abs(w.bias)[None, :] + bound) * (1 + U)  # the bias add's two roundings
        assert (np.abs(got.astype(np.float64) - want) <= bound).all()
        assert np.array_equal(got.view(np.uint32), documented(x, w).view(np.uint32))
        assert not np.array_equal(got, want)  # the bound is needed: int8 activations are not fp32 ones


def test_an_int8_row_does_not_depend_on_its_batch(tmp_path, sim, host):
    backend = load(table(tmp_path, [(64, 48)]), host)
    prepared = backend.prepare_linear(int8_weight(48, 64))
    x = np.random.default_rng(3).standard_normal((70, 64)).astype(np.float32)
    x[5] *= 1000  # a row's scale is its own: a loud neighbour changes nothing
    batched = backend.linear(x, prepared)
    for i in (0, 4, 6, 63, 64, 69):
        assert np.array_equal(backend.linear(x[i : i + 1], prepared).view(np.uint32), batched[i : i + 1].view(np.uint32))


def test_a_non_finite_activation_row_gives_nan_outputs_not_numbers(tmp_path, sim, host):
    backend = load(table(tmp_path, [(64, 48)]), host)
    prepared = backend.prepare_linear(int8_weight(48, 64))
    x = np.random.default_rng(4).standard_normal((3, 64)).astype(np.float32)
    x[1, 7] = np.inf
    out = backend.linear(x, prepared)
    assert np.isnan(out[1]).all() and np.isfinite(out[[0, 2]]).all()


def test_int8_weights_take_half_the_bytes_of_bf16_on_the_device(tmp_path, sim, host):
    k, n = 128, 128  # no padding: the B buffers hold the weight's own bytes
    path = fake_pyxrt.write_design_table(tmp_path, [(k, n, "bf16"), (k, n, "int8")], **TILINGS["npu2"])
    backend = load(path, host)
    w8 = int8_weight(n, k)
    wb = LinearWeight(WeightFormat.BF16, (np.ones((n, k), np.float32).view(np.uint32) >> 16).astype(np.uint16))
    backend.prepare_linear(w8)
    backend.prepare_linear(wb)
    resident = backend.stats()["weight_bytes_resident"]  # the start-up checks' weights are gone
    assert resident == {"bf16": k * n * 2, "int8": k * n}
    assert backend.describe_tolerance() == {f"{k}x{n} bf16": "bfp16-blocks", f"{k}x{n} int8": "int8-rows"}


def test_an_int8_weight_goes_through_the_worker_process_with_its_scale(tmp_path, sim, host, monkeypatch):
    monkeypatch.setattr(xrt, "probe", lambda: (True, "simulated"))
    backend = xrt.load_backend(table(tmp_path, [(64, 48)]), host, isolation="process")
    try:
        w = int8_weight(48, 64, bias=True)
        prepared = backend.prepare_linear(w)
        x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
        assert np.array_equal(backend.linear(x, prepared).view(np.uint32), documented(x, w).view(np.uint32))
    finally:
        backend.close()


def _wrap16(a, b):  # the sums in a 16-bit accumulator
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int16).astype(np.int32)


def _unsigned_b(a, b):  # B's bytes read as uint8: the weights' signs lost
    return (a.astype(np.int64) @ b.view(np.uint8).astype(np.int64)).astype(np.int32)


def _low_bit_lost(a, b):  # the sums with their lowest bit dropped: within the bound, not the exact sums
    return (a.astype(np.int64) @ b.astype(np.int64)).astype(np.int32) & np.int32(~1)


def _no_row_scale(isum, d, scale):  # the activation's scale left out
    return isum.astype(np.float32) * scale.astype(np.float32)[None, :]


def _scale_by_column_of_row(isum, d, scale):  # one row's scale applied to every row
    return (isum.astype(np.float32) * d[:1, None]) * scale.astype(np.float32)[None, :]


def _quantize_by_max_of_batch(x):  # one scale for the whole batch: rows depend on each other
    q, d = REAL_QUANTIZE(x.reshape(1, -1))
    return q.reshape(x.shape), np.repeat(d, x.shape[0])


def _quantize_dropping_signs(x):  # |xq| for xq: the activations' signs lost
    q, d = REAL_QUANTIZE(x)
    return np.abs(q), d


REAL_QUANTIZE = xrt_device.quantize_rows


@pytest.mark.parametrize("where, name, mutant", [
    (fake_pyxrt, "int8_gemm", _wrap16),
    (fake_pyxrt, "int8_gemm", _unsigned_b),
    (fake_pyxrt, "int8_gemm", _low_bit_lost),  # caught by the exact sums, not by the bound
    (xrt_device, "dequantize", _no_row_scale),
    (xrt_device, "quantize_rows", _quantize_dropping_signs),
])
def test_a_wrong_int8_arithmetic_fails_the_startup_check(tmp_path, sim, host, monkeypatch, where, name, mutant):
    monkeypatch.setattr(where, name, mutant)
    backend = load(table(tmp_path, [(256, 48)]), host)
    with structlog.testing.capture_logs() as logs:
        prepared = backend.prepare_linear(int8_weight(48, 256))
    assert backend.where(prepared).startswith("failed the start-up check")
    assert any(e["event"] == "kernel_self_check_failed" for e in logs)


@pytest.mark.parametrize("name, mutant, where", [
    ("dequantize", _scale_by_column_of_row, "failed the start-up check"),  # off the bound
    # within the bound (coarser), but the passes' chunks are not the whole batch: not the exact sums
    ("quantize_rows", _quantize_by_max_of_batch, "failed the start-up check"),
])
def test_an_arithmetic_that_mixes_rows_is_caught(tmp_path, sim, host, monkeypatch, name, mutant, where):
    monkeypatch.setattr(xrt_device, name, mutant)
    backend = load(table(tmp_path, [(64, 48)]), host)
    prepared = backend.prepare_linear(int8_weight(48, 64))
    assert backend.where(prepared).startswith(where)


def test_the_int8_bound_is_the_quantization_error_and_the_roundings():
    x = np.array([[1.0, -0.5, 0.25, 127.0]], np.float32)
    q = np.array([[1, 2, -3, 4]], np.float32)
    s = np.array([0.5])
    d = 127.0 / 127.0 * (1 + U)
    da = d * (0.5 + 2.0**-16)
    want = 0.5 * (da * 10 * (1 + 4 * U) + 2 * (4 + 4) * U * (1 + 1 + 0.75 + 508))
    assert tolerance(x, q, "int8-rows", s)[0, 0] == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="needs the weight's scale"):
        tolerance(x, q, "int8-rows")


def test_the_table_refuses_an_int8_k_the_int32_sums_could_overflow(tmp_path):
    assert INT8_MAX_K * 128 * 128 <= 2**31 - 1 < (INT8_MAX_K + 1) * 128 * 128
    k = -(-(INT8_MAX_K + 1) // 32) * 32
    with pytest.raises(ValueError, match="overflow the int32 accumulator"):
        table(tmp_path, [(k, 64)])
    assert DesignTable.load(table(tmp_path / "ok", [(64, 64)])).lookup(64, 64, "int8")[1] == "npu"


def test_an_int8_design_refuses_a_bf16_weight_and_a_weight_without_its_scale(tmp_path, sim, host):
    backend = load(table(tmp_path, [(64, 48)]), host)
    runner = backend._runner((64, 48, "int8"))
    with pytest.raises(ValueError, match="the design takes int8"):
        backend.device.upload(runner.design.key, np.zeros((48, 64), np.uint16))
    with pytest.raises(ValueError, match="needs its scale per output row"):
        backend.device.upload(runner.design.key, np.zeros((48, 64), np.int8))


# -- an int8 model end to end ------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from npud.engine.testing.checkpoints import build_tiny_checkpoint
    from test_gemma3 import BASE, build_gemma3_checkpoint

    root = tmp_path_factory.mktemp("int8")
    return {"qwen3": build_tiny_checkpoint(root / "qwen3", "qwen3"),
            "gemma3": build_gemma3_checkpoint(root / "gemma3", BASE)}


def _int8_model(ckpt, tmp_path, device, **kw):
    from npud.engine.model import Model

    shapes = [(s.K, s.N) for s in fake_pyxrt.build_tool().gemm_shapes([ckpt], "int8")]
    path = table(tmp_path / "designs", shapes, device, one_xclbin=True)
    return Model.load(ckpt, "int8", xrt.load_backend(path, default_backend(), strict=True, **kw))


@pytest.mark.parametrize("device", ["npu1", "npu2"])
@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
def test_an_int8_model_runs_every_linear_on_the_array_in_one_round_trip_a_layer(ckpts, tmp_path, sim, arch, device):
    from npud.engine.forward import Forward
    from npud.engine.packed import layer_group_for

    model = _int8_model(ckpts[arch], tmp_path, device)
    try:
        assert set(model.backend.describe_tolerance().values()) == {"int8-rows"}
        assert set(model.backend.stats()["weight_bytes_resident"]) == {"int8"}
        assert layer_group_for(model) is not None
        prompt = [(i * 37 + 11) % 320 for i in range(20)]

        def decode():
            f = Forward(model)
            logits, trips = [f.prefill(prompt)], []
            for _ in range(4):
                before = model.backend.device.round_trips
                logits.append(f.step(int(np.argmax(logits[-1])), f.positions_held))
                trips.append(model.backend.device.round_trips - before)
            return [lg.view(np.uint32).copy() for lg in logits], trips

        grouped, trips = decode()
        assert trips == [model.config.num_layers] * 4  # layer 0's projections beside the embedding, on the host
        model._layer_group = None  # the per-op path: the same int8 arithmetic, one call per linear
        per_op, _ = decode()
        assert all(np.array_equal(a, b) for a, b in zip(grouped, per_op))
    finally:
        model.backend.close()


def test_every_linear_of_an_int8_model_is_within_the_bound_of_the_host(ckpts, tmp_path, sim, host, monkeypatch):
    from npud.engine.forward import Forward

    raw, seen = {}, []
    real_prepare, real_linear = xrt.XrtBackend.prepare_linear, xrt.XrtBackend.linear

    def prepare(self, w):
        out = real_prepare(self, w)
        raw[id(out.data)] = w
        return out

    def linear(self, x, w):
        out = real_linear(self, x, w)
        if id(w.data) in self._weights:
            seen.append((x.copy(), w, out.copy()))
        return out

    monkeypatch.setattr(xrt.XrtBackend, "prepare_linear", prepare)
    monkeypatch.setattr(xrt.XrtBackend, "linear", linear)
    model = _int8_model(ckpts["qwen3"], tmp_path, "npu2", isolation="inline")
    try:
        model._layer_group = None  # every linear through backend.linear
        f = Forward(model)
        f.step(int(np.argmax(f.prefill([(i * 37 + 11) % 320 for i in range(12)]))), f.positions_held)
        assert len(seen) >= 2 * (7 * model.config.num_layers - 3 + 1)  # layer 0's q, k, v on the host
        for x, w, got in seen:
            want = host.linear(x, w)  # the host's int8 GEMM of the same rows and weight
            q = raw[id(w.data)]
            bound = tolerance(x, q.data.astype(np.float32), "int8-rows", q.scale)
            if q.bias is not None:
                bound += 2 * U * (np.abs(want) + np.abs(q.bias)[None, :] + bound) * (1 + U)
            assert (np.abs(got.astype(np.float64) - want) <= bound).all()
    finally:
        model.backend.close()


def test_a_row_too_small_for_a_normal_scale_is_zeros_within_the_bound(tmp_path, sim, host):
    backend = load(table(tmp_path, [(64, 48)]), host)
    w = int8_weight(48, 64)
    prepared = backend.prepare_linear(w)
    x = np.random.default_rng(6).standard_normal((2, 64)).astype(np.float32)
    x[1] *= np.float32(1e-38)  # d = max|x| / 127 would be subnormal (and 1 / d overflow)
    got = backend.linear(x, prepared)
    assert np.all(got[1] == 0) and np.isfinite(got).all()
    bound = tolerance(x, w.data.astype(np.float32), "int8-rows", w.scale)
    assert (np.abs(got.astype(np.float64) - host.linear(x, prepared)) <= bound).all()


def test_placement_by_measured_cost_covers_int8_shapes(tmp_path, sim, host, monkeypatch):
    # the int8 K = 128 shape loses on cost (injected), the other stays on the array
    monkeypatch.setattr(xrt, "measure_costs",
                        lambda runner, *a: (2e-3, 1e-3) if runner.design.K == 128 else (1e-6, 1e-3))
    backend = load(table(tmp_path, [(64, 48), (128, 48)]), host)
    near, far = backend.prepare_linear(int8_weight(48, 64)), backend.prepare_linear(int8_weight(48, 128))
    assert backend.where(near) == "npu" and backend.where(far).startswith("the host is faster")
    x = np.random.default_rng(7).standard_normal((2, 128)).astype(np.float32)
    assert np.array_equal(backend.linear(x, far).view(np.uint32), host.linear(x, far).view(np.uint32))
    assert backend.stats()["weight_bytes_resident"] == {"int8": 64 * 64}  # the lost shape's B buffer went


def test_an_int8_model_served_through_the_worker_decodes_and_says_its_tolerance(ckpts, tmp_path, sim, monkeypatch):
    from npud.engine.api import GenerateRequest, GenerationParams
    from npud.engine.loader import load_model

    monkeypatch.setattr(xrt, "probe", lambda: (True, "simulated"))
    ckpt = ckpts["qwen3"]
    shapes = [(s.K, s.N) for s in fake_pyxrt.build_tool().gemm_shapes([ckpt], "int8")]
    served = load_model("tiny", ckpt, weight_format="int8", backend="xrt",
                        xrt_design=table(tmp_path / "designs", shapes, "npu1", one_xclbin=True))
    try:
        backend = served.model.backend
        assert backend.isolation == "process" and set(backend.describe_tolerance().values()) == {"int8-rows"}
        session = served.start(GenerateRequest(prompt="def add(a, b):", params=GenerationParams(max_tokens=6)))
        while not session.done:
            session.run_round()
        assert len(session.result().token_ids) == 6 and backend.stats()["passes"] > 0
    finally:
        served.model.backend.close()


# -- real hardware ---------------------------------------------------------------------------

NPU_DESIGN = os.environ.get("NPUD_XRT_DESIGN")


def _real_npu() -> bool:
    return bool(NPU_DESIGN) and xrt.probe()[0]


@pytest.mark.npu
@pytest.mark.skipif(not _real_npu(), reason="needs an amdxdna NPU, XRT's pyxrt and NPUD_XRT_DESIGN=<design.json> "
                                            "with int8 designs (tools/build_npu_designs.py --weight-format int8)")
def test_npu_int8_designs_are_the_written_down_arithmetic(host):
    backend = xrt.load_backend(NPU_DESIGN, host, strict=True)  # strict: a failed start-up check raises
    try:
        int8 = [(key, d) for key, d in sorted(backend.table.designs.items()) if key[2] == "int8"]
        if not int8:
            pytest.skip(f"{NPU_DESIGN} has no int8 design")
        for (k, n, _), design in int8:
            w = int8_weight(n, k, seed=k + n, bias=True)
            prepared = backend.prepare_linear(w)
            x = np.random.default_rng(k).standard_normal((design.M + 3, k)).astype(np.float32)
            got = backend.linear(x, prepared)
            assert np.array_equal(got.view(np.uint32), documented(x, w).view(np.uint32)), (k, n)
            for m in (1, design.M + 1):
                assert np.array_equal(backend.linear(x[:m], prepared).view(np.uint32), got[:m].view(np.uint32))
    finally:
        backend.close()


def test_the_numerics_identity_names_the_int8_arithmetic_only_where_the_table_has_it(tmp_path, sim, host):
    bf16_only = load(fake_pyxrt.write_design_table(tmp_path / "a", [(64, 64)]), host)
    assert bf16_only.numerics_id().endswith("/activations=bf16/accumulate=fp32")  # as before int8 designs existed
    mixed = load(fake_pyxrt.write_design_table(tmp_path / "b", [(64, 64, "bf16"), (64, 64, "int8")], M=64,
                                               tile=(16, 32, 16), columns=4), host)
    assert mixed.numerics_id().endswith("/int8=activations-int8-per-row/accumulate-int32")
