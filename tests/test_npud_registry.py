"""Models load on first use, stay while memory allows, least recently used leave first."""

import pytest

import test_npud_support as fakes
from npud.config import ModelEntry, parse_config
from npud.daemon import Daemon
from npud.protocol import ApiError
from npud.registry import ModelRegistry


def _registry(tmp_path, budget, sizes):
    entries = []
    for name, nbytes in sizes.items():
        fakes.write_fake_checkpoint(tmp_path / name, nbytes=nbytes)
        entries.append(ModelEntry(name, str(tmp_path / name)))
    return ModelRegistry(tuple(entries), max_resident_bytes=budget, loader=fakes.load_model), entries


def test_the_prefix_cache_users_reach_the_loader(tmp_path):
    fakes.write_fake_checkpoint(tmp_path / "a", nbytes=10)
    seen = []

    def loader(*args, **kwargs):
        seen.append(kwargs["cache_users"])
        return fakes.load_model(*args, **kwargs)

    entries = (ModelEntry("a", str(tmp_path / "a")),)
    ModelRegistry(entries, max_resident_bytes=100, loader=loader, cache_users=3).get("a")
    ModelRegistry(entries, max_resident_bytes=100, loader=loader, cache_users=0).get("a")
    assert seen == [3, 0]


def test_load_once_and_keep_resident(tmp_path):
    reg, _ = _registry(tmp_path, 10_000, {"a": 1000})
    first = reg.get("a")
    assert reg.get("a") is first and reg.resident("a") is first
    assert reg.describe()[0]["resident"] and reg.describe()[0]["nbytes"] == 1000


def test_least_recently_used_is_unloaded_to_fit(tmp_path):
    reg, _ = _registry(tmp_path, 2500, {"a": 1000, "b": 1000, "c": 1000})
    reg.get("a")
    reg.get("b")
    reg.get("a")  # b is now the least recently used
    reg.get("c")
    assert reg.resident("a") is not None and reg.resident("b") is None and reg.resident("c") is not None


def test_models_in_use_are_not_unloaded(tmp_path):
    reg, _ = _registry(tmp_path, 1500, {"a": 1000, "b": 1000})
    reg.get("a")
    reg.get("b", keep={"a"})  # a holds a preempted session: over budget rather than lose it
    assert reg.resident("a") is not None and reg.resident("b") is not None


def test_unknown_and_broken_models(tmp_path):
    reg, _ = _registry(tmp_path, 10_000, {"a": 1000})
    with pytest.raises(ApiError) as info:
        reg.get("nope")
    assert info.value.code == "not_found"
    (tmp_path / "a" / "fake.json").write_text("{ broken")
    with pytest.raises(ApiError) as info:
        reg.get("a")
    assert info.value.code == "model_error" and "does not load" in info.value.message


def test_missing_files_are_a_model_error_and_an_engine_bug_is_not(tmp_path):
    reg = ModelRegistry((ModelEntry("a", str(tmp_path / "a")),), max_resident_bytes=0, loader=fakes.load_model)
    with pytest.raises(ApiError) as info:
        reg.get("a")  # no fake.json: OSError
    assert info.value.code == "model_error"

    def buggy(name, checkpoint_dir, **kwargs):
        raise ValueError("an engine bug, not a bad model")

    reg = ModelRegistry((ModelEntry("a", str(tmp_path / "a")),), max_resident_bytes=0, loader=buggy)
    with pytest.raises(ValueError, match="engine bug"):  # the device owner reports it as internal_error
        reg.get("a")


def test_reconfigure_unloads_changed_models_unless_in_use(tmp_path):
    reg, entries = _registry(tmp_path, 10_000, {"a": 1000, "b": 1000})
    reg.get("a")
    reg.get("b")
    moved = ModelEntry("a", str(tmp_path / "b"))
    reg.reconfigure((moved, entries[1]), 10_000, keep=set())
    assert reg.resident("a") is None and reg.resident("b") is not None
    reg.get("a")
    reg.reconfigure((entries[1],), 10_000, keep={"a"})
    assert reg.resident("a") is not None and reg.names == ("b",)


def test_the_daemon_gives_its_models_the_configured_prefix_cache_users(tmp_path):
    cfg = parse_config({"server": {"socket_path": str(tmp_path / "s.sock")},
                        "store": {"state_dir": str(tmp_path), "prefix_cache_users": 5}})
    assert Daemon(cfg, loader=fakes.load_model).registry.cache_users == 5
