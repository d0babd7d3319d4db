"""The C tokenizer of GGUF SentencePiece vocabularies (npud/engine/tokenizer_native.py) against the
`tokenizers` object the same file builds (npud/engine/gguf/tokenizer.py's assemble_backend, the way
transformers' GGUF conversion builds it; tests/test_gguf_real.py compares the native one with
transformers directly): id for id and text for text on random texts (characters outside the
vocabulary, emoji, CJK, whitespace runs, control-token spellings whole and cut, empty and long
texts), on tiny synthetic vocabularies of both kinds (gemma and Metaspace) with and without
an unknown token and byte tokens, with a repeated spelling, and on the real gemma-3-270m;
streaming decode agrees; a long text is encoded with the GIL released; and the gemma path
never imports `tokenizers`. Where a literal U+2581 meets spaces, tabs and newlines, both backends
are compared with transformers' tokenizer of the same file instead (an outside reference: the
two backends share the recipe they are built from), on gemma-3-270m and on a tiny gemma
vocabulary whose all-space tokens are stored with spaces, as llama.cpp writes gemma's."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gguf_checkpoints import add_spm_vocabulary
from real_gemma import need

from npud.engine.gguf import open_gguf
from npud.engine.gguf.tokenizer import gguf_tokenizer
from npud.engine.tokenizer import Tokenizer
from npud.engine.tokenizer_native import NativeBackend

gguf = pytest.importorskip("gguf") if os.environ.get("CI") != "true" else __import__("gguf")

WORDS = ("ab", "abc", "ba", "aab", "café", "中文", "cab", "bb", "aa", "a b", "the", "th", "he")
CONTROL = ["<ctl>", "<ctl>ab", "<start_of_turn>", "<end_of_turn>"]
USER = ["<|x|>", "abab"]


def _vocabulary(bytes_kind: str, rng: random.Random) -> tuple[list[str], list[float], list[int]]:
    """Specials, byte tokens ("all", "some": ASCII only, or "none"), characters, the pieces
    of WORDS (with and without a leading ▁), a repeated spelling, added tokens; random scores."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"]
    types = [3, 3, 3, 2]
    byte_range = {"all": range(256), "some": range(128), "none": range(0)}[bytes_kind]
    tokens += [f"<0x{b:02X}>" for b in byte_range]
    types += [6] * len(byte_range)
    pieces: list[str] = []
    for word in WORDS:
        for w in (word.replace(" ", "\u2581"), "\u2581" + word.replace(" ", "\u2581")):
            for n in range(1, min(len(w), 4) + 1):
                for i in range(len(w) - n + 1):
                    if w[i:i + n] not in pieces:
                        pieces.append(w[i:i + n])
    pieces += ["ab", "\u2581\u2581", "\u2581\u2581\u2581", "\n", "\t"]  # "ab" a second time: the last id is its id
    rng.shuffle(pieces)
    tokens += pieces + CONTROL + USER
    types += [1] * len(pieces) + [3] * len(CONTROL) + [4] * len(USER)
    scores = [0.0] * (len(tokens) - len(pieces) - len(CONTROL) - len(USER))
    scores += [-rng.random() * 10 for _ in pieces] + [0.0] * (len(CONTROL) + len(USER))
    return tokens, scores, types


def write_spm_gguf(path: Path, arch: str, bytes_kind: str, unk: bool, seed: int = 0) -> Path:
    """A GGUF holding only a SentencePiece vocabulary (no tensors)."""
    tokens, scores, types = _vocabulary(bytes_kind, random.Random(seed))
    w = gguf.GGUFWriter(str(path), arch)
    add_spm_vocabulary(w, tokens, scores, types, unk=unk, pad=False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def random_text(rng: random.Random, alphabet: str, spellings: list[str]) -> str:
    parts = []
    for _ in range(rng.randint(0, 10)):
        r = rng.random()
        if r < 0.15:
            spelling = rng.choice(spellings)
            parts.append(spelling if rng.random() < 0.7 else spelling[:rng.randint(1, len(spelling))])
        elif r < 0.3:  # anywhere in Unicode but the surrogates
            parts.append(chr(rng.choice([rng.randint(0x80, 0xD7FF), rng.randint(0xE000, 0x10FFFF)])))
        else:
            parts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 16))))
    return "".join(parts)


