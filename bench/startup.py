"""Daemon start to first token of the bundled model: a cold kernel cache, then warm restarts.

Each run starts `npud` on a private socket with the bundled base (bf16) and its kernel cache
in one directory (NPUD_CACHE_DIR, as systemd's CacheDirectory= gives the service), sends one
`complete` of one token as soon as the socket answers, and stops it with SIGTERM. Printed:
seconds from process start to the socket and to the first token, and the cache's file count
and size after each run (it must not grow after the first).

    .venv/bin/python bench/startup.py [--restarts 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from synth import ROOT

from clients.client import Client, NotRunning
from decode import cpu_model

MODEL = ROOT / "npud" / "models" / "pycode-base"


def one_start(work: Path, cache: Path) -> tuple[float, float]:
    """(seconds to a connectable socket, seconds to the first token), both from process start."""
    sock = work / "npud.sock"
    (work / "npud.toml").write_text(
        f'[server]\nsocket_path = "{sock}"\n[store]\nstate_dir = "{work / "state"}"\n'
        'persist_prefix_cache = false\n[thermal]\nenabled = false\n[errors]\nenabled = false\n'
        '[logging]\nlevel = "warning"\nformat = "json"\n'
        f'[[models]]\nname = "base"\ncheckpoint_dir = "{MODEL}"\nweight_format = "bf16"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "CACHE_DIRECTORY")}
    env |= {"PYTHONPATH": str(ROOT), "NPUD_CACHE_DIR": str(cache)}
    started = time.perf_counter()
    with open(work / "npud.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "npud", "--config", str(work / "npud.toml")],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            try:
                client = Client(str(sock))
                break
            except (OSError, NotRunning):
                if proc.poll() is not None or time.perf_counter() - started > 300:
                    raise RuntimeError((work / "npud.log").read_text()) from None
                time.sleep(0.01)
        at_socket = time.perf_counter() - started
        with client:
            stream = client.complete("def read_lines(path):", max_tokens=1, spec={"method": "none"},
                                     use_prefix_cache=False)
            first = next(time.perf_counter() for e in stream if e.name == "token" and e.data["token_ids"])
            for _ in stream:
                pass
        return at_socket, first - started
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--restarts", type=int, default=10)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="npud-startup-"))
    cache = work / "cache"
    load_start = Path("/proc/loadavg").read_text().strip()
    rows = []
    try:
        for i in range(args.restarts + 1):
            at_socket, first = one_start(work, cache)
            files = [p for p in cache.rglob("*") if p.is_file()]
            rows.append(("cold" if i == 0 else "warm", at_socket, first, len(files), sum(p.stat().st_size for p in files)))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n# bench/startup.py: npud start to first token, bundled base (bf16); CPU: {cpu_model()}; "
          f"load average at start {load_start}, at end {Path('/proc/loadavg').read_text().strip()}\n")
    print("| run | cache | to socket s | to first token s | cache files | cache KiB |")
    print("|---|---|---|---|---|---|")
    for i, (kind, at_socket, first, files, size) in enumerate(rows):
        print(f"| {i} | {kind} | {at_socket:.2f} | {first:.2f} | {files} | {size // 1024} |")
    warm = [r[2] for r in rows[1:]]
    if warm:
        print(f"\nwarm start to first token: median {statistics.median(warm):.2f} s, max {max(warm):.2f} s; "
              f"cache files after each warm start equal to after the first: "
              f"{all(r[3:] == rows[0][3:] for r in rows[1:])}")


if __name__ == "__main__":
    main()
