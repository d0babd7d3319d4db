"""llama.cpp beside npud in the benchmarks: a private build of llama-cpp-python, and a timed run of a GGUF file.

The build goes into its own virtual environment (default bench/out/llama-env, or
$NPUD_LLAMA_ENV) so npud's environment never depends on it. llama.cpp is compiled from the
sdist with GGML_NATIVE=OFF and the instruction sets this CPU really enables (read from
/proc/cpuinfo): on a VM whose cpuid lists AMX that it does not enable, a native build dies
with "Illegal instruction". The build time is recorded next to the environment.

`run(gguf, threads=...)` times prefill and greedy decode in a child process of that
environment and returns tokens per second and the greedy tokens (for an equality check).

    .venv/bin/python bench/llamacpp.py --build            # build (or show) the environment
    .venv/bin/python bench/llamacpp.py model.gguf --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_ENV = ROOT / "bench" / "out" / "llama-env"
VERSION = "0.3.36"


def env_dir() -> Path:
    return Path(os.environ.get("NPUD_LLAMA_ENV", DEFAULT_ENV))


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cmake_args(flags: set[str] | None = None) -> str:
    """GGML options for the instruction sets the CPU enables; never GGML_NATIVE (it may probe AMX)."""
    flags = cpu_flags() if flags is None else flags
    args = ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF"]
    for flag, option in (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
                         ("avx512f", "GGML_AVX512"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                         ("avx512_bf16", "GGML_AVX512_BF16"), ("avx512vbmi", "GGML_AVX512_VBMI"),
                         ("avx_vnni", "GGML_AVX_VNNI")):
        args.append(f"-D{option}={'ON' if flag in flags else 'OFF'}")
    return " ".join(args)


def ensure_env(log=print) -> Path:
    """The python of the llama.cpp environment, building it first if needed (several minutes)."""
    env = env_dir()
    python = env / "bin" / "python"
    stamp = env / "npud-build.json"
    if python.exists() and stamp.exists():
        return python
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "venv", str(env)], check=True)
    args = cmake_args()
    log(f"building llama-cpp-python {VERSION} into {env} with CMAKE_ARGS={args!r} ...")
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    "--no-binary", "llama-cpp-python", f"llama-cpp-python=={VERSION}", "numpy"],
                   check=True, env={**os.environ, "CMAKE_ARGS": args, "CMAKE_BUILD_PARALLEL_LEVEL": "2"})
    seconds = time.perf_counter() - started
    stamp.write_text(json.dumps({"version": VERSION, "cmake_args": args, "build_seconds": round(seconds, 1)}))
    log(f"built in {seconds:.0f} s")
    return python


def build_info() -> dict:
    stamp = env_dir() / "npud-build.json"
    return json.loads(stamp.read_text()) if stamp.exists() else {}


# Runs inside the llama.cpp environment: times prefill of `prompt` and `decode` greedy steps.
_CHILD = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama
a = json.loads(sys.argv[1])
llm = Llama(model_path=a["gguf"], n_threads=a["threads"], n_threads_batch=a["threads"], n_ctx=a["n_ctx"],
            n_batch=512, n_ubatch=512, logits_all=False, verbose=False, seed=0)
prompt = a["prompt"] or llm.tokenize(a["text"].encode(), add_bos=True, special=False)
best_prefill = None
for _ in range(a["repeats"]):
    llm.reset()
    llm._ctx.memory_clear(True) if hasattr(llm._ctx, "memory_clear") else None
    t = time.perf_counter()
    llm.eval(prompt)
    dt = time.perf_counter() - t
    best_prefill = dt if best_prefill is None else min(best_prefill, dt)
llm.reset()
llm.eval(prompt[: a["decode_prompt"]])
tokens, times = [], []
def last_logits():
    # llama-cpp-python 0.3.x keeps no scores without logits_all: read the context's output row
    # (only the batch's last token asks for logits, so it is row 0)
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
for _ in range(a["decode"]):
    tok = int(np.argmax(last_logits()))
    tokens.append(tok)
    t = time.perf_counter()
    llm.eval([tok])
    times.append(time.perf_counter() - t)
times.sort()
import resource
print(json.dumps({"prefill_tok_s": len(prompt) / best_prefill, "decode_tok_s": 1.0 / times[len(times) // 2],
                  "tokens": tokens, "prompt_tokens": len(prompt),
                  "max_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run(gguf: str | Path, *, threads: int, prompt: list[int] | None = None, text: str = "",
        decode: int = 32, decode_prompt: int | None = None, repeats: int = 2, n_ctx: int = 2048) -> dict:
    """Prefill tok/s (best of `repeats` over the whole prompt), median decode tok/s over `decode`
    greedy steps after the first `decode_prompt` prompt tokens, and the greedy tokens."""
    python = ensure_env()
    n_prompt = len(prompt) if prompt else 0
    args = {"gguf": str(gguf), "threads": threads, "prompt": prompt, "text": text, "decode": decode,
            "decode_prompt": decode_prompt if decode_prompt is not None else (n_prompt or 10**9),
            "repeats": repeats, "n_ctx": n_ctx}
    out = subprocess.run([str(python), "-c", _CHILD, json.dumps(args)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("gguf", nargs="?")
    p.add_argument("--build", action="store_true", help="build the environment (if missing) and show it")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text", default="def fibonacci(n):\n    ")
    p.add_argument("--decode", type=int, default=32)
    a = p.parse_args()
    if a.build or not a.gguf:
        print(ensure_env(), json.dumps(build_info()))
    if a.gguf:
        print(json.dumps(run(a.gguf, threads=a.threads, text=a.text, decode=a.decode)))


if __name__ == "__main__":
    main()
