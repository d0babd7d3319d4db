"""Time to first token with the prefix cache: cold vs restored from memory vs restored from disk.

On the 0.5B Qwen3-shaped random checkpoint (bench/synth.py), bf16 weights, one run, every
figure from this run. For each prompt length N:

  cold         an empty cache: the whole prompt is prefilled (N is a multiple of the block,
               so the snapshot and insert wait until the first token is out: the last
               column says what they cost)
  memory       the same prompt again, on a fresh Forward: N - 1 positions restored, 1 prefilled
  disk         the same through a fresh PrefixCache over the state dir (the index rebuilt
               from the files), the file first dropped from the page cache (best effort)
  memory, +32  the prompt plus 32 new tokens: N restored, 32 prefilled
  disk, +32    the same from disk

TTFT = lookup + restore + prefill of the rest + argmax of the last row. Ratios are to the
cold N-token prompt (for +32 that flatters the cold side, so the ratio is conservative).
Every restored run's logits are compared bit for bit with a cold forward's.

Run: .venv/bin/python bench/prefix_cache.py [--quick] [--lengths 512 2048]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from synth import QWEN3_0P5B, build_random_checkpoint

from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.prefix_cache import PrefixCache
from npud.engine.state import ModelState

SUFFIX = 32


def timed_serve(forward: Forward, cache: PrefixCache, prompt: list[int]):
    """(TTFT seconds, seconds of the deferred insert, logits, match)."""
    t = time.perf_counter()
    done = cache.prefill(forward, prompt, defer_insert=True)  # the insert waits past the first token
    int(np.argmax(done.logits))
    ttft = time.perf_counter() - t
    t = time.perf_counter()
    if done.insert is not None:
        done.insert()
    return ttft, time.perf_counter() - t, done.logits, done.match


def drop_page_cache(directory: Path) -> None:
    for path in directory.glob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_length(model: Model, n: int, state_root: Path) -> list[tuple]:
    rng = np.random.default_rng(n)
    prompt = [int(t) for t in rng.integers(1, model.config.vocab_size, n)]
    longer = prompt + [int(t) for t in rng.integers(1, model.config.vocab_size, SUFFIX)]
    state_dir = state_root / f"n{n}"
    template = ModelState.for_config(model.config)

    def fresh_cache():
        return PrefixCache(model.fingerprint, template, state_dir=state_dir, max_bytes=4 << 30)

    cache = fresh_cache()
    cold = Forward(model)
    cold_s, insert_s, cold_logits, match = timed_serve(cold, cache, prompt)
    assert match is None
    cold_longer = cold.prefill(longer[n:])  # the same bits as a cold prefill of `longer`
    snap_mb = cache.stats().bytes_held / 1e6
    rows = [("cold", n, 0, cold_s, insert_s, None)]
    s, ins, logits, match = timed_serve(Forward(model), cache, prompt)
    rows.append(("restored from memory", n, match.num_cached_tokens, s, ins, rows_equal(logits, cold_logits)))
    cache.flush()
    rebuild = []
    for label, p, ref in (("restored from disk", prompt, cold_logits),
                          (f"restored from disk, +{SUFFIX}", longer, cold_longer)):
        drop_page_cache(state_dir)
        t = time.perf_counter()
        disk_cache = fresh_cache()  # the start-up index rebuild is not part of a request
        rebuild.append(time.perf_counter() - t)
        s, ins, logits, match = timed_serve(Forward(model), disk_cache, p)
        if match.source.value != "disk":
            raise RuntimeError(f"{label}: served from {match.source.value}")
        rows.append((label, len(p), match.num_cached_tokens, s, ins, rows_equal(logits, ref)))
    s, ins, logits, match = timed_serve(Forward(model), cache, longer)
    rows.append((f"restored from memory, +{SUFFIX}", len(longer), match.num_cached_tokens, s, ins,
                 rows_equal(logits, cold_longer)))
    return [(n, label, tokens, cached, s, ins, s / cold_s, same, snap_mb, max(rebuild))
            for label, tokens, cached, s, ins, same in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--quick", action="store_true", help="a 4-layer model, for a smoke run")
    args = ap.parse_args()

    config = dict(QWEN3_0P5B)
    name = "qwen3-0.5b"
    if args.quick:
        config["num_hidden_layers"], name = 4, "qwen3-0.5b-4layer"
    model = Model.load(build_random_checkpoint(name, config), "bf16")
    Forward(model).prefill([1, 2, 3])  # compile the kernels outside the timings

    import numba

    with tempfile.TemporaryDirectory(prefix="npud-prefix-bench-") as root:
        table = [row for n in args.lengths for row in run_length(model, n, Path(root))]
    print(f"\n# bench/prefix_cache.py: {name}, bf16 weights, numba threads={numba.get_num_threads()}, "
          f"block size 32, one run\n")
    print(f"| {'prompt':>6} | {'path':<28} | {'tokens':>6} | {'restored':>8} | {'TTFT s':>8} | "
          f"{'of cold':>7} | {'logits vs cold':>14} | {'insert after s':>14} |")
    print(f"|{'-' * 8}|{'-' * 30}|{'-' * 8}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 16}|{'-' * 16}|")
    for n, label, tokens, cached, s, ins, ratio, same, _, _ in table:
        print(f"| {n:>6} | {label:<28} | {tokens:>6} | {cached:>8} | {s:>8.3f} | {ratio:>7.1%} | "
              f"{('-' if same is None else 'bit-equal' if same else 'DIFFERENT'):>14} | {(f'{ins:.3f}' if ins > 1e-3 else '-'):>14} |")
    print()
    for n in args.lengths:
        row = next(r for r in table if r[0] == n)
        print(f"N={n}: snapshot {row[8]:.0f} MB; start-up index rebuild {row[9] * 1e3:.1f} ms")
    worst = max(row[6] for row in table if row[1] in ("restored from memory", "restored from disk"))
    print(f"target: a restored prompt's TTFT <= 10% of cold; worst here {worst:.1%}: "
          f"{'met' if worst <= 0.10 else 'NOT met'} (the +{SUFFIX} rows prefill {SUFFIX} new tokens on top)")
    if not all(row[7] is not False for row in table):
        raise SystemExit("a restored run's logits differ from the cold run's")


if __name__ == "__main__":
    main()
