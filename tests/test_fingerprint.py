"""The prefix-cache key (npud/engine/fingerprint.py): whole-file digests remembered by stat, and a
persisted cache that misses after any change to the numbers and hits after a plain restart.

Mutants run (edit, run this file and tests/test_prefix_cache.py, revert) and what fails:
  the key without the weight format      test_the_key_names..., persisted[format]
  the key without the backend            test_the_key_names..., persisted[backend]
  the key without NUMERICS_VERSION       test_the_key_names..., persisted[numerics_version]
  the key without the toolchain versions test_the_key_names...
  the old sampled fingerprint as key     persisted[format], [backend], [numerics_version]
  memo by path only (stat not compared)  rehashed[new_mtime], rehashed[mtime_set_back], persisted[edit]
  memo without the ctime                 rehashed[mtime_set_back]
  only the first 64 KiB hashed           test_digest_is_the_sha256..., persisted[edit]
  no settle rule / unsettled persisted   test_a_file_changed_just_now_is_not_remembered
  files under another key kept           persisted[every change], test_prefix_cache's
                                         test_files_under_another_key_are_dropped_with_one_line
"""

from __future__ import annotations

import hashlib
import json
import os
import struct

import numpy as np
import pytest
from structlog.testing import capture_logs

from npud.engine import fingerprint
from npud.engine.fingerprint import MEMO_FILE, DigestMemo, FingerprintError, numerics_key
from npud.engine.api import GenerateRequest, GenerationParams
from npud.engine.session import LoadedModel as ServedModel
from npud.kernels.select import RowwiseBackend, default_backend
from npud.kernels import base as kernels_base
from npud.kernels.base import numerics_identity

PROMPT = "def add(a, b):\n    return a + b\nfor i in range(10):\n    total += i * i\nclass Point:\n"


@pytest.fixture
def fresh_process(monkeypatch):
    """A process memo of its own, as a restarted daemon has; returns a function that empties
    it again (the next 'restart') and the count of files opened for hashing."""
    monkeypatch.setattr(fingerprint, "_process_memo", {})
    opened = []
    real_open = open

    def counting_open(path, *args, **kwargs):
        opened.append(os.path.basename(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(fingerprint, "open", counting_open, raising=False)

    def restart():
        fingerprint._process_memo.clear()

    return restart, opened


@pytest.fixture
def settled(monkeypatch):
    """Files written by the test count as settled at once (they were written milliseconds ago)."""
    monkeypatch.setattr(fingerprint, "SETTLE_NS", 0)


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


# ---------------------------------------------------------------------------- the memo


def test_digest_is_the_sha256_of_the_whole_file(tmp_path, fresh_process):
    data = np.random.default_rng(0).integers(0, 256, 3 * (1 << 20) + 17, dtype=np.uint8).tobytes()
    path = _write(tmp_path / "w.safetensors", data)
    assert DigestMemo().digest(path) == hashlib.sha256(data).hexdigest()


def test_an_unchanged_file_is_not_read_again_after_a_restart(tmp_path, fresh_process, settled):
    restart, opened = fresh_process
    files = [_write(tmp_path / "config.json", b"{}"), _write(tmp_path / "model.safetensors", b"x" * 4096)]
    memo_path = tmp_path / "cache" / MEMO_FILE
    first = [DigestMemo(memo_path).digest(p) for p in files]
    memo = DigestMemo(memo_path)
    key = numerics_key(files, memo, weight_format="bf16", backend=default_backend())
    assert opened == ["config.json", "model.safetensors"]  # read once, by the first memo
    restart()
    again = DigestMemo(memo_path)
    assert numerics_key(files, again, weight_format="bf16", backend=default_backend()) == key
    assert [again.digest(p) for p in files] == first
    assert opened == ["config.json", "model.safetensors"] and again.files_read == 0
    assert set(json.loads(memo_path.read_text())["files"]) == {str(p.resolve()) for p in files}


@pytest.mark.parametrize("how", ["new_mtime", "mtime_set_back"])
def test_a_changed_file_of_the_same_size_is_rehashed(tmp_path, fresh_process, settled, how):
    """Same size; its mtime new, or set back to the old one (the ctime still moves)."""
    restart, opened = fresh_process
    path = _write(tmp_path / "model.safetensors", b"a" * 4096)
    memo_path = tmp_path / MEMO_FILE
    memo = DigestMemo(memo_path)
    old = memo.digest(path)
    memo.save()
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"b")
    if how == "new_mtime":
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000_000))
    else:
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert after.st_size == before.st_size
    assert (after.st_mtime_ns != before.st_mtime_ns) == (how == "new_mtime")
    assert after.st_ctime_ns != before.st_ctime_ns  # the precondition of the set-back case
    restart()
    opened.clear()
    new = DigestMemo(memo_path).digest(path)
    assert opened == ["model.safetensors"]
    assert new != old and new == hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_file_changed_just_now_is_not_remembered(tmp_path, fresh_process):
    """Its next change could fall in the same timestamp tick and keep its stat."""
    restart, opened = fresh_process
    path = _write(tmp_path / "model.safetensors", b"a" * 4096)
    memo = DigestMemo(tmp_path / MEMO_FILE)
    memo.digest(path)
    memo.save()
    memo.digest(path)
    DigestMemo(tmp_path / MEMO_FILE).digest(path)
    assert opened == ["model.safetensors"] * 3


