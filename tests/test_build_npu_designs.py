"""tools/build_npu_designs.py: the shape listing and the table it writes (the IRON build
itself needs the mlir-aie and llvm-aie wheels, which are not on the package index)."""

from __future__ import annotations

from pathlib import Path

import pytest

import fake_pyxrt

from npud.engine.testing.checkpoints import build_tiny_checkpoint
from npud.kernels.xrt_design import DesignTable, read_insts

tool = fake_pyxrt.build_tool()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("designs") / "qwen3", "qwen3")


def test_shapes_are_the_distinct_linears_with_the_tied_head_only(ckpt):
    shapes = tool.gemm_shapes([ckpt], "bf16")
    # hidden 64, 4 heads x 32 for q, 2 x 32 for k and v, MLP 128, vocab 320, 2 layers
    assert [(s.K, s.N, s.weight_format, len(s.layers)) for s in shapes] == [
        (64, 64, "bf16", 4), (64, 128, "bf16", 6), (64, 320, "bf16", 1), (128, 64, "bf16", 4)]
    assert shapes[2].layers == ("qwen3.lm_head",)  # the untied embedding table is no GEMM
    assert [s.weight_format for s in tool.gemm_shapes([ckpt], "int8")] == ["int8"] * 4
    twice = tool.gemm_shapes([ckpt, ckpt], "bf16")  # base and a draft sharing shapes: one design each
    assert [(s.K, s.N) for s in twice] == [(s.K, s.N) for s in shapes] and len(twice[0].layers) == 8


def _stub_build(built, device, fail=()):
    def build(design, link=False):  # stands in for the IRON build: writes the files it would, binary as aiecc does
        if (design.compiled_K, design.compiled_N) in fail:
            raise tool.subprocess.CalledProcessError(2, ["make"])
        design.xclbin.write_bytes(b"xclbin")
        design.insts.write_bytes(fake_pyxrt.insts_words(device, 8).astype("<u4").tobytes())
        built.append(design)
    return build


@pytest.mark.parametrize("device", ["npu1", "npu2"])
def test_table_written_for_every_shape_loads_and_serves_them(ckpt, tmp_path, device):
    shapes = tool.gemm_shapes([ckpt], "bf16")
    built = []
    path, on_host, count = tool.build_table(shapes, tool.Tiling(device), tmp_path, _stub_build(built, device))
    # 64x64 and 64x128 pad to one shape (N to 128 = tile_n 32 x 4 columns): one build, one xclbin
    assert on_host == [] and len(built) == 3 and count == 4
    table = DesignTable.load(path)
    assert table.device == device
    for s in shapes:
        design, why = table.lookup(s.K, s.N, "bf16")
        assert why == "npu" and design.compiled_K % 64 == 0 and design.compiled_N % 128 == 0
        assert design.compiled_K >= s.K and design.compiled_N >= s.N and design.M == 32
        assert design.insts.suffix == ".bin" and design.insts_format == "binary" and design.n_passes == 1
        assert read_insts(design.insts, design.insts_format, device).size == 12
    assert table.lookup(64, 320, "bf16")[0].compiled_N == 384
    assert table.lookup(64, 64, "bf16")[0].xclbin == table.lookup(64, 128, "bf16")[0].xclbin
    assert table.lookup(64, 64, "bf16")[0].bfp16_emulation == (device == "npu2")  # the stock builds


