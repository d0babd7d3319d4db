"""The NPU backend against the pyxrt SIMULATOR (tests/fake_pyxrt.py): design table, call
protocol, run states, the start-up check. Nothing here is evidence about a real NPU; the
`npu`-marked tests at the end are, and they skip without one."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import structlog

import fake_pyxrt
from kernels import xrt
from kernels.select import default_backend, select_backend
from kernels.base import DeviceFault, LinearWeight, WeightFormat, fuse_linears
from kernels.xrt_check import bf16_round, tolerance
from kernels.xrt_design import DesignError, DesignTable, read_insts


@pytest.fixture
def sim(monkeypatch):
    return fake_pyxrt.install(monkeypatch)


@pytest.fixture(scope="module")
def host():
    return default_backend()


def bf16_weight(n, k, seed=0):
    w32 = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return LinearWeight(WeightFormat.BF16, (w32.view(np.uint32) >> 16).astype(np.uint16))


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


# -- the design table -----------------------------------------------------------------------

def table_json(tmp_path, **changes):
    path = fake_pyxrt.write_design_table(tmp_path, [(64, 136)])
    raw = json.loads(path.read_text())
    raw["designs"][0].update(changes.pop("entry", {}))
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


def test_design_table_loads_and_looks_up(tmp_path):
    table = DesignTable.load(fake_pyxrt.write_design_table(tmp_path, [(64, 136), (128, 64)]))
    design, why = table.lookup(64, 136, "bf16")
    assert why == "npu" and (design.compiled_K, design.compiled_N, design.M) == (64, 136, 32)
    assert design.insts.suffix == ".txt" and design.b_col_major
    assert table.lookup(64, 136, "int8")[0] is None and "runs on the host" in table.lookup(64, 136, "int8")[1]
    none, why = table.lookup(64, 137, "bf16")
    assert none is None and "no design for K=64, N=137" in why


@pytest.mark.parametrize("entry, device, message", [
    ({"M": 16}, "npu2", "M = 16 is not a multiple of tile_m * 4 = 32"),  # tile_m=16-style M fits npu1 only
    ({"compiled_K": 68}, "npu2", "compiled_K = 68 is not a multiple of tile_k = 8"),
    ({"columns": 2}, "npu2", "compiled_N = 136 is not a multiple of tile_n * columns = 16"),
    ({"tile_n": 4, "columns": 2, "compiled_N": 136}, "npu2", "tile_n = 4 is not a multiple of the npu2 bf16 micro-tile's 8"),
    ({"columns": 5}, "npu1", "columns = 5: npu1 has 4"),
    ({"dtype_out": "bf16"}, "npu2", "npud needs bf16 inputs and f32 outputs"),
    ({"weight_format": "int8"}, "npu2", "the NPU designs serve"),
    ({"compiled_N": 128}, "npu2", "smaller than the layer's"),
    ({"bfp16_emulation": True}, "npu1", "bfp16 emulation exists on npu2 only"),
    ({"M": "32"}, "npu2", "M = '32' is not an integer"),
    ({"b_col_major": 1}, "npu2", "b_col_major = 1 is not true or false"),
    ({"xclbin": "missing.xclbin"}, "npu2", "does not exist"),
])
def test_design_table_refuses_what_could_not_have_been_compiled(tmp_path, entry, device, message):
    with pytest.raises(DesignError, match=message.replace("*", r"\*").replace("(", r"\(")):
        DesignTable.load(table_json(tmp_path, entry=entry, device=device))


def test_micro_tiles_differ_between_npu1_and_npu2(tmp_path):
    # 4x8x4 on npu1; 8x8x8 on npu2 with bfp16 emulation, 4x8x8 without
    entry = {"tile_m": 4, "M": 16, "tile_n": 4, "compiled_N": 136}
    assert DesignTable.load(table_json(tmp_path, entry=entry, device="npu1"))
    with pytest.raises(DesignError, match="tile_n = 4 is not a multiple of the npu2"):
        DesignTable.load(table_json(tmp_path, entry=entry, device="npu2"))
    with pytest.raises(DesignError, match="tile_m = 4 is not a multiple of the npu2 bf16 micro-tile's 8"):
        DesignTable.load(table_json(tmp_path, entry={**entry, "tile_n": 8, "bfp16_emulation": True}, device="npu2"))


def test_design_table_file_errors(tmp_path):
    with pytest.raises(DesignError, match="cannot read"):
        DesignTable.load(tmp_path / "design.json")
    for raw, message in (([], "version"), ({"version": 1, "device": "npu3"}, "expected npu1"),
                         ({"version": 1, "device": "npu1", "designs": []}, "non-empty list")):
        (tmp_path / "design.json").write_text(json.dumps(raw))
        with pytest.raises(DesignError, match=message):
            DesignTable.load(tmp_path / "design.json")
    path = fake_pyxrt.write_design_table(tmp_path, [(64, 136)])
    raw = json.loads(path.read_text())
    raw["designs"].append(dict(raw["designs"][0]))
    path.write_text(json.dumps(raw))
    with pytest.raises(DesignError, match="a second design for K=64, N=136"):
        DesignTable.load(path)
    del raw["designs"][1]["insts"]
    path.write_text(json.dumps(raw))
    with pytest.raises(DesignError, match="missing field insts"):
        DesignTable.load(path)


def test_instruction_files_text_and_binary_read_the_same(tmp_path):
    words = np.array([0x06030100, 0x00000105, 0xFFFFFFFF, 7], np.uint32)
    (tmp_path / "insts.txt").write_text("".join(f"{w:08x}\n" for w in words) + "\n")
    (tmp_path / "insts.bin").write_bytes(words.astype("<u4").tobytes())
    assert read_insts(tmp_path / "insts.txt").tolist() == read_insts(tmp_path / "insts.bin").tolist() == words.tolist()
    (tmp_path / "bad.txt").write_text("0x12\nzz\n")
    with pytest.raises(DesignError, match="hexadecimal"):
        read_insts(tmp_path / "bad.txt")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DesignError, match="whole number of 32-bit words"):
        read_insts(tmp_path / "odd.bin")


# -- the backend on the simulator ----------------------------------------------------------

@pytest.mark.parametrize("b_col_major, insts_text", [(True, True), (False, False)])
def test_npu_rows_equal_the_host_gemm_of_bf16_inputs_for_every_batch(tmp_path, sim, host, b_col_major, insts_text):
    table = fake_pyxrt.write_design_table(tmp_path, [(72, 100)], b_col_major=b_col_major, insts_text=insts_text)
    backend = xrt.load_backend(table, host)
    assert backend.name == "xrt-simulator"  # the simulator never passes for the NPU
    w = bf16_weight(100, 72)
    w = LinearWeight(w.fmt, w.data, bias=np.linspace(-1, 1, 100).astype(np.float32))
    prepared = backend.prepare_linear(w)
    assert backend.placement == {(72, 100, "bf16"): "npu"}
    x = np.random.default_rng(1).standard_normal((70, 72)).astype(np.float32)  # three passes of M=32
    want = host.linear(bf16_round(x), prepared)
    for m in (1, 5, 32, 33, 70):
        got = backend.linear(x[:m], prepared)
        assert np.array_equal(bits(got), bits(want[:m])), m
    runs = [c for c in sim.calls if c[0] == "run"]
    assert runs and all(n == 6 for _, n in runs)  # opcode, instr, ninstr, A, B, C and nothing else


def test_the_call_sequence_syncs_inputs_before_and_output_after_each_run(tmp_path, sim, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    sim.calls.clear()
    backend.linear(np.ones((1, 64), np.float32), w)
    assert sim.calls == [("write", 3, 32 * 64 * 2), ("sync", 3, "XCL_BO_SYNC_BO_TO_DEVICE"), ("run", 6),
                         ("sync", 5, "XCL_BO_SYNC_BO_FROM_DEVICE"), ("read", 5, 32 * 64 * 4)]


def test_buffers_are_made_as_aie_utils_xrt_makes_them(tmp_path, sim, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(72, 100)]), host)
    backend.prepare_linear(bf16_weight(100, 72))
    made = [c[1:] for c in sim.calls if c[0] == "bo"]
    # instructions cacheable in group 1; A [M, cK] bf16, C [M, cN] f32, B [cN, cK] bf16 host_only
    assert made[:3] == [(1, 16 * 4, "cacheable"), (3, 32 * 72 * 2, "host_only"), (5, 32 * 104 * 4, "host_only")]
    assert made[3:] == [(4, 104 * 72 * 2, "host_only")] * 2  # the start-up check's B, then the weight's


def test_shapes_and_formats_without_a_design_run_on_the_host_said_once(tmp_path, sim, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    with structlog.testing.capture_logs() as logs:
        a = backend.prepare_linear(bf16_weight(48, 64))
        backend.prepare_linear(bf16_weight(48, 64, seed=1))
        f32 = backend.prepare_linear(LinearWeight(WeightFormat.FP32, np.ones((64, 64), np.float32)))
    said = [e for e in logs if e["event"] == "npu_shape_on_host"]
    assert [(e["K"], e["N"], e["weight_format"]) for e in said] == [(64, 48, "bf16"), (64, 64, "fp32")]
    assert "no design for K=64, N=48" in said[0]["reason"] and "runs on the host" in said[1]["reason"]
    assert np.array_equal(bits(backend.linear(x, a)), bits(host.linear(x, a)))  # fp32 x: the host's own GEMM
    assert np.array_equal(bits(backend.linear(x, f32)), bits(host.linear(x, f32)))
    assert backend.describe_placement()["64x48 bf16"].startswith("no design")


def test_the_npu_backend_keeps_every_linear_apart(tmp_path, sim, host):
    # a design is compiled for one layer's shape: fused q/k/v (the host's choice) would have none
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    parts = [bf16_weight(64, 64), bf16_weight(64, 64, seed=1)]
    assert host.fuse_linears(parts) is not None
    assert fuse_linears(backend, parts) is None


@pytest.mark.parametrize("mode, state", [("timeout", "ERT_CMD_STATE_TIMEOUT"), ("abort", "ERT_CMD_STATE_ABORT"),
                                         ("raise", None)])
def test_a_run_that_does_not_complete_raises_a_device_fault(tmp_path, sim, host, mode, state):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host, timeout_ms=250)
    w = backend.prepare_linear(bf16_weight(64, 64))
    sim.inject(mode)
    with pytest.raises(xrt.NpuRunError) as info:
        backend.linear(np.ones((2, 64), np.float32), w)
    assert isinstance(info.value, DeviceFault) and info.value.state == state
    assert (state or "RuntimeError") in str(info.value)
    if mode != "raise":
        assert "timeout 250 ms" in str(info.value)
    backend.linear(np.ones((2, 64), np.float32), w)  # the next run is good again


def test_a_kernel_the_xclbin_does_not_have_is_refused_or_sent_to_the_host(tmp_path, sim, host):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)], kernel_name="OTHER")
    with pytest.raises(xrt.XrtUnavailable, match="has no kernel 'MLIR_AIE'"):
        xrt.load_backend(table, host, strict=True)  # at load: every xclbin is read, used or not
    with structlog.testing.capture_logs() as logs:
        backend = xrt.load_backend(table, host)
    assert "has no kernel 'MLIR_AIE' (it has ['OTHER'])" in backend.placement[(64, 64, "bf16")]
    assert [e["event"] for e in logs] == ["npu_shape_on_host"]
    backend.prepare_linear(bf16_weight(64, 64))  # runs on the host, said once
    assert not [c for c in fake_pyxrt.SIM.calls if c[0] == "register_xclbin"]
    few = fake_pyxrt.write_design_table(tmp_path / "few", [(64, 64)], num_args=5)
    with pytest.raises(xrt.XrtUnavailable, match="declares 5 arguments"):
        xrt.load_backend(few, host, strict=True)
    (tmp_path / "gemm_64x64.xclbin").write_text("not an xclbin")
    with pytest.raises(xrt.XrtUnavailable, match="does not open as an xclbin"):
        xrt.load_backend(table, host, strict=True)


def test_startup_check_catches_a_design_compiled_for_another_layout(tmp_path, sim, host):
    # design.json says B is column-major; the xclbin reads it row-major: the same wrong
    # answer every time, which a self-comparison would pass
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)], b_col_major=False)
    raw = json.loads(table.read_text())
    raw["designs"][0]["b_col_major"] = True
    table.write_text(json.dumps(raw))
    with structlog.testing.capture_logs() as logs:
        backend = xrt.load_backend(table, host)
        backend.prepare_linear(bf16_weight(64, 64))
    assert backend.placement[(64, 64, "bf16")].startswith("failed the start-up check (K=64 N=64:")
    assert [e["fallback"] for e in logs if e["event"] == "kernel_self_check_failed"] == ["host"]
    with pytest.raises(xrt.XrtUnavailable, match="failed the start-up check"):
        xrt.load_backend(table, host, strict=True).prepare_linear(bf16_weight(64, 64))


def test_a_weight_the_npu_cannot_hold_says_what_to_check(tmp_path, sim, host, monkeypatch):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    backend.prepare_linear(bf16_weight(64, 64))
    runner = backend._runners[(64, 64, "bf16")]

    def refuse(w):
        raise RuntimeError("failed to allocate BO: Cannot allocate memory")

    monkeypatch.setattr(runner, "upload_weight", refuse)
    with pytest.raises(xrt.XrtUnavailable, match=r"cannot place a \[64, 64\] weight in NPU memory: failed to "
                                                 r"allocate BO.*memlock"):
        backend.prepare_linear(bf16_weight(64, 64, seed=2))


def test_startup_check_catches_nan_outputs(tmp_path, sim, host, monkeypatch):
    real_call = fake_pyxrt.kernel.__call__

    def one_nan(self, *args):
        result = real_call(self, *args)
        args[5].dev.view(np.float32)[3] = np.nan
        return result

    monkeypatch.setattr(fake_pyxrt.kernel, "__call__", one_nan)
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    backend.prepare_linear(bf16_weight(64, 64))
    assert "outputs differ from the host" in backend.placement[(64, 64, "bf16")]


def test_startup_check_catches_an_aborted_run(tmp_path, sim, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    sim.inject("abort", after=1)
    backend.prepare_linear(bf16_weight(64, 64))
    assert "ERT_CMD_STATE_ABORT" in backend.placement[(64, 64, "bf16")]


def test_rows_that_depend_on_their_place_in_a_pass_are_run_one_per_pass(tmp_path, sim, host, monkeypatch):
    real_call = fake_pyxrt.kernel.__call__

    def skewed(self, *args):  # rows after the first of a pass come out one ulp up
        result = real_call(self, *args)
        c = args[5]
        out = c.dev.view(np.float32).reshape(self.gemm["M"], -1)
        out[1:] = np.nextafter(out[1:], np.float32(np.inf))
        return result

    monkeypatch.setattr(fake_pyxrt.kernel, "__call__", skewed)
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    assert backend.placement[(64, 64, "bf16")] == "npu-rowwise"
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    batched = backend.linear(x, w)
    for i in range(5):
        assert np.array_equal(bits(backend.linear(x[i : i + 1], w)), bits(batched[i : i + 1]))


def test_numerics_identity_names_the_designs_and_where_each_shape_runs(tmp_path, sim, host):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)])
    backend = xrt.load_backend(table, host)
    before = backend.numerics_id()
    assert before.startswith("xrt-simulator/designs=") and before.endswith("/activations=bf16/accumulate=fp32")
    assert before != host.name  # never the host's identity through __getattr__
    backend.prepare_linear(bf16_weight(64, 64))
    assert backend.numerics_id() != before and '"64x64 bf16": "npu"' in backend.numerics_id()
    again = xrt.load_backend(table, host)
    again.prepare_linear(bf16_weight(64, 64))
    assert again.numerics_id() == backend.numerics_id()
    insts = tmp_path / "insts_64x64.txt"
    insts.write_text(insts.read_text() + "00000000\n")  # another build of the design
    assert xrt.load_backend(table, host).table_identity != backend.table_identity


def test_tolerance_is_the_two_summation_orders_bound():
    a = np.array([[1.0, 2.0 ** -24, -1.0]], np.float32)
    w = np.ones((1, 3), np.float32)
    assert tolerance(a, w)[0, 0] == pytest.approx(2 * 2 * 2.0 ** -24 * (2 + 2.0 ** -24))


def test_select_backend_builds_the_npu_backend_where_it_can(tmp_path, sim, monkeypatch):
    monkeypatch.setattr(xrt, "probe", lambda: (True, "/dev/accel/accel0 with pyxrt"))
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)])
    backend, why = select_backend("auto", str(table), xrt_timeout_ms=123)
    assert isinstance(backend, xrt.XrtBackend) and backend.timeout_ms == 123 and str(table) in why
    assert not backend.strict and select_backend("xrt", str(table))[0].strict
    backend, why = select_backend("auto", None)
    assert backend.name.startswith("host") and "no NPU GEMM design table" in why
    (tmp_path / "bad.json").write_text("{}")
    backend, why = select_backend("auto", str(tmp_path / "bad.json"))
    assert backend.name.startswith("host") and "version" in why
    with pytest.raises(xrt.XrtUnavailable, match="version"):
        select_backend("xrt", str(tmp_path / "bad.json"))


# -- the simulator catches what a real device would refuse ---------------------------------

def test_simulator_refuses_the_old_call_with_scalar_shape_arguments(tmp_path, sim, host):
    backend = xrt.load_backend(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    runner, bo_b = backend._weights[id(w.data)]
    runner.bo_a.sync(fake_pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="9 arguments to a kernel that declares 8"):
        runner.kernel(3, runner.bo_insts, runner.num_insts, runner.bo_a, bo_b, runner.bo_c, 32, 64, 64)
    runner.bo_a.write(np.zeros(8, np.uint8), 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="written but not synced"):
        runner.kernel(3, runner.bo_insts, runner.num_insts, runner.bo_a, bo_b, runner.bo_c)
    runner.bo_a.sync(fake_pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="ninstr"):
        runner.kernel(3, runner.bo_insts, runner.num_insts + 1, runner.bo_a, bo_b, runner.bo_c)
    runner.kernel(3, runner.bo_insts, runner.num_insts, runner.bo_a, bo_b, runner.bo_c)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="before a sync from the device"):
        runner.bo_c.read(4, 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="made cacheable"):
        runner.buffer(64, 3, fake_pyxrt.bo.cacheable)


# -- real hardware ---------------------------------------------------------------------------

NPU_DESIGN = os.environ.get("NPUD_XRT_DESIGN")
NPU_REASON = ("needs an amdxdna NPU (/dev/accel/accel*), XRT's pyxrt and NPUD_XRT_DESIGN=<design.json> "
              "built by tools/build_npu_designs.py (docs/npu.md)")


def _real_npu() -> bool:
    return bool(NPU_DESIGN) and xrt.probe()[0]


@pytest.mark.npu
@pytest.mark.skipif(not _real_npu(), reason=NPU_REASON)
def test_npu_every_design_passes_the_startup_check(host):
    backend = xrt.load_backend(NPU_DESIGN, host, strict=True)
    assert backend.name == "xrt"
    for (k, n, fmt) in backend.table.designs:
        backend.prepare_linear(bf16_weight(n, k))  # strict: a failed check raises
    assert set(backend.placement.values()) <= {"npu", "npu-rowwise"}


@pytest.mark.npu
@pytest.mark.skipif(not _real_npu(), reason=NPU_REASON)
def test_npu_rows_are_bit_identical_across_batches(host):
    backend = xrt.load_backend(NPU_DESIGN, host, strict=True)
    (k, n, _), design = next(iter(backend.table.designs.items()))
    raw = bf16_weight(n, k)
    w = backend.prepare_linear(raw)
    x = np.random.default_rng(7).standard_normal((2 * design.M + 3, k)).astype(np.float32)
    full = backend.linear(x, w)
    for m in (1, design.M, design.M + 1):
        assert np.array_equal(bits(backend.linear(x[:m], w)), bits(full[:m]))
    wf = (raw.data.astype(np.uint32) << 16).view(np.float32)
    assert np.all(np.abs(full - host.linear(bf16_round(x), w)) <= tolerance(bf16_round(x), wf))
