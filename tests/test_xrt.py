"""The NPU backend against the pyxrt SIMULATOR (tests/fake_pyxrt.py): design table, call
protocol, run states, the start-up check. Nothing here is evidence about a real NPU; the
`npu`-marked tests at the end are, and they skip without one."""

from __future__ import annotations

import json
import re
import os

import numpy as np
import pytest
import structlog

import fake_pyxrt
from npud.kernels import xrt
from npud.kernels.select import default_backend, select_backend
from npud.kernels.base import DeviceFault, LinearWeight, WeightFormat, fuse_linears
from npud.kernels.xrt_check import bf16_round, tolerance
from npud.kernels.xrt_design import DesignError, DesignTable, read_insts


@pytest.fixture
def sim(monkeypatch):
    state = fake_pyxrt.install(monkeypatch)
    yield state
    assert state.violations == []  # e.g. a run collected in flight: a real XRT aborts the process


@pytest.fixture(scope="module")
def host():
    return default_backend()


def load(table, host, **kw):
    """The backend with its device session in this process: the simulator sees every call."""
    return xrt.load_backend(table, host, isolation="inline", **kw)


def bf16_weight(n, k, seed=0):
    w32 = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    return LinearWeight(WeightFormat.BF16, (w32.view(np.uint32) >> 16).astype(np.uint16))


def bits(a):
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def reference(host, x, w: LinearWeight, bfp16: bool = True) -> np.ndarray:
    """What a design computes for x [M, K] and the raw weight `w` ([N, K], bf16 bits, its bias
    too): the host's in-order fp32 GEMM of the bf16-rounded inputs, quantised first in bfp16
    blocks of 8 along K when the design emulates bf16 with bfp16 (npu2's stock build: the
    simulator's fake_pyxrt._bfp16; a quantised value has 8 significant bits, so it is still a
    bf16 value and the host multiplies it exactly)."""
    xq = bf16_round(x)
    data = w.data
    if bfp16:
        xq = fake_pyxrt._bfp16(xq, axis=1)
        wf = (w.data.astype(np.uint32) << 16).view(np.float32)
        data = (fake_pyxrt._bfp16(wf, axis=1).view(np.uint32) >> 16).astype(np.uint16)
    return host.linear(xq, host.prepare_linear(LinearWeight(w.fmt, data, bias=w.bias)))


# -- the design table -----------------------------------------------------------------------

def table_json(tmp_path, **changes):
    path = fake_pyxrt.write_design_table(tmp_path, [(64, 136)], bfp16_emulation=False)  # entries say otherwise
    raw = json.loads(path.read_text())
    raw["designs"][0].update(changes.pop("entry", {}))
    raw.update(changes)
    path.write_text(json.dumps(raw))
    return path


def test_design_table_loads_and_looks_up(tmp_path):
    table = DesignTable.load(fake_pyxrt.write_design_table(tmp_path, [(64, 136), (128, 64)]))
    design, why = table.lookup(64, 136, "bf16")
    assert why == "npu" and (design.compiled_K, design.compiled_N, design.M) == (64, 136, 32)
    assert design.insts.suffix == ".bin" and design.insts_format == "binary" and not design.b_col_major
    assert design.n_passes == 1
    assert table.lookup(64, 136, "int8-q8")[0] is None and "runs on the host" in table.lookup(64, 136, "int8-q8")[1]
    assert table.lookup(64, 136, "int8")[0] is None and "no design for K=64, N=136, int8" in table.lookup(64, 136, "int8")[1]
    none, why = table.lookup(64, 137, "bf16")
    assert none is None and "no design for K=64, N=137" in why


