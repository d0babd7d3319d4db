"""Does one user's huge prompts stall everyone (issue 26)? /health latency under ~0.9 MB prompts.

One daemon process on the tiny test model (the real engine and tokenizer). Three threads post
~0.9 MB prompts to /v1/completions over http.sock, one after another (each is refused
`prompt_too_long` after it is parsed and tokenized); this thread asks GET /health every 50 ms
and measures how long the answer takes. A baseline phase without the posters comes first.
Prints the latency percentiles of both phases with the load average beside them.

Run: .venv/bin/python bench/huge_prompts.py [--seconds 20] [--posters 3] [--kib 900]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_npud_support import DaemonProc  # noqa: E402


def http(path: str, request: bytes) -> bytes:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(120)
    s.connect(path)
    s.sendall(request)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    return data


def health_latencies(path: str, seconds: float) -> list[float]:
    out = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        started = time.monotonic()
        reply = http(path, b"GET /health HTTP/1.1\r\nHost: npud\r\nConnection: close\r\n\r\n")
        assert reply.startswith(b"HTTP/1.1 200 "), reply[:80]
        out.append((time.monotonic() - started) * 1000)
        time.sleep(0.05)
    return out


def poster(path: str, body: bytes, stop: threading.Event, codes: list) -> None:
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: npud\r\ncontent-type: application/json\r\n"
               b"Connection: close\r\ncontent-length: %d\r\n\r\n" % len(body)) + body
    while not stop.is_set():
        reply = http(path, request)
        codes.append(reply.split(b" ", 2)[1].decode() if reply else "closed")


def table(name: str, ms: list[float]) -> str:
    q = statistics.quantiles(ms, n=10, method="inclusive")
    return f"| {name:<22} | {len(ms):>5} | {statistics.median(ms):>8.1f} | {q[8]:>8.1f} | {max(ms):>8.1f} |"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--posters", type=int, default=3)
    ap.add_argument("--kib", type=int, default=900)
    args = ap.parse_args()
    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    work = Path(tempfile.mkdtemp(prefix="npud-huge-", dir="/tmp"))
    try:
        checkpoint = build_tiny_checkpoint(work / "tiny", "qwen3")
        (work / "d").mkdir()
        d = DaemonProc(work / "d", [{"name": "tiny", "checkpoint_dir": str(checkpoint), "weight_format": "fp32",
                                     "preload": True}], limits={"max_line_bytes": 2 * 1024 * 1024})
        d.start(timeout=120)
        path = str(d.dir / "http.sock")
        words = ("lorem ipsum dolor sit amet consectetur adipiscing elit " * (args.kib * 1024 // 56 + 1))
        body = json.dumps({"model": "tiny", "prompt": words[:args.kib * 1024], "max_tokens": 1}).encode()
        base = health_latencies(path, args.seconds / 2)
        stop, codes = threading.Event(), []
        threads = [threading.Thread(target=poster, args=(path, body, stop, codes)) for _ in range(args.posters)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        loaded = health_latencies(path, args.seconds)
        stop.set()
        for t in threads:
            t.join()
        d.terminate()
        load = open("/proc/loadavg").read().split()[:3]
        print(f"GET /health latency, ms ({args.posters} posters of {len(body) // 1024} KiB prompts; "
              f"replies {sorted(set(codes))} x{len(codes)}; load {' '.join(load)}, {os.cpu_count()} CPUs)")
        print("| phase                  | asked |   median |      p90 |      max |")
        print("|------------------------|-------|----------|----------|----------|")
        print(table("baseline", base))
        print(table(f"{args.posters} huge posters", loaded))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
