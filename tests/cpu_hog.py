"""A CPU hog for the load-proof run of the suite (.ci/run): one busy process per core.

`python tests/cpu_hog.py [SECONDS]` spins os.cpu_count() processes until SECONDS pass (default
1800) or it is killed; each child also ends when its parent goes away, so a CI step that dies
leaves no hog behind. Not a test module (no test_ prefix).
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time


def spin(parent: int, until: float) -> None:
    n = 0
    while time.monotonic() < until:
        for _ in range(100_000):
            n += 1
        if os.getppid() != parent:
            return


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 1800.0
    until = time.monotonic() + seconds
    procs = [multiprocessing.Process(target=spin, args=(os.getpid(), until), daemon=True)
             for _ in range(os.cpu_count() or 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