@pytest.mark.parametrize("entry, device, message", [
    ({"M": 16}, "npu2", "M = 16 is not a multiple of tile_m * 4 = 32"),  # tile_m=16-style M fits npu1 only
    ({"compiled_K": 68}, "npu2", "compiled_K = 68 is not a multiple of tile_k = 8"),
    ({"columns": 2}, "npu2", "compiled_N = 136 is not a multiple of tile_n * columns = 16"),
    ({"tile_n": 4, "columns": 2, "compiled_N": 136}, "npu2", "tile_n = 4 is not a multiple of the npu2 bf16 micro-tile's 8"),
    ({"columns": 5}, "npu1", "columns = 5: npu1 has 4"),
    ({"dtype_out": "bf16"}, "npu2", "a bf16 design takes bf16 inputs and gives f32 outputs"),
    ({"weight_format": "q4_k"}, "npu2", "the NPU designs serve"),
    ({"weight_format": "int8"}, "npu2", "a int8 design takes i8 inputs and gives i32 outputs"),
    ({"dtype_in": "i8", "dtype_out": "i32"}, "npu2", "a bf16 design takes bf16 inputs"),
    # int8 designs: integer kernels, int32 sums that must not overflow, the int8 kernel's multiples
    ({"weight_format": "int8", "dtype_in": "i8", "dtype_out": "i32", "bfp16_emulation": True}, "npu2",
     "bfp16 emulation is a bf16 kernel's"),
    ({"weight_format": "int8", "dtype_in": "i8", "dtype_out": "i32", "K": 131072, "compiled_K": 131072}, "npu2",
     "int8 sums over more than 131071 products could overflow the int32 accumulator"),
    ({"weight_format": "int8", "dtype_in": "i8", "dtype_out": "i32"}, "npu2",
     "tile_m = 8 is not a multiple of the npu2 int8 kernel's 16"),
    ({"compiled_N": 128}, "npu2", "smaller than the layer's"),
    ({"bfp16_emulation": True}, "npu1", "bfp16 emulation exists on npu2 only"),
    ({"M": "32"}, "npu2", "M = '32' is not an integer"),
    ({"b_col_major": 1}, "npu2", "b_col_major = 1 is not true or false"),
    ({"xclbin": "missing.xclbin"}, "npu2", "does not exist"),
    # the generator's asserts: its column counts, and 32-multiples with B column-major
    ({"columns": 3, "compiled_N": 144}, "npu2", "columns = 3: whole_array takes [1, 2, 4, 8] on npu2"),
    ({"b_col_major": True}, "npu2", "B column-major needs tile_m, tile_k, tile_n multiples of 32 (tile_m = 8"),
    # the verifier's transfer limits: N / (n * columns) <= 64 per pass, K / k <= 1023
    ({"N": 9000, "compiled_N": 9000}, "npu2", "A's outermost size 1125 exceeds 64"),
    ({"K": 8192 + 8, "compiled_K": 8192 + 8}, "npu2", "A's size 1 = 1025 exceeds 1023"),
    ({"N": 9000, "compiled_N": 4504, "n_passes": 2}, "npu2", "A's outermost size 563 exceeds 64"),
    ({"N": 500, "compiled_N": 256, "n_passes": 3}, "npu2", "n_passes = 3: 2 passes of 256 already cover N = 500"),
    ({"insts_format": "text"}, "npu2", "insts_format = 'text'"),
])
def test_design_table_refuses_what_could_not_have_been_compiled(tmp_path, entry, device, message):
    with pytest.raises(DesignError, match=re.escape(message)):
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
                         ({"version": 1, "device": "npu1", "designs": {}}, "must be a list")):
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


def test_instruction_streams_are_binary_with_aiecc_s_header(tmp_path):
    words = fake_pyxrt.insts_words("npu2", 8)
    (tmp_path / "insts.txt").write_bytes(words.astype("<u4").tobytes())  # aiecc writes binary whatever the name
    assert read_insts(tmp_path / "insts.txt", device="npu2").tolist() == words.tolist()
    with pytest.raises(DesignError, match="compiled for generation 4, the table's device npu1 is 3"):
        read_insts(tmp_path / "insts.txt", device="npu1")
    (tmp_path / "hex.txt").write_text("".join(f"{w:08x}\n" for w in words))
    with pytest.raises(DesignError, match="not an NPU instruction stream.*it reads as text.*insts_format"):
        read_insts(tmp_path / "hex.txt")  # the old reading of *.txt as hex is gone
    assert read_insts(tmp_path / "hex.txt", "hex").tolist() == words.tolist()  # only when the table says so
    (tmp_path / "short.bin").write_bytes(words[:-1].astype("<u4").tobytes())
    with pytest.raises(DesignError, match=r"the header says 48 bytes, the file has 44"):
        read_insts(tmp_path / "short.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DesignError, match="not a binary instruction stream"):
        read_insts(tmp_path / "odd.bin")
    (tmp_path / "bad.txt").write_text("0x12\nzz\n")
    with pytest.raises(DesignError, match="hexadecimal"):
        read_insts(tmp_path / "bad.txt", "hex")


def test_a_hex_instruction_file_named_in_a_binary_table_sends_the_shape_to_the_host(tmp_path, sim, host):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)])
    words = read_insts(tmp_path / "insts_64x64.bin")
    (tmp_path / "insts_64x64.bin").write_text("".join(f"{w:08x}\n" for w in words))
    backend = load(table, host)
    backend.prepare_linear(bf16_weight(64, 64))
    assert "not an NPU instruction stream" in backend.placement[(64, 64, "bf16")]


