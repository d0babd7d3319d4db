"""The NPU device session on the pyxrt SIMULATOR (tests/fake_pyxrt.py), inline: passes over a
layer wider than one design, the hardware-context plan, the tolerance policy of each device
generation. Evidence about npud's bookkeeping, not about an NPU."""

from __future__ import annotations

import numpy as np
import pytest
import structlog

import fake_pyxrt
from npud.kernels import amdxdna, xrt
from npud.kernels.select import default_backend
from npud.kernels.xrt_check import bf16_round, tolerance
from test_xrt import bf16_weight, bits, load, reference


@pytest.fixture
def sim(monkeypatch):
    state = fake_pyxrt.install(monkeypatch)
    yield state
    assert state.violations == []


@pytest.fixture(scope="module")
def host():
    return default_backend()


def test_a_layer_wider_than_one_pass_runs_as_passes_bit_for_bit_the_host_s(tmp_path, sim, host):
    # tile_n 8 on one column: a pass moves at most 64 x 8 = 512 columns; 1100 takes 3 of 368
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 1100)])
    backend = load(table, host)
    design = backend.table.designs[(64, 1100, "bf16")]
    assert (design.n_passes, design.compiled_N) == (3, 368)
    raw = bf16_weight(1100, 64)
    w = backend.prepare_linear(raw)
    assert backend.placement[(64, 1100, "bf16")] == "npu"
    x = np.random.default_rng(4).standard_normal((33, 64)).astype(np.float32)
    sim.calls.clear()
    got = backend.linear(x, w)
    assert np.array_equal(bits(got), bits(reference(host, x, raw)))  # npu2's stock build: bfp16 blocks
    assert [c for c in sim.calls if c[0] == "run"] == [("run", 6)] * 6  # 2 chunks of M rows x 3 passes


def test_contexts_stay_within_the_budget_least_recently_used_closed_first(tmp_path, sim, host):
    shapes = [(64, 8 * (i + 1)) for i in range(8)]  # 8 designs, 8 xclbins
    table = fake_pyxrt.write_design_table(tmp_path, shapes, device="npu1", M=16, tile=(4, 8, 4))
    backend = load(table, host)  # npu1: 6 contexts, the simulator's limit too
    weights = [backend.prepare_linear(bf16_weight(n, k, seed=n)) for k, n in shapes]
    assert set(backend.placement.values()) == {"npu"}
    x = np.random.default_rng(5).standard_normal((3, 64)).astype(np.float32)
    for w in weights + weights[::-1]:
        assert np.array_equal(bits(backend.linear(x, w)), bits(host.linear(bf16_round(x), w)))
    assert sim.contexts_live == 6 and sim.contexts_made > 8  # reopened as they were used
    plan = backend.device.plan
    assert list(plan.open) == [str(tmp_path / f"gemm_64x{n}.xclbin") for _, n in shapes[:6][::-1]]


def test_without_the_plan_the_seventh_context_is_refused(tmp_path, sim, host):
    # the old way, one context per shape and never closed: the driver refuses the seventh on npu1
    shapes = [(64, 8 * (i + 1)) for i in range(7)]
    table = fake_pyxrt.write_design_table(tmp_path, shapes, device="npu1", M=16, tile=(4, 8, 4))
    backend = load(table, host, context_budget=16)
    for k, n in shapes:
        backend.prepare_linear(bf16_weight(n, k))
    assert "hardware contexts of the device are taken" in backend.placement[(64, 56, "bf16")]


def test_contexts_other_processes_hold_come_off_the_budget_where_the_driver_says(tmp_path, sim, host):
    # another program holds four of npu1's six contexts; npud's four designs take turns in the two left
    shapes = [(64, 8 * (i + 1)) for i in range(4)]
    table = fake_pyxrt.write_design_table(tmp_path, shapes, device="npu1", M=16, tile=(4, 8, 4))
    backend = load(table, host)
    sim.contexts_live += 4
    plan = backend.device.plan
    plan.device_contexts = lambda: amdxdna.ResourceInfo(contexts_limit=6, contexts_in_use=sim.contexts_live)
    weights = [backend.prepare_linear(bf16_weight(n, k, seed=n)) for k, n in shapes]
    assert set(backend.placement.values()) == {"npu"}
    x = np.random.default_rng(7).standard_normal((2, 64)).astype(np.float32)
    for w in weights + weights[::-1]:
        assert np.array_equal(bits(backend.linear(x, w)), bits(host.linear(bf16_round(x), w)))
        assert len(plan.open) <= 2
    assert plan.foreign == 4 and sim.contexts_live == 6
    sim.contexts_live -= 4  # they let go: the budget is npu1's again
    plan.room()
    assert plan.foreign == 0 and plan.room() == 6


