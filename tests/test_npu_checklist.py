"""tools/npu_checklist.py on a simulated machine: a fake accel node and sysfs, the pyxrt
SIMULATOR in the NPU worker. The verdicts about the device are the simulator's, not an NPU's;
what is tested is that each step runs and says PASS, FAIL, SKIP or INFO with what it saw."""

from __future__ import annotations

import importlib.util
import json
import os
import resource
from pathlib import Path

import pytest

import fake_pyxrt
from npud.kernels import xrt


def _tool():
    path = Path(__file__).resolve().parent.parent / "tools" / "npu_checklist.py"
    spec = importlib.util.spec_from_file_location("npu_checklist", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def machine(tmp_path, monkeypatch):
    fake_pyxrt.install(monkeypatch)
    monkeypatch.setattr(xrt, "probe", lambda accel_dir="/dev/accel": (True, "simulated accel0"))
    control = tmp_path / "control.json"
    monkeypatch.setenv("FAKE_PYXRT_CONTROL", str(control))
    (tmp_path / "accel").mkdir()
    (tmp_path / "accel" / "accel0").touch()
    device = tmp_path / "sysfs" / "accel0" / "device"
    device.mkdir(parents=True)
    (tmp_path / "drivers" / "amdxdna").mkdir(parents=True)
    (device / "driver").symlink_to(tmp_path / "drivers" / "amdxdna")
    (device / "fw_version").write_text("1.5.2.380\n")
    (device / "device").write_text("0x17f0\n")
    (device / "revision").write_text("0x10\n")
    table = fake_pyxrt.write_design_table(tmp_path / "designs", [(64, 64), (64, 1100)])
    return tmp_path, table, control


def test_every_step_says_its_verdict(machine, capsys):
    tmp_path, table, control = machine
    control.write_text(json.dumps({"mode": "timeout", "after": 1000, "times": 0}))  # armed later, by hand
    rc = _tool().main(["--design", str(table), "--accel-dir", str(tmp_path / "accel"),
                       "--sysfs-dir", str(tmp_path / "sysfs"), "--timeout-ms", "2000"])
    lines = capsys.readouterr().out.splitlines()
    verdicts = {line.split("] ", 1)[1].split(":", 1)[0]: line[1:5].strip() for line in lines if line.startswith("[")}
    for step in ("device node", "driver", "firmware", "access", "pyxrt", "design table", "generation",
                 "instructions 64x64", "instructions 64x1100", "NPU worker", "start-up check 64x64",
                 "start-up check 64x1100", "ninstr in words", "hardware contexts"):
        assert verdicts[step] == "PASS", (step, lines)
    assert verdicts["accumulator rounding"] == verdicts["worker cost"] == "INFO"
    assert verdicts["a run that outlives its wait"] in ("PASS", "SKIP")
    unlimited = resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY
    assert verdicts["memlock"] == ("PASS" if unlimited else "FAIL")
    assert rc == (0 if unlimited else 1)
    # a stock npu2 build quantises in bfp16 blocks: not the host's exact in-order sum
    assert any("bit-identical to the host's in-order sum: False" in line for line in lines)


def test_a_table_for_the_other_generation_fails_its_step(machine, capsys):
    tmp_path, table, _ = machine
    (tmp_path / "sysfs" / "accel0" / "device" / "device").write_text("0x1502\n")  # a Phoenix
    _tool().main(["--design", str(table), "--accel-dir", str(tmp_path / "accel"),
                  "--sysfs-dir", str(tmp_path / "sysfs")])
    out = capsys.readouterr().out
    assert "[FAIL] generation: PCI 0x1502 rev 0x10: npu1 (hw contexts: 6); the design table is for npu2" in out


def test_a_run_that_outlives_its_wait_is_kept_until_it_ends(machine, capsys):
    from npud.kernels.select import default_backend

    tmp_path, table, control = machine
    control.write_text(json.dumps({"mode": "timeout"}))
    tool = _tool()
    checklist = tool.Checklist()
    tool.check_outlived_wait(checklist, table, default_backend())
    [(verdict, step, detail)] = checklist.results
    assert (verdict, step) == ("PASS", "a run that outlives its wait") and "ERT_CMD_STATE_TIMEOUT" in detail


@pytest.mark.slow
def test_the_stand_in_prints_what_a_token_costs_in_calls(tmp_path):
    # one layer of each model, the real widths and vocabularies: the layer group's L round trips (layer 0's projections on the host),
    # one context per model, no weight copied while decoding
    import subprocess
    import sys

    tool = Path(__file__).resolve().parent.parent / "tools" / "npu_checklist.py"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent), "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, str(tool), "--stand-in", "--json", "--layers", "1"], capture_output=True,
                         text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    results = {(r["model"], r["weight_format"]): r for r in json.loads(run.stdout)["stand_in"]}
    models = {"qwen3-0.6b", "qwen3-0.6b+draft", "gemma-3-270m"}
    assert set(results) == {(m, f) for m in models for f in ("bf16", "int8")}
    for (model, fmt), r in results.items():
        assert r["worker_round_trips_per_step"] == r["layers"]
        assert r["contexts_opened"] == 1 and r["contexts_reopened_while_decoding"] == 0
        assert r["weight_bytes_while_decoding"] == 0 and r["weight_bytes_at_load"] > 0
        assert r["dispatches_per_token"] > 0 and r["bytes_copied_per_token"] > 0
        assert set(r["weight_bytes_resident"]) == {fmt}  # every linear on the array, in the model's format
    for model in models:  # int8 B buffers: one byte a weight where bf16's are two (same padded shapes)
        bf16, int8 = results[(model, "bf16")], results[(model, "int8")]
        assert bf16["weight_bytes_resident"]["bf16"] == 2 * int8["weight_bytes_resident"]["int8"]
        assert bf16["weight_bytes_at_load"] == 2 * int8["weight_bytes_at_load"]


def test_an_int8_design_is_checked_with_int8_weights_and_the_rounding_step_takes_a_bf16_one(machine, capsys):
    tmp_path, _, _ = machine
    table = fake_pyxrt.write_design_table(tmp_path / "mixed", [(64, 64, "int8"), (64, 128, "bf16")], M=64,
                                          tile=(16, 32, 16), columns=4)
    _tool().main(["--design", str(table), "--accel-dir", str(tmp_path / "accel"),
                  "--sysfs-dir", str(tmp_path / "sysfs"), "--timeout-ms", "2000"])
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("[PASS] start-up check 64x64: npu (tolerance int8-rows") for line in lines), lines
    assert any(line.startswith("[PASS] start-up check 64x128: npu (tolerance bfp16-blocks") for line in lines)
    assert any(line.startswith("[INFO] accumulator rounding: K=64 N=128") for line in lines)  # the bf16 design's
