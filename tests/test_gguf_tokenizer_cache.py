"""The GGUF tokenizer cache (npud/engine/gguf/tokenizer_cache.py): a hit gives the tokenizer a fresh
build gives (ids, decoding, fingerprint, special tokens, template, decodable ids) on tiny files
of both tokenizer kinds and on the real gemma-3-270m; entries are keyed by the file's content;
a corrupt, foreign or stale entry is ignored and replaced; the file is hashed once per process."""

from __future__ import annotations

import hashlib
import json
import os

import numpy as np
import pytest

from npud.engine import fingerprint
from npud.engine.gguf import open_gguf
from npud.engine.gguf import tokenizer_cache as tc
from npud.engine.gguf.tokenizer import gguf_tokenizer
from npud.engine.tokenizer import Tokenizer, TokenizerError
from gguf_checkpoints import write_tiny_gguf

pytest.importorskip("gguf") if os.environ.get("CI") != "true" else __import__("gguf")

TEXTS = ["def total(values):\n    return sum(values)\n", "  the café  naïve\tvalue <eos> 12345 ☃ 🙂",
         "", "speculative decoding of the value", "<bos><pad>print(self.value)"]


@pytest.fixture(autouse=True)
def fresh_memos(monkeypatch):
    monkeypatch.setattr(fingerprint, "_directory_memos", {})  # each test its own memo file, as a new process would have
    monkeypatch.setattr(fingerprint, "SETTLE_NS", 0)  # files written just now may be remembered


@pytest.fixture(params=["llama", "gpt2"], scope="module")
def tiny(request, tmp_path_factory):
    arch = "gemma3" if request.param == "llama" else "qwen2"
    path = tmp_path_factory.mktemp("tok") / f"{arch}.gguf"
    write_tiny_gguf(path, arch, tokenizer=request.param, chat_template="{{ messages[0]['content'] }}")
    return (path)


def same_tokenizer(a: Tokenizer, b: Tokenizer) -> None:
    for text in TEXTS:
        for special in (False, True):
            assert a.encode(text, add_special_tokens=special) == b.encode(text, add_special_tokens=special)
    ids = list(range(a.vocab_size))
    assert a.decode(ids) == b.decode(ids)
    assert a.fingerprint == b.fingerprint
    assert (a.vocab_size, a.bos_token_id, a.eos_token_ids, a.special_token_ids, a.add_bos_token) == \
           (b.vocab_size, b.bos_token_id, b.eos_token_ids, b.special_token_ids, b.add_bos_token)
    assert a.chat_template_names == b.chat_template_names
    for width in (a.vocab_size, a.vocab_size + 7):
        da, db = a.decodable(width), b.decodable(width)
        assert (da is None) == (db is None) and (da is None or np.array_equal(da, db))


def backend_state(tok: Tokenizer):
    """All a backend is made of: the library's own JSON, or the native tokenizer's arrays."""
    b = tok._backend
    if hasattr(b, "library"):
        return b.library.to_str()
    return (b._offsets.tobytes(), b._blob.tobytes(), b._merges.tobytes(), b._control, b._user, b._gemma, b._bos)


def entries(root):
    return sorted(p for p in root.glob("*.json") if p.name != fingerprint.MEMO_FILE)


def test_miss_then_hit_gives_the_fresh_tokenizer(tiny, tmp_path):
    fresh = gguf_tokenizer(open_gguf(tiny))
    first, status = tc.load_gguf_tokenizer(tiny, tmp_path)
    assert status == "miss"
    (entry,) = entries(tmp_path)
    assert entry.stem == fingerprint.DigestMemo().digest(tiny)  # keyed by the file's content
    second, status = tc.load_gguf_tokenizer(tiny, tmp_path)
    assert status == "hit"
    same_tokenizer(first, fresh)
    same_tokenizer(second, fresh)
    assert backend_state(second) == backend_state(fresh)  # the whole backend
    assert entries(tmp_path) == [entry]


def test_a_hit_does_not_build(tiny, tmp_path, monkeypatch):
    tc.load_gguf_tokenizer(tiny, tmp_path)

    def refuse(_g):
        raise AssertionError("built although the cache holds it")

    monkeypatch.setattr(tc, "gguf_tokenizer_parts", refuse)
    assert tc.load_gguf_tokenizer(tiny, tmp_path)[1] == "hit"


