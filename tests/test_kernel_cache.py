"""Kernels compiled once: a second and third engine start add nothing to the kernel cache.

Each start runs in its own process with NPUD_CACHE_DIR pointing at one fresh directory: the
first compiles the C GEMMs and the numba kernels into it; the later ones must only read it
(no new file, none rewritten), which is what makes a warm start fast and the cache bounded.

A compiled library is checked against the manifest written at its build before it is loaded
(npud/kernels/host/cache.py): a truncated, emptied or bit-flipped one, or one without a
manifest, is logged once, rebuilt and loaded, in a child process (so that loading a damaged
one would fail the test with its signal instead of killing pytest).

Mutant this file kills (run by hand, see the branch's report): the digest not compared
(test_a_damaged_library_is_rebuilt_and_loads[bit-flipped]).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npud.engine.testing.checkpoints import build_tiny_checkpoint

ROOT = Path(__file__).resolve().parent.parent

# One engine start: load, self-check, prefill, a step and a verify, and every other host kernel
# (serial and parallel builds) once, so that everything a server could compile is compiled.
CHILD = r"""
import sys
import numpy as np
from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.kernels.host import recurrent
from npud.kernels.host.backend import HostBackend

for fmt in ("bf16", "int8-q8"):
    f = Forward(Model.load(sys.argv[1], fmt))
    f.prefill([1, 2, 3])
    f.step(4, 3)
    f.step_batch_all([5, 6], 4)
b = HostBackend()
r = np.random.default_rng(0).standard_normal
x = r((2, 8)).astype(np.float32)
b.gelu_tanh_mul(x, x); b.sigmoid_mul(x, x); b.softcap(x, 30.0); b.l2_norm(x, 1e-6)
b.gated_rms_norm(x, x, np.ones(8, np.float32), 1e-6)
b.causal_conv1d_silu(x, np.zeros((8, 3), np.float32), np.ones((8, 4), np.float32))
b.gdn_gates(x[:, :2], x[:, :2], np.zeros(2, np.float32), np.zeros(2, np.float32))
q = r((2, 2, 4)).astype(np.float32)
for parallel in (False, True):
    out = np.empty_like(q)
    recurrent.gated_delta(parallel)(q, q, q, np.zeros((2, 2), np.float32), np.ones((2, 2), np.float32),
                                    np.zeros((2, 4, 4), np.float32), out, np.empty((2, 2, 4, 4), np.float32))
"""


def _snapshot(cache: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(cache)): (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_engine_starts_after_the_first_add_nothing_to_the_kernel_cache(tmp_path):
    ckpt = build_tiny_checkpoint(tmp_path / "ckpt")
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "CACHE_DIRECTORY")}
    env["NPUD_CACHE_DIR"] = str(cache)
    snapshots = []
    for _ in range(3):
        subprocess.run([sys.executable, "-c", CHILD, str(ckpt)], check=True, cwd=ROOT, env=env, timeout=600)
        snapshots.append(_snapshot(cache))
    assert any(name.startswith("npud_gemm-") for name in snapshots[0])  # the C library
    assert any(name.startswith("numba/") for name in snapshots[0])  # the numba kernels
    assert snapshots[1] == snapshots[0]  # no file added, none rewritten
    assert snapshots[2] == snapshots[0]


def test_the_library_is_named_by_every_source_and_header(tmp_path, monkeypatch):
    # a changed source or header must give a new library file, or a start would load a stale build
    from npud.kernels.host import native

    copies = []
    for src in native.SOURCES + native.HEADERS:
        copy = tmp_path / src.name
        copy.write_bytes(src.read_bytes())
        copies.append(copy)
    n = len(native.SOURCES)
    monkeypatch.setattr(native, "SOURCES", tuple(copies[:n]))
    monkeypatch.setattr(native, "HEADERS", tuple(copies[n:]))
    names = {native.library_path(tmp_path).name}
    for copy in copies:
        copy.write_bytes(copy.read_bytes() + b"\n")
        names.add(native.library_path(tmp_path).name)
    assert len(names) == len(copies) + 1


TOKENIZER_CHILD = """
from npud.engine import tokenizer_native
print("bound", tokenizer_native.library().spm_encode_bound(10))
"""


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip(data: bytes) -> bytes:
    """9 bytes inverted, spread over the file (the report's damage): the same size."""
    out = bytearray(data)
    for i in range(9):
        out[64 + i * (len(data) - 128) // 9] ^= 0xFF
    return bytes(out)


def _empty(data: bytes) -> bytes:
    return b""


@pytest.mark.parametrize("damage, reason", [(_truncate, "bytes, the manifest says"), (_flip, "sha256"),
                                            (_empty, "0 bytes, the manifest says"), (None, "no manifest")],
                         ids=["truncated", "bit-flipped", "emptied", "no-manifest"])
def test_a_damaged_library_is_rebuilt_and_loads(tmp_path, damage, reason):
    from npud.engine import tokenizer_native

    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "CACHE_DIRECTORY"}
    env |= {"NPUD_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    first = subprocess.run([sys.executable, "-c", TOKENIZER_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    library = tokenizer_native.library_path(cache)
    manifest = library.with_name(library.name + ".json")
    if damage is None:
        manifest.unlink(missing_ok=True)
    else:
        library.write_bytes(damage(library.read_bytes()))
    res = subprocess.run([sys.executable, "-c", TOKENIZER_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    out = res.stdout + res.stderr
    assert out.count("cache_entry_rejected") == 1 and str(library) in out and reason in out, out
    assert int(out.split("bound ", 1)[1].split()[0]) > 0  # the rebuilt library was loaded, and works
    data = library.read_bytes()
    assert json.loads(manifest.read_text())["sha256"] == hashlib.sha256(data).hexdigest()
    again = subprocess.run([sys.executable, "-c", TOKENIZER_CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0 and "cache_entry_rejected" not in again.stdout + again.stderr  # rebuilt for good


@pytest.mark.slow
def test_a_truncated_host_kernel_library_is_rebuilt_and_loads(tmp_path):
    """The report's bus error: the GEMM library cut short (compiles it twice: about a minute)."""
    from npud.kernels.host import native

    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "CACHE_DIRECTORY"}
    env |= {"NPUD_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    native.library()  # built (or checked) in this process's cache: copied, not compiled again here
    cache.mkdir()
    source = native.library_path()
    for path in (source, source.with_name(source.name + ".json")):
        if path.exists():
            shutil.copy(path, cache)
    library = cache / source.name
    library.write_bytes(library.read_bytes()[:100_000])
    res = subprocess.run([sys.executable, "-m", "npud.kernels.host"], capture_output=True, text=True, env=env,
                         timeout=900)
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr}"
    out = res.stdout + res.stderr
    assert out.count("cache_entry_rejected") == 1 and "host_kernels_built" in out and str(library) in out