def test_shapes_of_one_xclbin_share_its_context(tmp_path, sim, host):
    shapes = [(64, 60), (64, 64), (60, 64), (64, 8)]  # three pad to 64 x 64 with tile 8 on one column
    table = fake_pyxrt.write_design_table(tmp_path, shapes, shared_xclbins=True)
    backend = load(table, host)
    for k, n in shapes:
        backend.prepare_linear(bf16_weight(n, k))
    assert set(backend.placement.values()) == {"npu"} and sim.contexts_made == 2


@pytest.mark.parametrize("declared, placed", [(False, "failed the start-up check"), (True, "npu")])
def test_npu2_s_bfp16_build_needs_its_own_tolerance(tmp_path, sim, host, declared, placed):
    # a stock npu2 build quantises in bfp16 blocks; checked with the exact-bf16 bound it fails
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)], bfp16_emulation=declared, xclbin_bfp16=True)
    backend = load(table, host)
    with structlog.testing.capture_logs() as logs:
        backend.prepare_linear(bf16_weight(64, 64))
    assert backend.placement[(64, 64, "bf16")].startswith(placed)
    if declared:
        [passed] = [e for e in logs if e["event"] == "kernel_self_check_passed"]
        assert passed["tolerance"] == "bfp16-blocks"
        assert backend.describe_tolerance() == {"64x64 bf16": "bfp16-blocks"}
    else:
        assert "bf16-exact-products tolerance" in backend.placement[(64, 64, "bf16")]


def test_the_bfp16_bound_covers_block_quantisation_and_no_more():
    rng = np.random.default_rng(6)
    a = bf16_round(rng.standard_normal((4, 64)).astype(np.float32))
    w = bf16_round(rng.standard_normal((8, 64)).astype(np.float32))
    qa, qw = fake_pyxrt._bfp16(a, axis=1), fake_pyxrt._bfp16(w, axis=1)
    diff = np.abs(qa.astype(np.float64) @ qw.astype(np.float64).T - a.astype(np.float64) @ w.astype(np.float64).T)
    assert np.all(diff <= tolerance(a, w, "bfp16-blocks"))
    assert np.any(diff > tolerance(a, w, "bf16-exact-products"))
    with pytest.raises(ValueError, match="unknown tolerance policy"):
        tolerance(a, w, "none")


def test_a_timed_out_run_s_context_is_never_reused_by_other_shapes_of_its_xclbin(tmp_path, sim, host):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 60), (64, 64)], shared_xclbins=True)
    backend = load(table, host, timeout_ms=100)
    a, b = (backend.prepare_linear(bf16_weight(n, 64, seed=n)) for n in (60, 64))
    sim.inject("timeout")
    with pytest.raises(xrt.NpuRunError, match="ERT_CMD_STATE_TIMEOUT"):
        backend.linear(np.ones((1, 64), np.float32), a)
    with pytest.raises(xrt.NpuRunError, match="its context was retired"):
        backend.linear(np.ones((1, 64), np.float32), b)


def test_a_model_whose_designs_are_kernels_of_one_xclbin_holds_one_context(tmp_path, sim, host):
    # npu1 (6 contexts) and twelve shapes, a base and its draft: linked into one xclbin, one
    # context serves every design and nothing is closed or reopened however they take turns
    shapes = [(64, 8 * (i + 1)) for i in range(12)]
    table = fake_pyxrt.write_design_table(tmp_path, shapes, device="npu1", M=16, tile=(4, 8, 4), one_xclbin=True)
    backend = load(table, host)
    weights = [(raw, backend.prepare_linear(raw)) for raw in (bf16_weight(n, k, seed=n) for k, n in shapes)]
    assert set(backend.placement.values()) == {"npu"}
    made = sim.contexts_made
    assert made == 1 and backend.device.plan.opened == 1
    x = np.random.default_rng(6).standard_normal((2, 64)).astype(np.float32)
    for raw, w in weights + weights[::-1]:
        assert np.array_equal(bits(backend.linear(x, w)), bits(host.linear(bf16_round(x), w)))
    assert sim.contexts_made == 1 and sim.contexts_live == 1


def test_the_passes_of_a_linear_are_all_started_before_any_is_waited_for(tmp_path, sim, host):
    # 2 chunks of M rows x 3 passes: six runs queued (each its own A and C buffers), then waited
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 1100)])
    backend = load(table, host)
    raw = bf16_weight(1100, 64)
    w = backend.prepare_linear(raw)
    x = np.random.default_rng(4).standard_normal((33, 64)).astype(np.float32)
    sim.max_queued = 0
    got = backend.linear(x, w)
    assert sim.max_queued == 6 and sim.queued == 0
    assert np.array_equal(bits(got), bits(reference(host, x, raw)))
    entry = backend.device.designs[(64, 1100, "bf16")]
    assert (len(entry.a_slots), len(entry.c_slots)) == (2, 6)
    backend.linear(x, w)  # the buffers are kept for the next call
    assert (len(entry.a_slots), len(entry.c_slots)) == (2, 6)