def test_the_file_is_hashed_once_per_process_and_not_at_the_next_start(tiny, tmp_path, monkeypatch):
    monkeypatch.setattr(fingerprint, "_process_memo", {})
    tc.load_gguf_tokenizer(tiny, tmp_path)
    memo = fingerprint._directory_memos[tmp_path]
    assert memo.files_read == 1
    # the prefix cache's key, in the same process, reads the process-wide memo
    other = fingerprint.DigestMemo(tmp_path / "model" / fingerprint.MEMO_FILE)
    other.digest(tiny)
    assert other.files_read == 0
    # a new process: an empty process memo, the persisted one in the cache directory
    monkeypatch.setattr(fingerprint, "_process_memo", {})
    monkeypatch.setattr(fingerprint, "_directory_memos", {})
    assert tc.load_gguf_tokenizer(tiny, tmp_path)[1] == "hit"
    assert fingerprint._directory_memos[tmp_path].files_read == 0
    later = fingerprint.DigestMemo()
    later.digest(tiny)
    assert later.files_read == 0


@pytest.mark.parametrize("damage", ["truncate", "flip_payload", "altered_merge", "flip_header", "garbage", "empty",
                                    "settings"])
def test_a_corrupt_entry_is_ignored_and_rebuilt(tiny, tmp_path, damage):
    fresh, _ = tc.load_gguf_tokenizer(tiny, tmp_path)
    (entry,) = entries(tmp_path)
    good = entry.read_bytes()
    header, _, payload = good.partition(b"\n")
    if damage == "truncate":
        bad = good[: len(good) - 100]
    elif damage == "flip_payload":
        i = len(header) + 1 + len(payload) // 2
        bad = good[:i] + bytes([good[i] ^ 0x01]) + good[i + 1:]
    elif damage == "altered_merge":  # the last two merges swapped: a recipe the library takes, another tokenizer
        bad = good[:-16] + good[-8:] + good[-16:-8]
        assert bad != good
    elif damage == "flip_header":
        bad = good.replace(b'"format"', b'"formet"', 1)
    elif damage == "garbage":
        bad = os.urandom(len(good))
    elif damage == "empty":
        bad = b""
    else:  # a header whose payload digest holds but whose settings the engine cannot take
        h = json.loads(header)
        h["settings"]["special"] = {"bos_token": "no such token anywhere"}
        bad = json.dumps(h).encode() + b"\n" + payload
    entry.write_bytes(bad)
    again, status = tc.load_gguf_tokenizer(tiny, tmp_path)
    assert status == "rebuilt"
    same_tokenizer(again, fresh)
    assert entry.read_bytes() == good  # replaced by a good entry
    assert tc.load_gguf_tokenizer(tiny, tmp_path)[1] == "hit"


@pytest.mark.parametrize("field", ["file_sha256", "builder", "tokenizers", "backend"])
def test_a_foreign_or_stale_entry_is_ignored(tmp_path, field):
    a = (write_tiny_gguf(tmp_path / "a.gguf", "gemma3", tokenizer="llama"))
    b = (write_tiny_gguf(tmp_path / "b.gguf", "qwen2", tokenizer="gpt2"))
    root = tmp_path / "cache"
    tc.load_gguf_tokenizer(a, root)
    tc.load_gguf_tokenizer(b, root)
    digest_a, digest_b = (fingerprint.DigestMemo().digest(p) for p in (a, b))
    entry_a, entry_b = root / f"{digest_a}.json", root / f"{digest_b}.json"
    if field == "file_sha256":  # b's entry under a's name: a valid entry, for another file
        entry_a.write_bytes(entry_b.read_bytes())
    else:  # an entry from another builder, tokenizers version (b's: a's is native) or backend
        path, entry = (b, entry_b) if field == "tokenizers" else (a, entry_a)
        header, _, payload = entry.read_bytes().partition(b"\n")
        h = json.loads(header)
        assert h["backend"] == ("tokenizers" if field == "tokenizers" else "native")
        h[field] = {"tokenizers": "0", "backend": "tokenizers", "builder": h["builder"] + 1}[field]
        entry.write_bytes(json.dumps(h).encode() + b"\n" + payload)
        a = path
    got, status = tc.load_gguf_tokenizer(a, root)
    assert status == "rebuilt"
    same_tokenizer(got, gguf_tokenizer(open_gguf(a)))


def test_changed_content_is_a_new_entry(tmp_path):
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "gemma3", tokenizer="llama", chat_template="A")
    first, _ = tc.load_gguf_tokenizer((path), tmp_path / "cache")
    write_tiny_gguf(path, "gemma3", tokenizer="llama", chat_template="B")  # same size, other bytes
    second, status = tc.load_gguf_tokenizer((path), tmp_path / "cache")
    assert status == "miss"
    assert second.apply_chat_template([{"role": "user", "content": "x"}]) == "B"
    assert len(entries(tmp_path / "cache")) == 2