def test_the_output_layer_splits_into_passes_and_what_cannot_build_stays_on_the_host_said(tmp_path):
    shapes = [tool.Shape(1024, 151936, "bf16", ("head",)), tool.Shape(64 * 1024 + 64, 64, "bf16", ("wide_k",)),
              tool.Shape(64, 64, "bf16", ("fails",)), tool.Shape(128, 64, "bf16", ("ok",)),
              tool.Shape(64, 64, "int8-q8", ("int8-q8",))]
    built = []
    path, on_host, _ = tool.build_table(shapes, tool.Tiling("npu2"), tmp_path,
                                       _stub_build(built, "npu2", fail={(64, 128)}))
    table = DesignTable.load(path)  # written although a build failed and shapes stay on the host
    head = table.lookup(1024, 151936, "bf16")[0]
    # one pass moves at most 64 x 32 x 4 = 8192 columns: the vocabulary takes 19 passes of 7997 -> 8064
    assert (head.n_passes, head.compiled_N) == (19, 8064)
    assert table.lookup(128, 64, "bf16")[1] == "npu"
    assert [line.split(":")[0] for line in on_host] == ["K=65600 N=64 bf16", "K=64 N=64 bf16", "K=64 N=64 int8-q8"]
    assert "A's size 1 = 1025 exceeds 1023" in on_host[0] and "the build failed (CalledProcessError" in on_host[1]
    none, why = table.lookup(64, 64, "bf16")
    assert none is None and "the build failed" in why  # npud's npu_shape_on_host line carries the build's word


def test_int8_shapes_build_int8_designs_of_their_own(ckpt, tmp_path):
    shapes = tool.gemm_shapes([ckpt], "int8")
    for device in ("npu1", "npu2"):
        built = []
        path, on_host, count = tool.build_table(shapes, tool.Tiling(device), tmp_path / device,
                                                _stub_build(built, device))
        table = DesignTable.load(path)
        assert on_host == [] and count == 4 and len(built) == 3
        for s in shapes:
            d, why = table.lookup(s.K, s.N, "int8")
            assert why == "npu" and (d.dtype_in, d.dtype_out, d.bfp16_emulation) == ("i8", "i32", False)
            assert d.M == 64 and d.tile_m == 16 and d.insts.name.endswith("_i8.bin")  # apart from a bf16 build's
        assert table.lookup(64, 64, "bf16")[0] is None


def test_a_bf16_and_an_int8_design_of_one_padded_shape_are_two_builds(tmp_path):
    shapes = [tool.Shape(64, 64, "bf16", ("a",)), tool.Shape(64, 64, "int8", ("b",))]
    built = []
    path, on_host, count = tool.build_table(shapes, tool.Tiling("npu2", rows=64), tmp_path, _stub_build(built, "npu2"))
    assert on_host == [] and count == 2 and [d.dtype_in for d in built] == ["bf16", "i8"]
    table = DesignTable.load(path)
    assert table.lookup(64, 64, "bf16")[0].kernel != table.lookup(64, 64, "int8")[0].kernel


def test_an_int8_tiling_that_breaks_the_int8_kernel_s_rules_fails_before_building(ckpt, tmp_path):
    shapes = tool.gemm_shapes([ckpt], "int8")
    with pytest.raises(ValueError, match="tile_m = 8 is not a multiple of the npu1 int8 kernel's 16"):
        tool.plan(shapes[0], tool.Tiling("npu1", int8_rows=32), tmp_path)


def test_formats_the_designs_do_not_serve_are_left_to_the_host(ckpt, tmp_path):
    shapes = tool.gemm_shapes([ckpt], "int8-q8")
    path, on_host, count = tool.build_table(shapes, tool.Tiling("npu2"), tmp_path, lambda d: None)
    assert len(on_host) == 4 and all("runs on the host" in line for line in on_host)
    assert DesignTable.load(path).designs == {} and count == 0


def test_npu2_defaults_to_the_stock_build_s_bfp16_emulation():
    assert tool.Tiling("npu2").bfp16_emulation and not tool.Tiling("npu1").bfp16_emulation
    assert tool.Tiling("npu2", bfp16_emulation=False).bfp16_emulation is False


def test_a_tiling_that_breaks_the_rules_fails_before_building(ckpt, tmp_path):
    shape = tool.gemm_shapes([ckpt], "bf16")[0]
    with pytest.raises(ValueError, match="tile_m = 4 is not a multiple of the npu2 bf16 micro-tile's 8"):
        tool.plan(shape, tool.Tiling("npu2", rows=16), tmp_path)
    with pytest.raises(ValueError, match="columns = 8: npu1 has 4"):
        tool.plan(shape, tool.Tiling("npu1", columns=8), tmp_path)
    with pytest.raises(ValueError, match="B column-major needs tile_m, tile_k, tile_n multiples of 32"):
        tool.plan(shape, tool.Tiling("npu1", b_col_major=True), tmp_path)  # tile_m 8: the generator asserts


