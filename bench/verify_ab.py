"""gemma-3-270m gguf-q8: a decode step and 8- / 16-row verify passes with another revision's host kernels beside this checkout's.

One process, the model loaded once; library A (--base, built from that revision's
npud/kernels/host sources by bench/kernels_ab.py's library_of) and library B (this checkout's) take
turns, the order swapped every round. Each turn: the median step of --steps greedy decode steps
after a 32-token prompt (bench/decode.py's our_decode), and the median of 3 verify passes of 8 and
16 rows (our_verify) over that step. Printed per round with /proc/loadavg, then medians and ranges
over the rounds.

    .venv/bin/python bench/verify_ab.py [--base main] [--rounds 5] [--threads 1,2] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))

from decode import our_decode, our_verify, set_threads  # noqa: E402
from kernels_ab import library_of  # noqa: E402

from npud.engine.model import Model  # noqa: E402
from npud.kernels.host import native  # noqa: E402


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="main", help="the git revision whose kernels are A")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=16)
    args = ap.parse_args()
    from demo import gemma_path

    path = gemma_path()
    if path is None:
        sys.exit("verify_ab: install npud[gemma] for the gemma-3-270m file")
    with tempfile.TemporaryDirectory(prefix="npud-ab-") as tmp:
        libs = {f"A {args.base}": library_of(args.base, Path(tmp)), "B this checkout": native.library()}
        model = Model.load(path, "gguf-q8")
        prompt = list(range(2, 34))
        print(f"# gemma-3-270m gguf-q8, isa {native.isa()}, load before {load()}")
        results: dict[tuple[int, str], list[tuple[float, float, float]]] = {}
        for threads in map(int, args.threads.split(",")):
            set_threads(threads)
            for rnd in range(args.rounds):
                for lib in list(libs) if rnd % 2 == 0 else list(libs)[::-1]:
                    native._lib = libs[lib]
                    step = our_decode(model, prompt, args.steps)
                    v8, v16 = our_verify(model, prompt, 8, 3), our_verify(model, prompt, 16, 3)
                    results.setdefault((threads, lib), []).append((step * 1e3, v8 / step, v16 / step))
                    print(f"threads {threads} round {rnd} {lib}: step {step * 1e3:.2f} ms, verify8 {v8 / step:.3f}, "
                          f"verify16 {v16 / step:.3f} steps; load {load()}", flush=True)
        print("| threads | kernels | step ms | verify8 / step | verify16 / step |")
        print("|---|---|---|---|---|")
        for (threads, lib), rows in results.items():
            cols = [f"{statistics.median(c):.3f} ({min(c):.3f}-{max(c):.3f})" for c in zip(*rows)]
            print(f"| {threads} | {lib} | {' | '.join(cols)} |")
        print(f"# load after {load()}")


if __name__ == "__main__":
    main()