# -- the backend on the simulator ----------------------------------------------------------

@pytest.mark.parametrize("b_col_major, insts_format, tile", [(True, "hex", (32, 32, 32)), (False, "binary", (8, 8, 8))])
def test_npu_rows_equal_the_host_gemm_of_bf16_inputs_for_every_batch(tmp_path, sim, host, b_col_major, insts_format,
                                                                      tile):
    table = fake_pyxrt.write_design_table(tmp_path, [(72, 100)], b_col_major=b_col_major, insts_format=insts_format,
                                          tile=tile, M=4 * tile[0])
    backend = load(table, host)
    assert backend.name == "xrt-simulator"  # the simulator never passes for the NPU
    w = bf16_weight(100, 72)
    w = LinearWeight(w.fmt, w.data, bias=np.linspace(-1, 1, 100).astype(np.float32))
    prepared = backend.prepare_linear(w)
    assert backend.placement == {(72, 100, "bf16"): "npu"}
    x = np.random.default_rng(1).standard_normal((70, 72)).astype(np.float32)  # three passes of M=32
    want = reference(host, x, w, bfp16=backend.table.device == "npu2")  # the stock npu2 build: bfp16 blocks
    for m in (1, 5, 32, 33, 70):
        got = backend.linear(x[:m], prepared)
        assert np.array_equal(bits(got), bits(want[:m])), m
    runs = [c for c in sim.calls if c[0] == "run"]
    assert runs and all(n == 6 for _, n in runs)  # opcode, instr, ninstr, A, B, C and nothing else


def test_the_call_sequence_syncs_inputs_before_and_output_after_each_run(tmp_path, sim, host):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    sim.calls.clear()
    to_device, from_device = backend.device.bytes_to_device, backend.device.bytes_from_device
    backend.linear(np.ones((1, 64), np.float32), w)
    assert backend.device.bytes_to_device - to_device == 1 * 64 * 2
    assert backend.device.bytes_from_device - from_device == 1 * 64 * 4
    # the one row reaches the device and comes back, not the design's 32 (its other rows are never read)
    assert sim.calls == [("write", 3, 1 * 64 * 2), ("sync", 3, "XCL_BO_SYNC_BO_TO_DEVICE", 1 * 64 * 2), ("run", 6),
                         ("sync", 5, "XCL_BO_SYNC_BO_FROM_DEVICE", 1 * 64 * 4), ("read", 5, 1 * 64 * 4)]


def test_the_simulator_holds_a_partial_sync_to_the_bytes_it_covers(tmp_path, sim, host):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    session, (_, handle) = backend.device, backend._weights[id(w.data)]
    entry = session.designs[(64, 64, "bf16")]
    kernel, bo_b = session.plan.kernel(entry.design, set()), session.weights[handle][1][0]
    to_device = fake_pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
    from_device = fake_pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_FROM_DEVICE
    entry.bo_a.write(np.zeros(256, np.uint8), 0)
    entry.bo_a.sync(to_device, 128, 0)  # half of what was written
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="written but not synced"):
        kernel(3, entry.bo_insts, entry.num_insts, entry.bo_a, bo_b, entry.bo_c)
    entry.bo_a.sync(to_device, 256, 0)
    kernel(3, entry.bo_insts, entry.num_insts, entry.bo_a, bo_b, entry.bo_c).wait(1000)
    entry.bo_c.sync(from_device, 256, 0)
    entry.bo_c.read(256, 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="read before a sync from the device"):
        entry.bo_c.read(256, 256)  # past what came back