def assert_same(native: Tokenizer, library: Tokenizer, texts: list[str], rng: random.Random) -> None:
    assert type(native._backend) is NativeBackend and hasattr(library._backend, "library")
    for text in texts:
        for special in (False, True):
            assert native.encode(text, special) == library.encode(text, special), (text, special)
        assert native._plain_ids(text) == library._plain_ids(text), text
        assert native.encode_text(text) == library.encode_text(text), text
        # (with a repeated spelling the library counts vocab_size below the last ids: decode refuses those)
        ids = [i for i in library.encode(text) if i < library.vocab_size]
        ids += [rng.randrange(library.vocab_size) for _ in range(rng.randint(0, 6))]
        rng.shuffle(ids) if rng.random() < 0.3 else None
        for skip in (False, True):
            assert native.decode(ids, skip) == library.decode(ids, skip), (ids, skip)
        if len(ids) > 300:  # a stream held back by a cut character decodes its whole tail at each push
            continue
        a, b = native.decoder(), library.decoder()
        assert [a.push(i) for i in ids] + [a.flush()] == [b.push(i) for i in ids] + [b.flush()], ids


def assert_same_facts(native: Tokenizer, library: Tokenizer) -> None:
    assert (native.vocab_size, native.bos_token_id, native.eos_token_ids, native.special_token_ids,
            native.control_tokens, native.fingerprint) == \
           (library.vocab_size, library.bos_token_id, library.eos_token_ids, library.special_token_ids,
            library.control_tokens, library.fingerprint)
    ids = list(range(library.vocab_size))
    assert native.decode(ids) == library.decode(ids)
    assert [native.token_bytes(i) for i in ids] == [library.token_bytes(i) for i in ids]
    assert native.decodable(library.vocab_size + 3).tolist() == library.decodable(library.vocab_size + 3).tolist()


SYNTHETIC = [("gemma3", "all", True), ("gemma3", "some", True), ("gemma3", "none", False),
             ("llama", "all", True), ("llama", "some", False), ("llama", "none", False)]


@pytest.mark.parametrize("arch, bytes_kind, unk", SYNTHETIC, ids=["-".join(map(str, s)) for s in SYNTHETIC])
def test_synthetic_vocabularies_give_the_librarys_ids_and_text(tmp_path, arch, bytes_kind, unk):
    path = write_spm_gguf(tmp_path / "v.gguf", arch, bytes_kind, unk, seed=len(bytes_kind))
    g = open_gguf(path)
    native, library = gguf_tokenizer(g), gguf_tokenizer(g, library=True)
    assert_same_facts(native, library)
    rng = random.Random(f"{arch}{bytes_kind}{unk}")
    alphabet = "aabbc   \u2581\t\n\n中文éz🙂<>|"
    texts = ["", " ", "  ", "ab", "abab", "aaaa", "a b", "z", "zz🙂z", "<ctl>", "<ctl><ctl>ab", "<ctl>a", " <ctl> ab",
             "ab<|x|>ab", "\u2581ab", "<ctl>ab<ctl>abab", "中文 café", "the theth"]
    texts += [random_text(rng, alphabet, CONTROL + USER) for _ in range(250)]
    texts.append("".join(texts) * 3)  # a long one
    assert_same(native, library, texts, rng)