def test_a_run_that_fails_in_a_queue_keeps_every_run_still_in_flight(tmp_path, sim, host):
    # the first two of three queued passes time out: the first is waited for and raises; the second,
    # never waited for, is still in flight and must be kept (destroying it would abort), the third ended
    import gc

    table = fake_pyxrt.write_design_table(tmp_path, [(64, 1100)])
    backend = load(table, host, timeout_ms=200)
    w = backend.prepare_linear(bf16_weight(1100, 64))
    sim.inject("timeout", after=0, times=2)
    with pytest.raises(xrt.NpuRunError, match="ERT_CMD_STATE_TIMEOUT"):
        backend.linear(np.ones((1, 64), np.float32), w)
    gc.collect()
    assert sim.violations == []  # no run collected in flight
    assert len(backend.device.in_flight) == 2
    backend.device.poll()
    backend.device.poll()
    assert backend.device.poll() == 0  # both end (the simulator completes them after a few polls)


def test_chunk_plan_takes_the_largest_m_while_more_is_left_then_the_smallest_that_holds_the_rest():
    from npud.kernels.xrt_device import chunk_plan

    assert chunk_plan(1, [32, 64, 128]) == [(1, 32)]
    assert chunk_plan(32, [32, 64, 128]) == [(32, 32)]
    assert chunk_plan(33, [32, 64, 128]) == [(33, 64)]
    assert chunk_plan(200, [32, 64, 128]) == [(128, 128), (72, 128)]
    assert chunk_plan(300, [32, 128]) == [(128, 128), (128, 128), (44, 128)]
    assert chunk_plan(40, [16]) == [(16, 16), (16, 16), (8, 16)]
    assert chunk_plan(0, [16]) == []


def _a_writes(sim):
    """The bytes written to each A buffer (a chunk's rows, compiled K bf16 values each)."""
    return [c[2] for c in sim.calls if c[0] == "write" and c[1] == 3]


@pytest.mark.parametrize("device, m, more", [("npu1", 16, (64, 128)), ("npu2", 32, (64, 128))])
def test_each_chunk_of_rows_runs_on_the_smallest_m_that_holds_it_with_the_same_bits(tmp_path, sim, host, device,
                                                                                     m, more):
    tiling = dict(device="npu1", M=16, tile=(4, 8, 4), columns=4) if device == "npu1" else dict(device="npu2")
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 100)], more_m=more, **tiling)
    backend = load(table, host)
    raw = bf16_weight(100, 64)
    w = backend.prepare_linear(raw)
    assert backend.sizes[(64, 100, "bf16")] == [m, *more]
    ck, cn = backend.table.designs[(64, 100, "bf16")].compiled_K, backend.table.designs[(64, 100, "bf16")].compiled_N
    assert backend.device.weight_bytes == 2 * ck * cn * 2  # the start-up check's B and the weight: the larger M
    # were tried with the weight itself, no upload of their own
    x = np.random.default_rng(6).standard_normal((300, 64)).astype(np.float32)
    one_row = np.concatenate([backend.linear(x[i : i + 1], w) for i in range(0, 300, 37)])
    for rows, ms, chunks in ((1, [m], [1]), (m + 1, [64], [m + 1]), (100, [128], [100]),
                             (300, [128, 128, 64], [128, 128, 44])):
        sim.calls.clear()
        sim.run_m.clear()
        got = backend.linear(x[:rows], w)
        assert sim.run_m == ms  # one pass a chunk, on the smallest M that holds it
        assert _a_writes(sim) == [r * ck * 2 for r in chunks]  # its rows only reach the device
        assert np.array_equal(bits(got), bits(reference(host, x[:rows], raw, bfp16=device == "npu2")))
        # every row the bits it has alone in a pass of the smallest M: batch invariance across sizes
        picked = [i for i in range(0, 300, 37) if i < rows]
        assert np.array_equal(bits(got[picked]), bits(one_row[: len(picked)]))


def test_a_larger_m_whose_rows_differ_is_dropped_and_the_smallest_serves_alone(tmp_path, sim, host):
    import json

    table = fake_pyxrt.write_design_table(tmp_path, [(64, 100)], more_m=(64,), one_xclbin=True,
                                          bfp16_emulation=False)
    linked = json.loads((tmp_path / "model.xclbin").read_text())
    linked["kernels"][1]["gemm"]["bfp16"] = True  # the M = 64 build quantises: its rows differ
    (tmp_path / "model.xclbin").write_text(json.dumps(linked))
    backend = load(table, host)
    raw = bf16_weight(100, 64)
    w = backend.prepare_linear(raw)
    assert (64, 100, "bf16") not in backend.sizes
    assert [e.design.M for e in backend.device.variants[(64, 100, "bf16")]] == [32]
    x = np.random.default_rng(7).standard_normal((40, 64)).astype(np.float32)
    sim.run_m.clear()
    got = backend.linear(x, w)
    assert sim.run_m == [32, 32]  # 40 rows: two passes of 32, not one of 64
    assert np.array_equal(bits(got), bits(reference(host, x, raw, bfp16=False)))