def test_buffers_are_made_as_aie_utils_xrt_makes_them(tmp_path, sim, host):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(72, 100)]), host)
    backend.prepare_linear(bf16_weight(100, 72))
    made = [c[1:] for c in sim.calls if c[0] == "bo"]
    # instructions cacheable in group 1; A [M, cK] bf16, C [M, cN] f32, B [cN, cK] bf16 host_only
    assert made[:3] == [(1, 16 * 4, "cacheable"), (3, 32 * 72 * 2, "host_only"), (5, 32 * 104 * 4, "host_only")]
    assert made[3:] == [(4, 104 * 72 * 2, "host_only")] * 2  # the start-up check's B, then the weight's


def test_shapes_and_formats_without_a_design_run_on_the_host_said_once(tmp_path, sim, host):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
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
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    parts = [bf16_weight(64, 64), bf16_weight(64, 64, seed=1)]
    assert host.fuse_linears(parts) is not None
    assert fuse_linears(backend, parts) is None


@pytest.mark.parametrize("mode, state", [("timeout", "ERT_CMD_STATE_TIMEOUT"), ("abort", "ERT_CMD_STATE_ABORT"),
                                         ("raise", None)])
def test_a_run_that_does_not_complete_raises_a_device_fault(tmp_path, sim, host, mode, state):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host, timeout_ms=250)
    w = backend.prepare_linear(bf16_weight(64, 64))
    sim.inject(mode)
    with pytest.raises(xrt.NpuRunError) as info:
        backend.linear(np.ones((2, 64), np.float32), w)
    assert isinstance(info.value, DeviceFault) and info.value.state == state
    assert (state or "RuntimeError") in str(info.value)
    if mode != "raise":
        assert "timeout 250 ms" in str(info.value)
    if mode != "timeout":
        backend.linear(np.ones((2, 64), np.float32), w)  # the run is over: the next is good again
        return
    # the wait gave up but the command runs on: kept (never collected in flight), its context retired
    session = backend.device
    assert len(session.in_flight) == 1 and sim.contexts_live == 1  # the context lives while its run does
    with pytest.raises(xrt.NpuRunError, match="its context was retired"):
        backend.linear(np.ones((2, 64), np.float32), w)
    assert session.poll() == 0  # polled until the command ended, then let go with its context
    assert sim.contexts_live == 0
    assert sim.violations == []


def test_the_simulator_aborts_like_xrt_when_a_run_in_flight_is_collected(sim):
    import gc

    fake_pyxrt.run(fake_pyxrt.ert_cmd_state.ERT_CMD_STATE_RUNNING, None)
    gc.collect()
    assert sim.violations == ["an xrt.run was destroyed while in flight (XRT aborts the process)"]
    sim.violations.clear()


def test_a_run_that_ends_in_error_is_a_fault_and_the_command_is_over(tmp_path, sim, host):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host, timeout_ms=250)
    w = backend.prepare_linear(bf16_weight(64, 64))
    sim.inject("error")
    with pytest.raises(xrt.NpuRunError, match="ERT_CMD_STATE_ERROR"):
        backend.linear(np.ones((2, 64), np.float32), w)
    assert backend.device.in_flight == []


def test_a_kernel_the_xclbin_does_not_have_is_refused_or_sent_to_the_host(tmp_path, sim, host):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)], kernel_name="OTHER")
    with pytest.raises(xrt.XrtUnavailable, match="has no kernel 'MLIR_AIE'"):
        load(table, host, strict=True)  # at load: every xclbin is read, used or not
    with structlog.testing.capture_logs() as logs:
        backend = load(table, host)
    assert "has no kernel 'MLIR_AIE' (it has ['OTHER'])" in backend.placement[(64, 64, "bf16")]
    assert [e["event"] for e in logs] == ["npu_design_table", "npu_shape_on_host"]
    backend.prepare_linear(bf16_weight(64, 64))  # runs on the host, said once
    assert not [c for c in fake_pyxrt.SIM.calls if c[0] == "register_xclbin"]
    few = fake_pyxrt.write_design_table(tmp_path / "few", [(64, 64)], num_args=5)
    with pytest.raises(xrt.XrtUnavailable, match="declares 5 arguments"):
        load(few, host, strict=True)
    (tmp_path / "gemm_64x64.xclbin").write_text("not an xclbin")
    with pytest.raises(xrt.XrtUnavailable, match="does not open as an xclbin"):
        load(table, host, strict=True)