def test_gemma_3_270m_gives_the_librarys_ids_and_text(tmp_path):
    from real_gemma import PROMPTS, gemma_gguf_path, gemma_library_backend

    library = gemma_library_backend()
    from npud.engine.gguf import tokenizer_cache as tc

    tc.load_gguf_tokenizer(gemma_gguf_path(), tmp_path)
    native, status = tc.load_gguf_tokenizer(gemma_gguf_path(), tmp_path)  # as a warm start reads it
    assert status == "hit"
    assert_same_facts(native, library)
    rng = random.Random(3)
    alphabet = ("abcdefghijklmnopqrstuvwxyz ABC 0123456789     \t\n\n.,;:!?()[]{}<>|_-=+*/\\'\"éèçñüßøæ"
                "中文字日本語한국어🙂👍🏽☃\u0301\u200b\ufeff\x00\x7f")
    spellings = list(native.control_tokens[:40]) + ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<unk>"]
    root = Path(__file__).resolve().parents[1]
    texts = PROMPTS + ["", " ", "\n\n\n", "   x", (root / "npud" / "engine" / "forward.py").read_text()[:20000]]
    texts += [random_text(rng, alphabet, spellings) for _ in range(300)]
    assert_same(native, library, texts, rng)
    # bytes of a character cut apart: each alone, and in runs that are not UTF-8
    cut = native.encode("\U0001F9EC\u2F9F\u0FFA")  # characters gemma spells as byte tokens
    assert any(native._backend.id_to_token(i).startswith("<0x") for i in cut)
    for ids in ([cut[0]], cut[:2], cut[1:], cut[::-1], cut + cut[:1]):
        assert native.decode(ids) == library.decode(ids)


def test_a_long_text_is_encoded_with_the_gil_released(tmp_path):
    """As tests/test_attack_round3.py's test for the `tokenizers` backend: this thread keeps
    getting turns while another encodes a 0.9 MB prompt (one piece: gemma splits nothing)."""
    tok = gguf_tokenizer(open_gguf(write_spm_gguf(tmp_path / "v.gguf", "gemma3", "all", True)))
    text = "def f(x):\n    return x * 2  # a comment that goes on\n" * 18_000
    ids: list[int] = []
    worker = threading.Thread(target=lambda: ids.extend(tok.encode_text(text)))
    turns = 0
    worker.start()
    while worker.is_alive():
        turns += 1
        time.sleep(0.0005)
    worker.join()
    assert len(ids) > 100_000
    assert turns >= 20, turns


def test_a_gguf_sentencepiece_vocabulary_never_imports_tokenizers(tmp_path):
    """Built (a miss) and read back (a hit), in fresh processes: the library is not loaded."""
    path = write_spm_gguf(tmp_path / "v.gguf", "gemma3", "all", True)
    code = ("import sys; from npud.engine.gguf.tokenizer_cache import load_gguf_tokenizer; "
            "t, status = load_gguf_tokenizer(sys.argv[1]); print(status, t.encode('a b<ctl>'), 'tokenizers' in sys.modules)")
    env = {**os.environ, "NPUD_CACHE_DIR": str(tmp_path / "cache")}
    outs = [subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, env=env,
                           check=True).stdout.strip().split("\n")[-1] for _ in range(2)]
    assert outs[0].startswith("miss ") and outs[1] == "hit " + outs[0][len("miss "):]
    assert outs[1].endswith("False")


U = "\u2581"
# SentencePiece writes a space as U+2581 before its merges run, so a literal U+2581 is a space
# to them; these put literal ones against spaces, tabs, newlines and words (issue 39). Past 31
# (gemma's longest whitespace token) sentencepiece itself cuts a run greedily, 31 first, and
# transformers by the merges (40: 16 + 24): these follow transformers, as npud does for spaces.
SPACES_AND_U2581 = [
    U, U * 2, U * 3, U * 8, U * 31, U * 40, U * 20 + " " * 20, " " * 40,
    " " + U, U + " ", " " + U * 2 + " ", U + " " + U, "a " + U * 2 + " b", "x " + U * 3, U + " " + U * 2 + " " + U * 3,
    "  " + U * 2 + "x  ", "   " + U + "hello" + U * 2 + "  ", U * 2 + "hello" + U * 2 + "world",
    "\t" + U * 2 + "\n" + U + " " + U + "\t", U * 3 + "\n\n   " + U * 2 + "\t\t" + U, "\r\n" + U * 2 + " \r\n",
    "a" + " " * 5 + U * 5 + " " * 5 + "b", "def f():\n" + U * 4 + "return 1\n" + " " * 4 + U * 4 + "pass",
    "<start_of_turn>" + U * 2 + " user\n" + U,
]


