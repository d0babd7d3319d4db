"""npud's cache directory and its trust rule (npud/kernels/cachedir.py): a cache that is not npud's
own (another uid's, or writable by group or others, anywhere in its tree) is refused, named, and
never read; npud runs without it. A per-user cache is made 0700 and npud's files in it 0600; under
systemd the unit's directory keeps its mode.

The refusal tests run the loading in a child process with a library planted where the cache
would have it (one that writes a file when it is loaded, with a manifest that matches it): a
child that loaded it leaves the file behind, and a crash fails the test instead of pytest.

Mutants these tests kill (run by hand, see the branch's report): the owner check skipped
(test_a_cache_that_is_not_ours_is_refused_and_never_loaded[foreign-owner],
test_the_rule[_foreign_owner], test_the_daemon_names_a_refused_cache_and_serves_without_it); the
tree not walked below the root
(test_a_cache_that_is_not_ours_is_refused_and_never_loaded[foreign-subdir, writable-file]); a
refused cache used anyway instead of the private directory (every refusal test); per-user
directories made with the umask's mode (test_a_per_user_cache_is_made_0700_and_npuds_files_in_it_0600).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
OTHER_UID = 65534  # nobody
SUBDIRS = ("packed", "tokenizers", "pass-costs", "models", "numba")  # what npud makes in its cache
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to give a directory to another uid")

PLANTED_C = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen(getenv("PLANTED_MARKER"), "w");
    if (f) { fputs("planted code ran\n", f); fclose(f); }
}
"""

CHILD = r"""
from npud.engine import tokenizer_native
from npud.kernels.host.cache import cache_dir
lib = tokenizer_native.library()
print("bound", lib.spm_encode_bound(10))
print("in_use", cache_dir())
"""