def test_startup_check_catches_a_design_compiled_for_another_layout(tmp_path, sim, host):
    # design.json says B is column-major; the xclbin reads it row-major: the same wrong
    # answer every time, which a self-comparison would pass
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)], b_col_major=False, tile=(32, 32, 32), M=128)
    raw = json.loads(table.read_text())
    raw["designs"][0]["b_col_major"] = True
    table.write_text(json.dumps(raw))
    with structlog.testing.capture_logs() as logs:
        backend = load(table, host)
        backend.prepare_linear(bf16_weight(64, 64))
    assert backend.placement[(64, 64, "bf16")].startswith("failed the start-up check (K=64 N=64:")
    assert [e["fallback"] for e in logs if e["event"] == "kernel_self_check_failed"] == ["host"]
    with pytest.raises(xrt.XrtUnavailable, match="failed the start-up check"):
        load(table, host, strict=True).prepare_linear(bf16_weight(64, 64))


def test_a_weight_the_npu_cannot_hold_says_what_to_check(tmp_path, sim, host, monkeypatch):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
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
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    backend.prepare_linear(bf16_weight(64, 64))
    assert "outputs differ from the host" in backend.placement[(64, 64, "bf16")]


def test_startup_check_catches_an_aborted_run(tmp_path, sim, host):
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
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
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    assert backend.placement[(64, 64, "bf16")] == "npu-rowwise"
    x = np.random.default_rng(3).standard_normal((5, 64)).astype(np.float32)
    sim.calls.clear()
    batched = backend.linear(x, w)
    # a row a pass, with the same zero neighbours every time: all 32 rows of A written, not one
    assert [c[2] for c in sim.calls if c[0] == "write" and c[1] == 3] == [32 * 64 * 2] * 5
    for i in range(5):
        assert np.array_equal(bits(backend.linear(x[i : i + 1], w)), bits(batched[i : i + 1]))


def test_numerics_identity_names_the_designs_and_where_each_shape_runs(tmp_path, sim, host):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)])
    backend = load(table, host)
    before = backend.numerics_id()
    assert before.startswith("xrt-simulator/designs=") and before.endswith("/activations=bf16/accumulate=fp32")
    assert before != host.name  # never the host's identity through __getattr__
    backend.prepare_linear(bf16_weight(64, 64))
    assert backend.numerics_id() != before and '"64x64 bf16": "npu"' in backend.numerics_id()
    again = load(table, host)
    again.prepare_linear(bf16_weight(64, 64))
    assert again.numerics_id() == backend.numerics_id()
    insts = tmp_path / "insts_64x64.bin"
    insts.write_bytes(insts.read_bytes() + bytes(4))  # another build of the design
    assert load(table, host).table_identity != backend.table_identity


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
    backend = load(fake_pyxrt.write_design_table(tmp_path, [(64, 64)]), host)
    w = backend.prepare_linear(bf16_weight(64, 64))
    session, (_, handle) = backend.device, backend._weights[id(w.data)]
    entry = session.designs[(64, 64, "bf16")]
    kernel, bo_b = session.plan.kernel(entry.design, set()), session.weights[handle][1][0]
    to_device = fake_pyxrt.xclBOSyncDirection.XCL_BO_SYNC_BO_TO_DEVICE
    entry.bo_a.sync(to_device)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="9 arguments to a kernel that declares 8"):
        kernel(3, entry.bo_insts, entry.num_insts, entry.bo_a, bo_b, entry.bo_c, 32, 64, 64)
    entry.bo_a.write(np.zeros(8, np.uint8), 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="written but not synced"):
        kernel(3, entry.bo_insts, entry.num_insts, entry.bo_a, bo_b, entry.bo_c)
    with pytest.raises(TypeError, match="incompatible function arguments"):
        entry.bo_a.sync(to_device, 64)  # pyxrt binds sync(dir) and sync(dir, size, offset) only
    entry.bo_a.sync(to_device, entry.bo_a.size(), 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="ninstr"):
        kernel(3, entry.bo_insts, entry.num_insts + 1, entry.bo_a, bo_b, entry.bo_c)
    started = kernel(3, entry.bo_insts, entry.num_insts, entry.bo_a, bo_b, entry.bo_c)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="read while a run that uses it is in flight"):
        entry.bo_c.read(4, 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="written while a run that uses it is in flight"):
        entry.bo_a.write(np.zeros(8, np.uint8), 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="C of a run in flight given to another run"):
        kernel(3, entry.bo_insts, entry.num_insts, entry.bo_a, bo_b, entry.bo_c)
    started.wait(1000)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="before a sync from the device"):
        entry.bo_c.read(4, 0)
    with pytest.raises(fake_pyxrt.ProtocolViolation, match="made cacheable"):
        session.buffer(kernel, 64, 3, fake_pyxrt.bo.cacheable)