def test_a_bad_memo_is_ignored_and_rewritten(tmp_path, fresh_process, settled):
    memo_path = _write(tmp_path / MEMO_FILE, b"{not json")
    path = _write(tmp_path / "model.safetensors", b"a" * 64)
    with capture_logs() as logs:
        memo = DigestMemo(memo_path)
    assert [e["event"] for e in logs] == ["cache_entry_rejected"] and logs[0]["cache"] == "digest-memo"
    assert memo.digest(path) == hashlib.sha256(b"a" * 64).hexdigest()
    memo.save()
    assert json.loads(memo_path.read_text())["hash"] == "sha256"


def test_a_missing_file_is_a_fingerprint_error(tmp_path):
    with pytest.raises(FingerprintError, match="cannot read"):
        DigestMemo().digest(tmp_path / "nowhere.safetensors")


# ---------------------------------------------------------------------------- the key


class _Design:
    def identity(self):
        return "design-a"


class _Xrt:
    name = "xrt"

    def __init__(self, design):
        self.design = design

    def numerics_id(self):
        return f"xrt/design={self.design.identity()}/activations=bf16"


def test_the_key_names_format_backend_design_numerics_version_and_toolchain(tmp_path, fresh_process, monkeypatch):
    files = [_write(tmp_path / "config.json", b"{}"), _write(tmp_path / "model.safetensors", b"w" * 512)]
    host = default_backend()

    def key(**kw):
        args = dict(weight_format="bf16", backend=host) | kw
        return numerics_key(files, DigestMemo(), **args)

    base = key()
    other_design = _Design()
    other_design.identity = lambda: "design-b"
    keys = {base, key(weight_format="fp32"), key(weight_format="int8"), key(backend=RowwiseBackend(host)),
            key(backend=_Xrt(_Design())), key(backend=_Xrt(other_design))}
    assert len(keys) == 6
    assert numerics_identity(host) == "host/activations=fp32"
    assert numerics_identity(RowwiseBackend(host)) == "rowwise(host/activations=fp32)"
    with monkeypatch.context() as m:
        m.setattr(kernels_base, "NUMERICS_VERSION", kernels_base.NUMERICS_VERSION + 1)
        assert key() not in keys
    real = fingerprint.toolchain()
    assert real["numpy"] == np.__version__
    with monkeypatch.context() as m:
        m.setattr(fingerprint, "toolchain", lambda: real | {"numba": "0.0-other"})
        assert key() not in keys
    _write(files[0], b"{ }")
    assert key() != base


def test_the_npu_backend_names_its_design_not_the_hosts(tmp_path, monkeypatch):
    """XrtBackend answers unknown attributes with the host's: numerics_id must be its own, and
    another build of a design (its xclbin's bytes) is another identity."""
    import fake_pyxrt
    from npud.kernels import xrt

    fake_pyxrt.install(monkeypatch)  # the simulated device (tests/fake_pyxrt.py)
    table = fake_pyxrt.write_design_table(tmp_path, [(64, 64)])
    first = numerics_identity(xrt.load_backend(table, default_backend()))
    assert first.startswith("xrt-simulator/designs=") and "activations=bf16" in first
    assert first != numerics_identity(default_backend())
    xclbin = tmp_path / "gemm_64x64.xclbin"
    xclbin.write_text(xclbin.read_text() + " ")
    assert numerics_identity(xrt.load_backend(table, default_backend())) != first