def _env(cache: Path, **extra) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CACHE_DIRECTORY", "NPUD_CACHE_DIR")}
    return env | {"NPUD_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)} | extra


def _plant(cache: Path, tmp_path: Path) -> Path:
    """A library that leaves a mark when loaded, where the tokenizer library would be, with a
    manifest that matches it (whoever can write the directory can write both)."""
    from npud.engine import tokenizer_native

    source = tmp_path / "planted.c"
    source.write_text(PLANTED_C)
    target = tokenizer_native.library_path(cache)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(target), str(source)], check=True)
    data = target.read_bytes()
    target.with_name(target.name + ".json").write_text(json.dumps({
        "format": "npud-compiled-library", "library": target.name, "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest()}))
    return target


def _foreign_owner(cache: Path) -> str:
    os.chown(cache, OTHER_UID, OTHER_UID)
    return f"{cache} belongs to uid {OTHER_UID}"


def _writable_by_all(cache: Path) -> str:
    cache.chmod(0o777)
    return f"{cache} has mode 0o777"


def _foreign_subdir(cache: Path) -> str:
    packed = cache / "packed"  # another user made it first, open to all
    packed.mkdir(mode=0o777)
    packed.chmod(0o777)
    os.chown(packed, OTHER_UID, OTHER_UID)
    return f"{packed} belongs to uid {OTHER_UID}"


def _writable_file(cache: Path) -> str:
    entry = cache / "tokenizers" / "entry.json"
    entry.parent.mkdir()
    entry.write_text("{}")
    entry.chmod(0o666)
    return f"{entry} has mode 0o666"


@needs_root
@pytest.mark.parametrize("spoil, plant", [(_foreign_owner, True), (_writable_by_all, True), (_foreign_subdir, False),
                                          (_writable_file, False)],
                         ids=["foreign-owner", "writable-by-all", "foreign-subdir", "writable-file"])
def test_a_cache_that_is_not_ours_is_refused_and_never_loaded(tmp_path, spoil, plant):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    marker = tmp_path / "planted-ran"
    if plant:
        _plant(cache, tmp_path)
    why = spoil(cache)
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300,
                         env=_env(cache, PLANTED_MARKER=str(marker)))
    assert not marker.exists(), "the planted library was loaded"
    assert res.returncode == 0, res.stderr
    out = res.stdout + res.stderr
    assert "cache_dir_refused" in out and why in out, out  # which path, and why
    lines = dict(line.split(" ", 1) for line in res.stdout.splitlines() if line.startswith(("bound", "in_use")))
    in_use = Path(lines["in_use"])
    assert int(lines["bound"]) > 0  # the library works: built in the process's own directory
    assert in_use != cache and not in_use.is_relative_to(cache)
    assert not in_use.exists()  # removed at exit


@needs_root
@pytest.mark.parametrize("spoil", [_foreign_owner, _writable_by_all, _foreign_subdir, _writable_file])
def test_the_rule(tmp_path, spoil, monkeypatch):
    from npud.kernels import cachedir

    cache = tmp_path / "cache"
    cache.mkdir(mode=0o755)
    why = spoil(cache)
    monkeypatch.setenv("NPUD_CACHE_DIR", str(cache))
    monkeypatch.delenv("CACHE_DIRECTORY", raising=False)
    state = cachedir.cache_state()
    assert not state.trusted and state.refused.startswith(why)
    assert state.path == cachedir.private_dir() and cachedir.cache_dir() == state.path
    assert state.to_wire() == {"dir": str(cache), "trusted": False, "reason": state.refused}


def test_a_root_owned_cache_is_fine_for_root_and_links_are_followed_only_at_the_top(tmp_path, monkeypatch):
    from npud.kernels import cachedir

    real = tmp_path / "real"
    real.mkdir(mode=0o755)
    link = tmp_path / "link"
    link.symlink_to(real)  # ~/.cache/npud may point elsewhere: the directory it names is checked
    monkeypatch.setenv("NPUD_CACHE_DIR", str(link))
    state = cachedir.cache_state()
    assert state.trusted and state.path == real and stat.S_IMODE(real.stat().st_mode) == 0o755
    inside = tmp_path / "inside"
    inside.mkdir()
    (inside / "models").symlink_to(real)  # npud makes no link in its cache
    monkeypatch.setenv("NPUD_CACHE_DIR", str(inside))
    assert cachedir.cache_state().refused == f"{inside / 'models'} is a symbolic link (npud makes none in its cache)"


def test_a_cache_that_cannot_be_made_is_refused(tmp_path, monkeypatch):
    from npud.kernels import cachedir

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NPUD_CACHE_DIR", str(blocker / "cache"))
    state = cachedir.cache_state()
    assert not state.trusted and state.refused.startswith(f"{blocker / 'cache'} cannot be made")


def test_a_per_user_cache_is_made_0700_and_npuds_files_in_it_0600(tmp_path):
    cache = tmp_path / "home" / ".cache" / "npud"  # not there yet
    code = ("from npud.engine import tokenizer_native; from npud.kernels.host import checkcache; "
            "tokenizer_native.library(); checkcache.write_pass('k' * 64, True)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env=_env(cache), preexec_fn=lambda: os.umask(0o022))
    assert res.returncode == 0, res.stderr
    modes = {str(p.relative_to(cache)): stat.S_IMODE(p.stat().st_mode) for p in cache.rglob("*")}
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    assert {modes[name] for name in SUBDIRS} == {0o700}
    files = [name for name in modes if (cache / name).is_file()]
    assert any(name.startswith("npud_tokenizer-") and name.endswith(".so") for name in files)
    assert any(name.endswith(".so.json") for name in files) and any(name.startswith("self-check-") for name in files)
    assert {modes[name] for name in files} == {0o600}, modes


def test_under_systemd_the_units_directory_keeps_its_mode(tmp_path, monkeypatch):
    from npud.kernels import cachedir

    unit_dir = tmp_path / "var-cache-npud"
    unit_dir.mkdir()
    unit_dir.chmod(0o755)  # CacheDirectoryMode=, the default
    monkeypatch.delenv("NPUD_CACHE_DIR", raising=False)
    monkeypatch.setenv("CACHE_DIRECTORY", str(unit_dir))
    old = os.umask(0o027)  # the unit's UMask=
    try:
        state = cachedir.cache_state()
    finally:
        os.umask(old)
    assert state.trusted and state.mode is cachedir.CacheMode.SERVICE
    assert stat.S_IMODE(unit_dir.stat().st_mode) == 0o755  # neither tightened nor loosened
    assert {stat.S_IMODE((unit_dir / name).stat().st_mode) for name in SUBDIRS} == {0o750}
    assert cachedir.SUBDIRS == SUBDIRS
    loose = tmp_path / "loose"
    loose.mkdir()
    loose.chmod(0o775)  # CacheDirectoryMode=0775: group-writable, refused as any other
    monkeypatch.setenv("CACHE_DIRECTORY", str(loose))
    assert cachedir.cache_state().refused == f"{loose} has mode 0o775 (it must be at most 0755)"
    assert stat.S_IMODE(loose.stat().st_mode) == 0o775


@needs_root
def test_numba_cache_inside_a_refused_cache_is_not_used(tmp_path, monkeypatch):
    numba = pytest.importorskip("numba")
    from npud.kernels import cachedir
    from npud.kernels.host import cache

    root = tmp_path / "cache"
    root.mkdir()
    _foreign_owner(root)
    monkeypatch.setenv("NPUD_CACHE_DIR", str(root))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(root / "numba"))  # NUMBA_CACHE_DIR=%C/npud/numba
    cache.use_for_numba()
    assert numba.config.CACHE_DIR == str(cachedir.private_dir() / "numba")
    own = tmp_path / "own-numba"
    monkeypatch.setenv("NPUD_CACHE_DIR", str(tmp_path / "fine"))
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(own))  # elsewhere, and ours: kept
    cache.use_for_numba()
    assert numba.config.CACHE_DIR == str(own)


@needs_root
def test_the_daemon_names_a_refused_cache_and_serves_without_it(tmp_path):
    from npud_fixture import python_env
    from test_npud_support import DaemonProc, short_tempdir, write_fake_checkpoint

    workdir = short_tempdir()
    cache = workdir / "cache"
    cache.mkdir()
    why = _foreign_owner(cache)
    checkpoint = write_fake_checkpoint(workdir / "fake", tokens_per_round=2)
    d = DaemonProc(workdir, [{"name": "fake", "checkpoint_dir": str(checkpoint)}], fake_engine=True)
    stderr = workdir / "stderr"
    try:
        d.start(env={"NPUD_CACHE_DIR": str(cache)}, stderr_path=stderr)
        with d.client() as c:
            assert c.complete("hello", max_tokens=2).wait()["text"]  # it serves
            status = c.device_status()
        assert status["cache"]["dir"] == str(cache) and status["cache"]["trusted"] is False
        assert status["cache"]["reason"].startswith(why)
        (event,) = d.events("cache_dir_refused")
        assert event["dir"] == str(cache) and event["reason"].startswith(why) and event["level"] == "warning"
        assert f"npud: warning: not using the cache directory {cache}: {why}" in stderr.read_text()
        run = subprocess.run([sys.executable, "-m", "npud.clients.npuctl", "device"], capture_output=True, text=True,
                             env=python_env(d.socket), cwd=ROOT, timeout=60)
        assert run.returncode == 0, run.stderr
        (line,) = [line for line in run.stdout.splitlines() if line.startswith("cache:")]
        assert f"not used ({why}" in line
        assert d.terminate(timeout=30) == 0
        assert not Path(event["instead"]).exists()  # its private directory goes with it
    finally:
        d.stop()
        shutil.rmtree(workdir, ignore_errors=True)