# -- real hardware ---------------------------------------------------------------------------

NPU_DESIGN = os.environ.get("NPUD_XRT_DESIGN")
NPU_REASON = ("needs an amdxdna NPU (/dev/accel/accel*), XRT's pyxrt and NPUD_XRT_DESIGN=<design.json> "
              "built by tools/build_npu_designs.py (docs/npu.md)")


def _real_npu() -> bool:
    return bool(NPU_DESIGN) and xrt.probe()[0]


@pytest.mark.npu
@pytest.mark.skipif(not _real_npu(), reason=NPU_REASON)
def test_npu_every_design_passes_the_startup_check(host):
    backend = load(NPU_DESIGN, host, strict=True)
    assert backend.name == "xrt"
    for (k, n, fmt) in backend.table.designs:
        if fmt == "int8":  # an int8 design takes int8 rows with their scales (tests/test_xrt_int8.py)
            from npud.engine.weights import quantize_int8_rows

            w32 = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
            backend.prepare_linear(LinearWeight(WeightFormat.INT8, *quantize_int8_rows(w32)))
        else:
            backend.prepare_linear(bf16_weight(n, k))  # strict: a failed check raises
    assert set(backend.placement.values()) <= {"npu", "npu-rowwise"}


@pytest.mark.npu
@pytest.mark.skipif(not _real_npu(), reason=NPU_REASON)
def test_npu_rows_are_bit_identical_across_batches(host):
    backend = load(NPU_DESIGN, host, strict=True)
    bf16 = [(key, d) for key, d in backend.table.designs.items() if key[2] == "bf16"]
    if not bf16:
        pytest.skip("the table has no bf16 design (an int8 table: tests/test_xrt_int8.py checks its rows)")
    (k, n, _), design = bf16[0]
    raw = bf16_weight(n, k)
    w = backend.prepare_linear(raw)
    x = np.random.default_rng(7).standard_normal((2 * design.M + 3, k)).astype(np.float32)
    full = backend.linear(x, w)
    for m in (1, design.M, design.M + 1):
        assert np.array_equal(bits(backend.linear(x[:m], w)), bits(full[:m]))
    wf = (raw.data.astype(np.uint32) << 16).view(np.float32)
    # the design's own policy: a stock npu2 (npu4) build quantises in bfp16 blocks
    assert np.all(np.abs(full - host.linear(bf16_round(x), w)) <= tolerance(bf16_round(x), wf,
                                                                          xrt.tolerance_policy(design)))


# -- placement by measured cost --------------------------------------------------------------


def _costs(table):
    """Injected costs (xrt.measure_costs' form) from {(K, N): (NPU s, host s)}; records the calls."""
    calls = []

    def costs(runner, handle, host, host_weight, rows, timeout_ms):
        calls.append((runner.design.K, runner.design.N, rows))
        return table[(runner.design.K, runner.design.N)]

    return costs, calls