def assert_transformers_ids(ref, tokenizers: list[Tokenizer], texts: list[str]) -> None:
    """Each tokenizer gives transformers' ids (with and without BOS) and decodes them to
    transformers' text, which is the text with each U+2581 a space."""
    for text in texts:
        want = ref(text, add_special_tokens=False).input_ids
        assert ref.decode(want) == text.replace(U, " "), text
        for tok in tokenizers:
            assert tok.encode(text) == want, (text, tok._backend)
            assert tok.encode(text, True) == ref(text).input_ids, text
            assert tok.decode(want) == ref.decode(want), want


def test_gemma_3_270m_gives_transformers_ids_where_u2581_meets_spaces():
    """The two texts reported from outside, with their ids from transformers' tokenizer of the
    same file (sentencepiece gives the same): a literal run of U+2581 is as many spaces, merged
    with the spaces beside it into one whitespace token."""
    from real_gemma import gemma_gguf_path, gemma_library_backend, gemma_transformers_tokenizer

    ref = gemma_transformers_tokenizer()
    native, library = gguf_tokenizer(open_gguf(gemma_gguf_path())), gemma_library_backend()
    assert type(native._backend) is NativeBackend and hasattr(library._backend, "library")
    for tok in (native, library):
        assert tok.encode("x " + U * 3) == [236781, 140]  # "x", four spaces
        assert tok.encode(U + " " + U * 2 + " " + U * 3) == [144]  # eight spaces
        assert tok.decode([236781, 140]) == "x    " and tok.decode([144]) == " " * 8
    assert_transformers_ids(ref, [native, library], SPACES_AND_U2581)


def write_gemma_spaces_gguf(path: Path) -> tuple[Path, list[str]]:
    """A gemma3 vocabulary shaped like gemma-3-270m's where spaces are: its all-space tokens
    (2 to 8 spaces) and newline and tab runs user-defined, the all-space ones stored with
    spaces as llama.cpp writes them; "\u2581" and words with and without it; byte tokens.
    Returns the path and the tokens."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [3, 3, 3, 2] + [6] * 256
    blank = ["\n", "\n\n", "\t", "\t\t"] + [" " * n for n in range(2, 9)]
    words = [U + "hello", "hello", "hell", "hel", "he", "ll", "lo", U + "h", U + "x", "x" + U, U,
             "x", "a", "b", "h", "e", "l", "o"]
    tokens += blank + words
    types += [4] * len(blank) + [1] * len(words)
    w = gguf.GGUFWriter(str(path), "gemma3")
    add_spm_vocabulary(w, tokens, [0.0] * len(tokens), types, unk=True, pad=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, tokens


def test_tiny_gemma_vocabulary_gives_transformers_ids_where_u2581_meets_spaces(tmp_path):
    """As on gemma-3-270m, without it: both backends against transformers' tokenizer of the
    same tiny file, on the texts above and random ones of spaces, U+2581, tabs, newlines and
    letters."""
    transformers = need("transformers", "the reference tokenizer")
    path, tokens = write_gemma_spaces_gguf(tmp_path / "spaces.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    native, library = gguf_tokenizer(open_gguf(path)), gguf_tokenizer(open_gguf(path), library=True)
    for tok in (native, library):
        assert tok.encode("x " + U * 3) == [tokens.index("x"), tokens.index(" " * 4)]
        assert tok.encode(U + " " + U * 2 + " " + U * 3) == [tokens.index(" " * 8)]
    rng = random.Random(39)
    alphabet = [" ", " ", U, U, U, "\t", "\n", "x", "a", "hello", "\r"]
    texts = SPACES_AND_U2581 + ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 24))) for _ in range(300)]
    assert_transformers_ids(ref, [native, library], texts)