# ---------------------------------------------------------------------------- a persisted cache


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    # hidden_size 128: a layer's input RMSNorm weight is 512 bytes in float32
    return build_tiny_checkpoint(tmp_path_factory.mktemp("fp") / "ckpt", model_type="llama", seed=2, hidden_size=128)


def _load(path, cache_dir, fmt="fp32"):
    return ServedModel.load("m", path, weight_format=fmt, cache_dir=cache_dir, cache_block=8, backend="host")


def _run(served):
    """(token ids, tokens restored from the cache) of one greedy run; the cache is flushed."""
    session = served.start(GenerateRequest(prompt=PROMPT, params=GenerationParams(max_tokens=12)))
    while not session.done:
        session.run_round()
    served.prefix_cache.flush()
    return session.result().token_ids, session.num_cached_tokens


def _scale_tensor(path, name: str, factor: float) -> None:
    """Scale one float32 tensor of a safetensors file in place (same size, same inode)."""
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        entry = json.loads(f.read(n))[name]
        begin, end = entry["data_offsets"]
        assert entry["dtype"] == "F32" and end - begin == 512
        f.seek(8 + n + begin)
        values = np.frombuffer(f.read(end - begin), np.float32) * np.float32(factor)
        f.seek(8 + n + begin)
        f.write(values.tobytes())


@pytest.mark.parametrize("change", ["none", "format", "backend", "edit", "numerics_version"])
def test_a_persisted_cache_misses_after_any_change_to_the_numbers(checkpoint, tmp_path, fresh_process, settled,
                                                                     monkeypatch, change):
    restart, _ = fresh_process
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in checkpoint.iterdir():
        (ckpt / f.name).write_bytes(f.read_bytes())
    cache_dir = tmp_path / "cache"
    cold, cached = _run(_load(ckpt, cache_dir))
    assert cached == 0 and list(cache_dir.glob("*.safetensors"))
    restart()
    fmt = "fp32"
    if change == "format":
        fmt = "bf16"
    elif change == "backend":
        import npud.engine.session

        rowwise = RowwiseBackend(default_backend())
        monkeypatch.setattr(npud.engine.session, "select_backend", lambda *a, **kw: (rowwise, "a test's other backend"))
    elif change == "edit":
        before = os.stat(ckpt / "model.safetensors")
        _scale_tensor(ckpt / "model.safetensors", "model.layers.0.input_layernorm.weight", 2.0)
        after = os.stat(ckpt / "model.safetensors")
        assert (after.st_size, after.st_ino) == (before.st_size, before.st_ino)
    elif change == "numerics_version":
        monkeypatch.setattr(kernels_base, "NUMERICS_VERSION", kernels_base.NUMERICS_VERSION + 1)
    with capture_logs() as logs:
        served = _load(ckpt, cache_dir, fmt)
    tokens, cached = _run(served)
    stale = [e for e in logs if e["event"] == "prefix_cache_stale_dropped"]
    if change == "none":
        assert cached > 0 and tokens == cold and not stale
        return
    assert cached == 0, "a snapshot of other numerics was restored"
    assert len(stale) == 1 and stale[0]["files"] >= 1
    restart()
    monkeypatch.setattr(fingerprint, "SETTLE_NS", 0)
    fresh = _load(ckpt, None, fmt)  # no cache dir: a cold run of the changed model
    assert _run(fresh)[0] == tokens


def test_checkpoint_files_are_config_index_and_every_shard(tmp_path):
    from npud.engine.weights import WeightsError, checkpoint_files
    from npud.engine.weights.checkpoint import INDEX_FILE

    with pytest.raises(WeightsError):
        checkpoint_files(tmp_path)
    _write(tmp_path / "config.json", b"{}")
    _write(tmp_path / "model.safetensors", b"")
    assert checkpoint_files(tmp_path) == [tmp_path / "config.json", tmp_path / "model.safetensors"]
    shards = ["model-00002-of-00002.safetensors", "model-00001-of-00002.safetensors"]
    for name in shards:
        _write(tmp_path / name, b"")
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    assert checkpoint_files(tmp_path) == [tmp_path / "config.json", tmp_path / INDEX_FILE,
                                          *(tmp_path / n for n in sorted(shards))]
    gguf = _write(tmp_path / "model.gguf", b"GGUF")
    assert checkpoint_files(gguf) == [gguf]