@pytest.mark.parametrize("strict", [False, True])
def test_a_shape_runs_on_the_host_where_its_measured_npu_cost_is_higher(tmp_path, sim, host, strict):
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64), (64, 128)], device="npu1", M=16, tile=(4, 8, 4))
    costs, calls = _costs({(64, 64): (2e-3, 1e-3), (64, 128): (1e-4, 5e-4)})  # 64x64: the host is faster
    backend = load(table, host, costs=costs, strict=strict)
    slow, fast = bf16_weight(64, 64), bf16_weight(128, 64, seed=1)
    w_slow, w_fast = backend.prepare_linear(slow), backend.prepare_linear(fast)
    again = backend.prepare_linear(bf16_weight(64, 64, seed=2))  # a second weight of a shape already timed
    assert calls == [(64, 64, 1), (64, 128, 1)]  # each shape timed once, on a decode step's one row
    assert backend.describe_costs() == {"64x128 bf16": {"rows": 1, "npu_ms": 0.1, "host_ms": 0.5},
                                        "64x64 bf16": {"rows": 1, "npu_ms": 2.0, "host_ms": 1.0}}
    x = np.random.default_rng(3).standard_normal((2, 64)).astype(np.float32)
    sim.calls.clear()
    got = backend.linear(x, w_slow), backend.linear(x, again)
    ran = len([c for c in sim.calls if c[0] == "run"])
    if strict:  # backend "xrt": the NPU or nothing, its costs said
        assert backend.placement[(64, 64, "bf16")] == "npu" and ran == 2
        assert backend.where(w_slow) == "npu" and not backend.lost_everywhere()
    else:
        why = backend.placement[(64, 64, "bf16")]
        assert why == "the host is faster (1-row pass: NPU 2.000 ms, host 1.000 ms)"
        assert ran == 0 and backend.where(w_slow) == backend.where(again) == why
        assert np.array_equal(bits(got[0]), bits(host.linear(x, w_slow)))  # the host's own fp32 path
        assert backend.placement[(64, 128, "bf16")] == "npu" and backend.where(w_fast) == "npu"
        assert not backend.lost_everywhere()  # 64x128 still wins


def test_a_backend_whose_npu_lost_every_timed_shape_says_so(tmp_path, sim, host):
    # of the shapes prepared so far (the session asks once the model's weights are all prepared)
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64), (64, 128)], device="npu1", M=16, tile=(4, 8, 4))
    costs, _ = _costs({(64, 64): (2e-3, 1e-3), (64, 128): (1e-4, 5e-4)})
    backend = load(table, host, costs=costs)
    assert not backend.lost_everywhere()  # nothing timed: nothing lost
    backend.prepare_linear(bf16_weight(64, 64))
    assert backend.lost_everywhere()
    backend.prepare_linear(bf16_weight(128, 64))  # this one wins
    assert not backend.lost_everywhere()


def test_design_table_holds_several_m_per_shape_sharing_one_weight_layout(tmp_path):
    import json

    from npud.kernels.xrt_design import DesignError, DesignTable

    path = fake_pyxrt.write_design_table(tmp_path, [(64, 100), (128, 64)], more_m=(128, 64))
    table = DesignTable.load(path)
    key = (64, 100, "bf16")
    assert [d.M for d in table.by_m(key)] == [32, 64, 128] and table.designs[key].M == 32
    assert table.lookup(64, 100, "bf16")[0].M == 32  # the smallest: the one weights are laid out by
    assert len({d.insts for d in table.by_m(key)}) == 3
    before = table.identity()
    table.by_m(key)[2].insts.write_bytes(fake_pyxrt.insts_words("npu2", 12, seed=9).astype("<u4").tobytes())
    assert DesignTable.load(path).identity() != before  # every M's files are in the identity
    raw = json.loads(path.read_text())
    wide = next(e for e in raw["designs"] if e["K"] == 64 and e["M"] == 64)
    wide["compiled_N"] = 112  # a layout of its own: one weight upload could not serve both
    path.write_text(json.dumps(raw))
    with pytest.raises(DesignError, match="compiled_N = 112 differs from the M = 32 design's 104"):
        DesignTable.load(path)
    wide["compiled_N"] = 104
    raw["designs"].append(dict(wide))
    path.write_text(json.dumps(raw))
    with pytest.raises(DesignError, match="a second design for K=64, N=100, bf16 with M = 64"):
        DesignTable.load(path)
