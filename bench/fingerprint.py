"""What the prefix-cache key costs: whole-file digests of a checkpoint, sha256 beside blake2b.

npud/engine/fingerprint.py reads every byte of a model's config and weight files once, and then
remembers the digest by stat in the model's cache directory. This prints, side by side in
one run, for the bundled base's weight file and for a generated file of --size bytes:

  read         the file read through the same 1 MiB buffer, no digest (the floor)
  sha256       npud.engine.fingerprint.DigestMemo.digest with an empty memo (what a first start pays)
  blake2b      the same loop with hashlib.blake2b (the alternative considered)
  remembered   DigestMemo.digest of the unchanged file from a fresh memo read from disk (what
               every later start pays: a stat and a JSON read)

Every file is read once first, so all columns see it in the page cache (a cold disk adds
its own read time to the first three alike; dropping the page cache would slow the other
work on a shared machine). Times are the best of --repeat runs.

Run: .venv/bin/python bench/fingerprint.py [--size-gb 1.0] [--repeat 3]
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from npud.engine import fingerprint
from npud.engine.fingerprint import MEMO_FILE, DigestMemo

BUNDLED = Path(__file__).resolve().parent.parent / "npud" / "models" / "pycode-base" / "model.safetensors"
CHUNK = 1 << 20


def _loop(path: Path, h) -> None:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        while n := f.readinto(buf):
            if h is not None:
                h.update(view[:n])


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _measure(path: Path, repeat: int, memo_dir: Path) -> dict:
    _loop(path, None)  # into the page cache
    fingerprint.SETTLE_NS = 0  # a file written just now is remembered here

    def first_start():
        fingerprint._process_memo.clear()
        DigestMemo().digest(path)

    def later_start():
        fingerprint._process_memo.clear()
        DigestMemo(memo_dir / MEMO_FILE).digest(path)

    memo = DigestMemo(memo_dir / MEMO_FILE)
    memo.digest(path)
    memo.save()
    later = _best(later_start, repeat)
    return {
        "bytes": path.stat().st_size,
        "read": _best(lambda: _loop(path, None), repeat),
        "sha256": _best(first_start, repeat),
        "blake2b": _best(lambda: _loop(path, hashlib.blake2b()), repeat),
        "remembered": later,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-gb", type=float, default=1.0, help="size of the generated file in GB (1e9 bytes)")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if line.startswith("Model name")), "?")
    flags = Path("/proc/cpuinfo").read_text()
    print(f"cpu: {cpu}; sha_ni: {'sha_ni' in flags}; loadavg before: {Path('/proc/loadavg').read_text().strip()}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="npud-fp-bench-") as tmp:
        tmp = Path(tmp)
        big = tmp / "weights.safetensors"
        rng = np.random.default_rng(0)
        with open(big, "wb") as f:
            left = int(args.size_gb * 1e9)
            while left > 0:
                n = min(left, 64 << 20)
                f.write(rng.bytes(n))
                left -= n
        for name, path in (("bundled pycode-base", BUNDLED), (f"generated {args.size_gb:g} GB", big)):
            memo_dir = tmp / f"memo-{len(rows)}"
            memo_dir.mkdir()
            rows.append((name, _measure(path, args.repeat, memo_dir)))
    print()
    print(f"{'file':<22}{'MB':>9}{'read s':>9}{'sha256 s':>10}{'GB/s':>7}{'blake2b s':>11}{'GB/s':>7}"
          f"{'sha/b2b':>9}{'remembered ms':>15}")
    for name, r in rows:
        gb = r["bytes"] / 1e9
        print(f"{name:<22}{r['bytes'] / 1e6:>9.1f}{r['read']:>9.3f}{r['sha256']:>10.3f}{gb / r['sha256']:>7.2f}"
              f"{r['blake2b']:>11.3f}{gb / r['blake2b']:>7.2f}{r['sha256'] / r['blake2b']:>9.2f}"
              f"{r['remembered'] * 1e3:>15.3f}")
    print(f"\nloadavg after: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