def test_main_lists_shapes_and_says_what_is_missing(ckpt, tmp_path, capsys, monkeypatch):
    assert tool.main([str(ckpt), "--list"]) == 0
    assert "K=    64 N=    320 bf16  x1   qwen3.lm_head" in capsys.readouterr().out
    monkeypatch.delenv("PEANO_INSTALL_DIR", raising=False)
    monkeypatch.setattr(tool.shutil, "which", lambda name: None)
    rc = tool.main([str(ckpt), "--device", "npu2", "--out", str(tmp_path), "--mlir-aie-src", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == tool.EXIT_MISSING
    for what in ("aiecc.py on PATH", "PEANO_INSTALL_DIR", "an mlir-aie source checkout", "make"):
        assert what in err
    assert not (tmp_path / "design.json").exists()


def test_a_dflash_drafter_adds_its_own_shapes_not_a_head():
    models = Path(__file__).resolve().parent.parent / "npud" / "models"
    base = tool.gemm_shapes([models / "pycode-base"], "bf16")
    with_drafter = tool.gemm_shapes([models / "pycode-base"], "bf16", [models / "pycode-dflash"])
    added = {(s.K, s.N) for s in with_drafter} - {(s.K, s.N) for s in base}
    assert added and all(not n.endswith("lm_head") for s in with_drafter for n in s.layers if "dflash" in n)
    assert any(n == "pycode-dflash.fc" for s in with_drafter for n in s.layers)


# -- a pinned, recorded toolchain; a build where nothing builds fails ---------------------------


def _pinned(monkeypatch, tmp_path, mlir_aie="1.0", makefile_common="xclbin_target?=x\ninsts_target?=y\n"):
    """A machine with the toolchain in place: the pinned wheels and a checkout of the example."""
    src = tmp_path / "mlir-aie"
    (src / tool.EXAMPLE).mkdir(parents=True)
    (src / tool.EXAMPLE / "Makefile").write_text("include ../makefile-common\n")
    (src / tool.EXAMPLE / ".." / "makefile-common").write_text(makefile_common)
    monkeypatch.setattr(tool, "missing_toolchain", lambda src: [])
    versions = {"mlir_aie": mlir_aie, "llvm-aie": tool.LLVM_AIE_WHEEL}
    monkeypatch.setattr(tool, "_version", versions.get)
    monkeypatch.setattr(tool, "_first_line", lambda cmd: "Version: 2.20.0" if cmd[0] == "xrt-smi" else None)
    return src


def test_a_build_where_no_design_builds_exits_non_zero_with_a_line_per_shape(ckpt, tmp_path, monkeypatch, capsys):
    src = _pinned(monkeypatch, tmp_path)

    def make_fails(design, tiling, mlir_aie_src, work, link=False):
        raise tool.subprocess.CalledProcessError(2, ["make", "-C", str(mlir_aie_src)])

    monkeypatch.setattr(tool, "build_with_iron", make_fails)
    out = tmp_path / "designs"
    rc = tool.main([str(ckpt), "--device", "npu1", "--out", str(out), "--mlir-aie-src", str(src)])
    err = capsys.readouterr().err
    assert rc == tool.EXIT_NOTHING_BUILT
    shapes = tool.gemm_shapes([ckpt], "bf16")
    for s in shapes:  # every shape says why
        assert f"K={s.K} N={s.N} bf16: the build failed (CalledProcessError" in err
    assert "no NPU design built for any of the 4 shapes" in err
    assert DesignTable.load(out / "design.json").designs == {}


def test_design_json_records_the_toolchain_that_built_it(ckpt, tmp_path, monkeypatch, capsys):
    src = _pinned(monkeypatch, tmp_path)
    monkeypatch.setattr(tool, "build_with_iron", lambda d, tiling, src, work, link=False: _stub_build([], "npu2")(d))
    out = tmp_path / "designs"
    assert tool.main([str(ckpt), "--device", "npu2", "--out", str(out), "--mlir-aie-src", str(src)]) == 0
    toolchain = DesignTable.load(out / "design.json").toolchain
    assert toolchain["mlir_aie_release"] == tool.MLIR_AIE_RELEASE == "v1.0"
    assert toolchain["mlir_aie"] == "1.0" and toolchain["llvm_aie"] == tool.LLVM_AIE_WHEEL
    assert toolchain["xrt"] == "Version: 2.20.0" and "unpinned" not in toolchain
    assert set(toolchain) >= {"amdxdna_driver", "npu_firmware", "mlir_aie_checkout"}


def test_another_mlir_aie_release_is_refused_unless_unpinned(ckpt, tmp_path, monkeypatch, capsys):
    src = _pinned(monkeypatch, tmp_path, mlir_aie="1.1.4")
    monkeypatch.setattr(tool, "build_with_iron", lambda d, tiling, src, work, link=False: _stub_build([], "npu2")(d))
    out = tmp_path / "designs"
    argv = [str(ckpt), "--device", "npu2", "--out", str(out), "--mlir-aie-src", str(src)]
    assert tool.main(argv) == tool.EXIT_UNPINNED
    assert "the mlir-aie wheel is 1.1.4, the designs are built with release v1.0" in capsys.readouterr().err
    assert not (out / "design.json").exists()
    assert tool.main(argv + ["--unpinned"]) == 0
    toolchain = DesignTable.load(out / "design.json").toolchain
    assert toolchain["mlir_aie"] == "1.1.4" and "1.1.4" in toolchain["unpinned"]


def test_a_checkout_whose_makefile_takes_no_targets_is_another_release(tmp_path, monkeypatch):
    src = _pinned(monkeypatch, tmp_path, makefile_common="xclbin_target=build/final.xclbin\n")
    errors = tool.pin_errors({"mlir_aie": "1.0"}, str(src))
    assert len(errors) == 1 and "does not take xclbin_target, insts_target" in errors[0]
    assert "checkout v1.0" in errors[0]
    assert tool.pin_errors({"mlir_aie": "v1.0.0"}, None) == []  # one release, however it is spelt



def test_every_design_is_a_kernel_of_one_xclbin_linked_by_aiecc(ckpt, tmp_path, monkeypatch):
    # the commands the build runs (make for the MLIR and the micro-kernel, aiecc for the kernel),
    # each standing in for itself by writing what it would
    src = tmp_path / "mlir-aie"
    (src / tool.EXAMPLE / "build").mkdir(parents=True)
    ran = []

    def run(cmd, check=True, cwd=None):
        ran.append(cmd)
        if cmd[0] == "aiecc.py":
            out = next(a.split("=", 1)[1] for a in cmd if a.startswith("--xclbin-name="))
            Path(out).write_bytes(b"xclbin")
            insts = next(a.split("=", 1)[1] for a in cmd if a.startswith("--npu-insts-name="))
            Path(insts).write_bytes(fake_pyxrt.insts_words("npu1", 8).astype("<u4").tobytes())

    monkeypatch.setattr(tool.subprocess, "run", run)
    tiling = tool.Tiling("npu1")
    out = tmp_path / "designs"
    path, on_host, count = tool.build_table(
        tool.gemm_shapes([ckpt], "bf16"), tiling, out,
        lambda d, link=False: tool.build_with_iron(d, tiling, src, out / "work", link))
    table = DesignTable.load(path)
    assert on_host == [] and count == 4
    assert {d.xclbin for d in table.designs.values()} == {out / "model.xclbin"}
    kernels = {k: d.kernel for k, d in table.designs.items()}
    assert kernels[(64, 64, "bf16")] == kernels[(64, 128, "bf16")]  # one padded shape, one kernel
    assert sorted(set(kernels.values())) == ["MLIR_AIE_0", "MLIR_AIE_1", "MLIR_AIE_2"]
    aiecc = [c for c in ran if c[0] == "aiecc.py"]
    assert len(aiecc) == 3 and not any(a.startswith("--xclbin-input") for a in aiecc[0])
    for i, cmd in enumerate(aiecc):
        assert f"--xclbin-kernel-name=MLIR_AIE_{i}" in cmd and f"--xclbin-kernel-id=0x{0x901 + i:x}" in cmd
        if i:
            assert f"--xclbin-input={(out / 'model.xclbin').resolve()}" in cmd  # extends the earlier kernels
    assert all(c[0] == "make" and "xclbin_target" not in " ".join(c) for c in ran if c[0] != "aiecc.py")


@pytest.mark.parametrize("device, smallest", [("npu1", 16), ("npu2", 32)])
def test_every_shape_is_built_for_a_decode_m_and_a_prefill_m_sharing_the_weight_layout(ckpt, tmp_path, device,
                                                                                        smallest):
    assert tool.default_rows(device) == [smallest, 128]
    assert tool.default_rows("npu2", bfp16_emulation=False) == [16, 128]  # 4x8x8 micro-tiles: tile_m 4
    shapes = tool.gemm_shapes([ckpt], "bf16") + [tool.Shape(1024, 151936, "bf16", ("head",))]
    rows = tool.default_rows(device)
    built = []
    tiling = tool.Tiling(device, rows[0], more_rows=tuple(rows[1:]))
    path, on_host, count = tool.build_table(shapes, tiling, tmp_path, _stub_build(built, device))
    assert on_host == [] and count == 2 * len(shapes)
    table = DesignTable.load(path)
    for s in shapes:
        designs = table.by_m((s.K, s.N, "bf16"))
        assert [d.M for d in designs] == [smallest, 128]
        assert [d.tile_m for d in designs] == [smallest // 4, 32]  # 4 core rows of tile_m rows each
        assert len({(d.compiled_K, d.compiled_N, d.n_passes) for d in designs}) == 1
        assert len({d.kernel for d in designs}) == 2 and len({d.xclbin for d in designs}) == 1
    assert table.lookup(1024, 151936, "bf16")[0].n_passes == 19


def test_an_m_whose_weight_layout_would_differ_is_left_out_said(tmp_path):
    # M = 256 halves what one pass of C may move (its stride M x N is at most 1M words): the vocabulary
    # would take more passes of another width, a layout of its own
    shapes = [tool.Shape(1024, 151936, "bf16", ("head",)), tool.Shape(64, 64, "bf16", ("small",))]
    path, on_host, count = tool.build_table(shapes, tool.Tiling("npu2", 32, more_rows=(256,)), tmp_path,
                                           _stub_build([], "npu2"))
    assert count == 3 and len(on_host) == 1
    assert on_host[0] == ("K=1024 N=151936 bf16 (M = 256): left out: its compiled_N = 4096 differs from the "
                          "M = 32 design's 8064")
    table = DesignTable.load(path)
    assert [d.M for d in table.by_m((64, 64, "bf16"))] == [32, 256]
    assert [d.M for d in table.by_m((1024, 151936, "bf16"))] == [32]
    assert table.lookup(1024, 151936, "bf16")[1] == "npu"  # the note is no reason to leave it on the host


def test_the_rows_option_takes_several_m(ckpt, tmp_path, monkeypatch, capsys):
    seen = {}

    class Seen(Exception):
        pass

    def tiling(*a, **k):
        seen["tiling"] = (a, k)
        raise Seen

    monkeypatch.setattr(tool, "Tiling", tiling)
    with pytest.raises(Seen):
        tool.main([str(ckpt), "--device", "npu1", "--out", str(tmp_path), "--rows", "128,16"])
    args, kw = seen["tiling"]
    assert args[1] == 16 and kw["more_rows"] == (128,)
    with pytest.raises(SystemExit):
        tool.main([str(ckpt), "--device", "npu1", "--out", str(tmp_path), "--rows", "16,x"])
    assert "expected M values separated by commas" in capsys.readouterr().err
