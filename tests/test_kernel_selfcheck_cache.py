"""The self-check's stored pass (npud/kernels/host/checkcache.py): reused only under the same key
(the library's bytes, ISA path, threads, numerics version, kernel sources, CPU); a damaged or
foreign entry, NPUD_SELF_CHECK=always and a library whose bytes changed run the check again; a
start reuses it (a fresh process each).

Mutant this file kills (run by hand): the key over the library's name instead of its bytes
(test_a_library_changed_after_its_check_is_checked_again)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npud.kernels.host import checkcache, native

ROOT = Path(__file__).resolve().parent.parent
LIB = "0123456789abcdef" * 4  # a library's sha256


def seed(cache: Path) -> Path:
    """`cache` holding this process's compiled library and its manifest, so that a start there
    does not build it again; returns the library's path there."""
    native.library()  # built (or checked) in this process's cache
    source = native.library_path()
    for path in (source, source.with_name(source.name + ".json")):
        if path.exists():
            shutil.copy(path, cache)
    return cache / source.name


def test_the_key_covers_each_input():
    base = checkcache.check_key(LIB, "avx512", 2, 5)
    assert base == checkcache.check_key(LIB, "avx512", 2, 5)
    others = [checkcache.check_key("fedcba9876543210" * 4, "avx512", 2, 5),
              checkcache.check_key(LIB, "avx2", 2, 5), checkcache.check_key(LIB, "avx512", 1, 5),
              checkcache.check_key(LIB, "avx512", 2, 6)]
    assert len({base, *others}) == 5


def test_the_key_covers_the_kernel_sources_and_the_cpu(monkeypatch, tmp_path):
    base = checkcache.check_key(LIB, "avx512", 2, 5)
    monkeypatch.setattr(checkcache, "_cpu", lambda: "model name : another CPU")
    assert checkcache.check_key(LIB, "avx512", 2, 5) != base
    monkeypatch.undo()
    fake = tmp_path / "kernels"
    shutil.copytree(checkcache._KERNELS, fake, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.c", "*.h"))
    monkeypatch.setattr(checkcache, "_KERNELS", fake)
    assert checkcache.check_key(LIB, "avx512", 2, 5) == base
    check = fake / "host" / "check.py"
    check.write_text(check.read_text() + "\n# an edited check\n")
    assert checkcache.check_key(LIB, "avx512", 2, 5) != base


@pytest.mark.parametrize("hardware", [True, False])
def test_a_stored_pass_reads_back(tmp_path, hardware):
    checkcache.write_pass("k" * 64, hardware, tmp_path)
    assert checkcache.read_pass("k" * 64, tmp_path) == {"bf16_dot_hardware": hardware}
    assert checkcache.read_pass("j" * 64, tmp_path) is None


@pytest.mark.parametrize("body", ["", "{", "[]", '{"format": 1, "key": "OTHER", "bf16_dot_hardware": true}',
                                  '{"format": 99, "key": "KEY", "bf16_dot_hardware": true}',
                                  '{"format": 1, "key": "KEY", "bf16_dot_hardware": "yes"}'])
def test_a_damaged_or_foreign_entry_is_no_pass(tmp_path, body):
    key = "KEY" + "0" * 61
    checkcache.entry_path(key, tmp_path).write_text(body.replace('"KEY"', json.dumps(key)))
    assert checkcache.read_pass(key, tmp_path) is None


def test_always_runs_the_check(tmp_path, monkeypatch):
    checkcache.write_pass("k" * 64, True, tmp_path)
    monkeypatch.setenv("NPUD_SELF_CHECK", "always")
    assert checkcache.read_pass("k" * 64, tmp_path) is None


def _start(cache: Path, **env) -> str:
    """A fresh process's default_backend(): its log lines."""
    code = ("from npud.kernels.select import default_backend; from npud.kernels.host import native; "
            "b = default_backend(); print('backend', type(b).__name__, 'bf16hw', native.bf16_dot_hardware())")
    full = {k: v for k, v in os.environ.items() if k not in ("NPUD_SELF_CHECK", "CACHE_DIRECTORY")}
    full |= {"NPUD_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), **env}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=600)
    assert res.returncode == 0, res.stderr
    return res.stdout + res.stderr


def test_a_start_reuses_the_pass_of_the_same_build(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    seed(cache)  # the compiled library, so the test does not rebuild it
    first = _start(cache, NPUD_HOST_THREADS="2")
    assert "kernel_self_check_passed" in first and "kernel_self_check_reused" not in first
    (entry,) = cache.glob("self-check-*.json")
    second = _start(cache, NPUD_HOST_THREADS="2")
    assert "kernel_self_check_reused" in second and "kernel_self_check_passed" not in second
    assert first.splitlines()[-1] == second.splitlines()[-1]  # the same backend, the same bf16-dot path
    # another thread split is another key; NPUD_SELF_CHECK=always checks under the same one
    assert "kernel_self_check_passed" in _start(cache, NPUD_HOST_THREADS="1")
    assert "kernel_self_check_passed" in _start(cache, NPUD_HOST_THREADS="2", NPUD_SELF_CHECK="always")
    entry.write_text("{")  # damaged: checked (and stored) again
    assert "kernel_self_check_passed" in _start(cache, NPUD_HOST_THREADS="2")
    assert "kernel_self_check_reused" in _start(cache, NPUD_HOST_THREADS="2")


def test_a_library_changed_after_its_check_is_checked_again(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    library = seed(cache)
    assert "kernel_self_check_passed" in _start(cache, NPUD_HOST_THREADS="2")
    assert "kernel_self_check_reused" in _start(cache, NPUD_HOST_THREADS="2")
    # the same sources built again into other bytes (another compiler, say), under the same
    # name and with a manifest of their own, so they load: they are not the bytes that were checked
    data = library.read_bytes() + b"\0" * 64  # past the ELF's last section: it still loads
    library.write_bytes(data)
    manifest = library.with_name(library.name + ".json")
    fields = json.loads(manifest.read_text()) if manifest.exists() else {}
    fields.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest.write_text(json.dumps(fields))
    out = _start(cache, NPUD_HOST_THREADS="2")
    assert "kernel_self_check_passed" in out and "kernel_self_check_reused" not in out
    assert "cache_entry_rejected" not in out  # loaded as it is: the check, not a rebuild, caught it


def test_a_failed_check_is_not_stored(tmp_path, monkeypatch):
    import npud.kernels.host
    from npud.kernels import select

    seed(tmp_path)  # not rebuilt in the new cache directory
    monkeypatch.setenv("NPUD_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NPUD_SELF_CHECK", raising=False)
    monkeypatch.setattr(select, "_default", None)  # restored afterwards: the process's backend stays
    monkeypatch.setattr(npud.kernels.host, "check_batch_invariance", lambda host: ["f32 M=3"])
    backend = select.default_backend()
    assert isinstance(backend, select.RowwiseBackend)
    assert not list(tmp_path.glob("self-check-*.json"))