def test_entries_are_bounded_least_recently_used_first(tmp_path, monkeypatch):
    monkeypatch.setattr(tc, "MAX_ENTRIES", 2)
    root = tmp_path / "cache"
    paths = [(write_tiny_gguf(tmp_path / f"{i}.gguf", "gemma3", tokenizer="llama", chat_template=str(i)))
             for i in range(3)]
    tc.load_gguf_tokenizer(paths[0], root)
    tc.load_gguf_tokenizer(paths[1], root)
    first = root / f"{fingerprint.DigestMemo().digest(paths[0])}.json"
    os.utime(first, ns=(1, 1))  # 0's entry the older
    os.utime(root / f"{fingerprint.DigestMemo().digest(paths[1])}.json", ns=(2, 2))
    assert tc.load_gguf_tokenizer(paths[0], root)[1] == "hit"  # and now the more recently used
    tc.load_gguf_tokenizer(paths[2], root)
    assert len(entries(root)) == 2 and first.exists()
    assert tc.load_gguf_tokenizer(paths[1], root)[1] == "miss"


def test_an_unwritable_cache_still_gives_the_tokenizer(tiny, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    got, status = tc.load_gguf_tokenizer(tiny, blocker / "cache")
    assert status == "miss"
    same_tokenizer(got, gguf_tokenizer(open_gguf(tiny)))


def test_not_a_gguf_is_a_tokenizer_error(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"GGUF" + b"\0" * 3)
    with pytest.raises(TokenizerError):
        tc.load_gguf_tokenizer(path, tmp_path / "cache")


def test_gemma_3_270m_ids_from_the_cache_equal_a_fresh_build(tmp_path):
    from real_gemma import PROMPTS, gemma_gguf_path

    path = gemma_gguf_path()
    fresh, status = tc.load_gguf_tokenizer(path, tmp_path)  # a miss returns the tokenizer it built
    assert status == "miss"
    again, status = tc.load_gguf_tokenizer(path, tmp_path)
    assert status == "hit"
    texts = PROMPTS + TEXTS + ["<start_of_turn>user\nhi<end_of_turn>\n", "\n\n\t  x" * 3]
    for text in texts:
        want = fresh.encode(text, add_special_tokens=True)
        assert again.encode(text, add_special_tokens=True) == want
        assert again.decode(want) == fresh.decode(want)
    assert again.fingerprint == fresh.fingerprint
    assert again.eos_token_ids == fresh.eos_token_ids and again.special_token_ids == fresh.special_token_ids
    assert again.decodable(262144) is None and fresh.decodable(262144) is None
    assert np.array_equal(again.decodable(262144 + 64), fresh.decodable(262144 + 64))


@pytest.mark.parametrize("where", ["merge", "offset", "added", "sizes"])
def test_a_native_entry_whose_indices_leave_its_arrays_is_rebuilt(tmp_path, where):
    """An entry that passes its digest (rewritten whole, header and all) but whose ids or offsets
    would send the C tokenizer outside its arrays is refused before any C sees it."""
    path = write_tiny_gguf(tmp_path / "g.gguf", "gemma3", tokenizer="llama")
    fresh, _ = tc.load_gguf_tokenizer(path, tmp_path / "cache")
    (entry,) = entries(tmp_path / "cache")
    header, _, payload = entry.read_bytes().partition(b"\n")
    h = json.loads(header)
    assert h["backend"] == "native"
    small, _, arrays = payload.partition(b"\n")
    meta = json.loads(small)
    n, nc, nu = meta["n_tokens"], meta["n_control"], meta["n_user"]
    words = np.frombuffer(arrays[:4 * (nc + nu + n + 1 + 3 * meta["n_merges"])], dtype="<i4").copy()
    if where == "merge":
        words[nc + nu + n + 1] = n  # the first merge's left id: one past the last token
    elif where == "offset":
        words[nc + nu + 5] = words[nc + nu + 4] - 1  # offsets going backwards
    elif where == "added":
        words[0] = -1
    payload = json.dumps(meta).encode() + b"\n" + words.tobytes() + arrays[len(words) * 4:]
    if where == "sizes":
        payload += b"\0\0\0\0"  # longer than its sizes say
    h["payload_bytes"], h["payload_sha256"] = len(payload), hashlib.sha256(payload).hexdigest()
    entry.write_bytes(json.dumps(h).encode() + b"\n" + payload)
    again, status = tc.load_gguf_tokenizer(path, tmp_path / "cache")
    assert status == "rebuilt"
    same_tokenizer(again, fresh)
