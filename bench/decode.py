"""Decode, prefill and verify on a random 0.5B Qwen3-shaped checkpoint: npud vs llama.cpp vs transformers.

One run, one table, every figure from this run (the machines are shared and noisy, so the
comparisons are ratios measured side by side, with the load average printed). For each of
our weight formats, at 1 and 2 threads: greedy decode tok/s after a 16-token prompt (median
step), prefill tok/s of a 512-token prompt, and the time of one 8-row verify over one step.
llama.cpp (llama-cpp-python built by bench/llamacpp.py into its own environment) runs the
same checkpoint converted to GGUF by llama.cpp's converter (bench/gguf_convert.py), f32 / bf16 /
q8_0 at 1 and 2 threads; transformers runs fp32 and bf16 at 2 threads. The read bandwidth of
1 and 2 threads is measured in the same run, and a per-op profile of one decode step, one
8-row verify and one prefill (bf16 and int8-q8, 2 threads) says where the time goes. The
roofline table sets each measured verify8 / step and prefill beside what the hardware allows
that format's arithmetic: bytes over the read bandwidth, multiply-adds over the GEMM's own
rate on cache-resident weights (fp32 activations cost one FMA lane per weight per row: a
one-thread 8-row verify cannot come near one step's time on those formats).

    NPUD_LLAMA_ENV=/work/shared-bench/llama-env .venv/bin/python bench/decode.py
Options: --tokens N (decode steps timed, default 32), --prefill N (default 512), --quick
(a 4-layer model), --formats (default fp32,bf16,int8,int8-q8,bf16-bf16), --no-llama, --no-hf.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time
from pathlib import Path

import numpy as np
from isolated import run_isolated
from synth import QWEN3_0P5B, build_random_checkpoint

from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.engine.weights import weight_arrays
from npud.kernels.base import LinearWeight, WeightFormat
from npud.kernels.host import native
from npud.kernels.host.formats import kernel_for

LLAMA_TYPE = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0", "int8-q8": "q8_0", "bf16-bf16": "bf16"}  # the GGUF beside each format


def measure_read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second `threads` threads read from an array much larger than the caches (best of
    repeats), the array in huge pages like the prepared weights."""
    import numba
    from numba import njit, prange

    # fastmath lets the sum vectorise: this kernel measures bytes, not bits
    @njit(parallel=True, fastmath=True, cache=True)
    def total(a):
        s = np.zeros(a.shape[0], np.float32)
        for i in prange(a.shape[0]):
            acc = np.float32(0.0)
            row = a[i]
            for j in range(row.shape[0]):
                acc += row[j]
            s[i] = acc
        return s.sum()

    numba.set_num_threads(threads)
    from npud.kernels.host.resident import resident_copy

    # in huge pages, as the prepared block weights are (npud/kernels/host/resident.py): with 4 KiB
    # pages every page costs a TLB walk, and the roofline would sit below what the GEMMs stream
    a = resident_copy(np.ones((nbytes // 4 // 4096, 4096), np.float32))
    total(a)
    best = min(_timed(lambda: total(a)) for _ in range(repeats))
    return a.nbytes / best


def measure_mac_rate(fmt: str, rows: int, n: int = 3072, k: int = 1024, repeats: int = 7) -> float:
    """Multiply-adds per second of `fmt`'s GEMM over `rows` rows on a cache-resident weight
    (3-12 MB, in L3): the arithmetic's own ceiling at the threads set, bandwidth aside."""
    kernel = kernel_for(WeightFormat.parse(fmt))
    rng = np.random.default_rng(1)
    w = kernel.prepare(kernel.sample(rng, n, k))
    x = rng.standard_normal((rows, k)).astype(np.float32)
    calls = max(1, 256 // rows)
    kernel.linear(x, w, True)

    def run():
        for _ in range(calls):
            kernel.linear(x, w, True)

    return calls * rows * n * k / min(_timed(run) for _ in range(repeats))


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def set_threads(n: int) -> None:
    import numba

    native.set_threads(n)
    numba.set_num_threads(n)


def layer_macs(model: Model) -> tuple[int, int]:
    """Multiply-adds per row: (the layers' linears, the lm_head)."""
    def macs(w: LinearWeight) -> int:
        return w.out_features * w.in_features

    w = model.weights
    layers = sum(macs(o) for layer in w.layers for o in weight_arrays(layer) if isinstance(o, LinearWeight))
    return layers, macs(w.lm_head)


def our_decode(model: Model, prompt: list[int], steps: int) -> float:
    """Median seconds per greedy decode step after a prefill of `prompt`."""
    f = Forward(model)
    logits = f.prefill(prompt)
    times = []
    for _ in range(steps):
        t = int(np.argmax(logits))
        t0 = time.perf_counter()
        logits = f.step(t, f.positions_held)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def our_verify(model: Model, prompt: list[int], rows: int = 8, repeats: int = 5) -> float:
    """Median seconds of one `rows`-row verify pass (every row's logits) after a prefill of `prompt`."""
    times = []
    for _ in range(repeats):
        f = Forward(model)
        f.prefill(prompt)
        times.append(_timed(lambda: f.step_batch_all(prompt[:rows], len(prompt))))
    return statistics.median(times)


def our_prefill(model: Model, tokens: list[int], repeats: int = 2) -> float:
    """Best seconds to prefill `tokens` from an empty state."""
    return min(_timed(lambda: Forward(model).prefill(tokens)) for _ in range(repeats))


# ------------------------------------------------------------------ per-op profile

_CATEGORY = {
    "linear": "GEMMs", "attention": "attention", "rms_norm": "norms/RoPE", "rope": "norms/RoPE",
    "add_rms_norm": "norms/RoPE", "norm_rope": "norms/RoPE",
    "l2_norm": "norms/RoPE", "gated_rms_norm": "norms/RoPE", "silu_mul": "activations",
    "gelu_tanh_mul": "activations", "sigmoid_mul": "activations", "softcap": "activations", "embed": "embedding",
    "causal_conv1d_silu": "recurrent", "gdn_gates": "recurrent", "gated_delta_rule": "recurrent",
}
CATEGORIES = ["GEMMs", "attention", "norms/RoPE", "activations", "embedding", "recurrent", "sampling", "Python + numpy"]


class ProfilingBackend:
    """Delegates to `inner`, adding each call's wall time to its category."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds: dict[str, float] = {}

    def __getattr__(self, name):
        fn = getattr(self.inner, name)
        category = _CATEGORY.get(name)
        if category is None or not callable(fn):  # not callable: an optional operation switched off
            return fn

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[category] = self.seconds.get(category, 0.0) + time.perf_counter() - t

        return timed


def profile(model: Model, prepare, run, repeats: int) -> dict[str, float]:
    """Milliseconds per category of `run(forward)` on a fresh forward given `prepare(forward)`
    first (median of `repeats`), greedy sampling of every row of what it returns included."""
    runs = []
    for _ in range(repeats):
        f = Forward(model)
        prepare(f)
        prof = ProfilingBackend(model.backend)
        model.backend = prof  # the pass (npud/engine/packed.py) calls the model's backend
        try:
            t = time.perf_counter()
            logits = run(f)
            t_sample = time.perf_counter()
        finally:
            model.backend = prof.inner
        np.argmax(logits, axis=-1)
        end = time.perf_counter()
        ms = {k: v * 1e3 for k, v in prof.seconds.items()}
        ms["sampling"] = (end - t_sample) * 1e3
        ms["Python + numpy"] = (t_sample - t) * 1e3 - sum(prof.seconds.values()) * 1e3
        ms["total"] = (end - t) * 1e3
        runs.append(ms)
    runs.sort(key=lambda r: r["total"])
    return runs[len(runs) // 2]


def profiles_of(model: Model, prompt: list[int], long_prompt: list[int]) -> dict[str, dict[str, float]]:
    """The per-op profile of a 1-row pass (a decode step), an 8-row pass (a verify) and a prefill."""
    out = {}
    for rows in (1, 8):
        out[f"{rows}-row pass"] = profile(model, lambda f: f.prefill(prompt),
                                          lambda f, r=rows: f.step_batch_all(prompt[:r], len(prompt)), 5)
    out[f"{len(long_prompt)}-token prefill"] = profile(model, lambda f: None, lambda f: f.prefill(long_prompt), 2)
    return out


# ------------------------------------------------------------------ the others


def llama_run(ckpt: Path, gguf_type: str, threads: int, long_prompt: list[int], decode_prompt: int,
              steps: int) -> dict | None:
    """llama.cpp's prefill and decode tok/s, or None (with the reason printed) where it cannot run."""
    try:
        import llamacpp
        from gguf_convert import convert

        return llamacpp.run(convert(ckpt, gguf_type), threads=threads, prompt=long_prompt, decode=steps,
                            decode_prompt=decode_prompt, repeats=1, n_ctx=max(2048, len(long_prompt) + steps + 8))
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"# llama.cpp {gguf_type} at {threads} threads did not run: {e}")
        return None


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return "unknown CPU"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--formats", default="fp32,bf16,int8,int8-q8,bf16-bf16")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--no-hf", action="store_true")
    args = ap.parse_args()
    formats = args.formats.split(",")

    config, name = dict(QWEN3_0P5B), "qwen3-0.5b"
    if args.quick:
        config["num_hidden_layers"], name = 4, f"{name}-4layer"
    ckpt = build_random_checkpoint(name, config)
    rng = np.random.default_rng(0)
    long_prompt = [int(t) for t in rng.integers(1, 320, args.prefill)]  # ids the test tokenizer knows
    prompt = long_prompt[:16]
    load_start = Path("/proc/loadavg").read_text().strip()

    bandwidth = {n: measure_read_bandwidth(n) for n in (1, 2)}
    rows = []  # (label, threads, decode s, prefill s, verify8 / step, bytes per token, llama key)
    profiles = {}
    roofline = {}  # (fmt, threads) -> (verify8 / step at the roofline, prefill tok/s the arithmetic allows)
    for fmt in formats:
        model = Model.load(ckpt, fmt)
        per_row, head = layer_macs(model)
        nbytes = model.weight_bytes_per_token()
        for threads in (1, 2):
            set_threads(threads)
            step = our_decode(model, prompt, args.tokens)
            verify = our_verify(model, prompt)
            prefill = our_prefill(model, long_prompt)
            rate8, rate64 = measure_mac_rate(fmt, 8), measure_mac_rate(fmt, 64)
            # the roofline: a pass takes at least its weight bytes over the bandwidth and its
            # multiply-adds over the arithmetic's rate (8 rows: the verify; 64: prefill's chunks)
            step_floor = nbytes / bandwidth[threads]
            verify_floor = max(step_floor, 8 * (per_row + head) / rate8)
            roofline[fmt, threads] = (verify_floor / step_floor, rate64 / per_row)
            rows.append((f"npud {fmt}", threads, step, prefill, verify / step, nbytes, (LLAMA_TYPE[fmt], threads)))
            print(f"# npud {fmt} threads={threads}: {1 / step:.1f} tok/s decode, "
                  f"{len(long_prompt) / prefill:.1f} tok/s prefill, verify8 {verify / step:.2f}x; "
                  f"GEMM rate {rate8 / 1e9:.0f} / {rate64 / 1e9:.0f} GMAC/s at 8 / 64 rows", flush=True)
        if fmt in ("bf16", "int8-q8"):
            profiles[fmt] = profiles_of(model, prompt, long_prompt)
        del model

    llama = {}
    if not args.no_llama:
        for gguf_type in sorted({LLAMA_TYPE[f] for f in formats}):
            for threads in (1, 2):
                res = llama_run(ckpt, gguf_type, threads, long_prompt, len(prompt), args.tokens)
                if res is not None:
                    llama[gguf_type, threads] = res
                    rows.append((f"llama.cpp {gguf_type}", threads, 1 / res["decode_tok_s"],
                                 len(long_prompt) / res["prefill_tok_s"], None, None, None))
                    print(f"# llama.cpp {gguf_type} threads={threads}: {res['decode_tok_s']:.1f} tok/s decode, "
                          f"{res['prefill_tok_s']:.1f} tok/s prefill", flush=True)
    if not args.no_hf:
        for dtype in ("float32", "bfloat16"):  # in a process of its own: isolated.py says why
            hf = run_isolated("hf_reference", "hf_run", str(ckpt), dtype, prompt, long_prompt, args.tokens, 2)
            rows.append((f"transformers {hf['torch']} {dtype}", 2, hf["step"], hf["prefill"], None, None, None))

    print(f"\n# bench/decode.py: {name}, greedy decode after a 16-token prompt ({args.tokens} steps, median), "
          f"prefill of {len(long_prompt)} tokens (best of 2)")
    print(f"# CPU: {cpu_model()}; kernel path {native.isa()}; load average at start {load_start}, "
          f"at end {Path('/proc/loadavg').read_text().strip()}")
    print(f"# read bandwidth measured in this run: 1 thread {bandwidth[1] / 1e9:.1f} GB/s, "
          f"2 threads {bandwidth[2] / 1e9:.1f} GB/s\n")
    print("| engine, format | threads | decode tok/s | vs llama.cpp | prefill tok/s | vs llama.cpp | "
          "verify8 / step | weights GB/s | of 2-thread bandwidth |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, threads, step, prefill, vratio, nbytes, key in rows:
        other = llama.get(key) if key else None
        dec_vs = f"{(1 / step) / other['decode_tok_s']:.2f}x" if other else "-"
        pre_vs = f"{(len(long_prompt) / prefill) / other['prefill_tok_s']:.2f}x" if other else "-"
        gbs = f"{nbytes / step / 1e9:.1f}" if nbytes else "-"
        of_bw = f"{nbytes / step / bandwidth[2]:.0%}" if nbytes else "-"
        print(f"| {label} | {threads} | {1 / step:.1f} | {dec_vs} | {len(long_prompt) / prefill:.1f} | {pre_vs} | "
              f"{f'{vratio:.2f}x' if vratio else '-'} | {gbs} | {of_bw} |")
    ours = {(r[0], r[1]): r for r in rows if r[0].startswith("npud")}
    print("\n# the roofline of each format's arithmetic on this CPU, from this run: verify8 / step if a step ran at")
    print("# the read bandwidth and a verify at the larger of that and its multiply-adds over the 8-row GEMM")
    print("# rate (cache-resident weights); prefill tok/s at the 64-row GEMM rate (the layers' linears only)\n")
    print("| npud format | threads | verify8 / step measured | at the roofline | prefill tok/s measured | "
          "at the GEMM rate |")
    print("|---|---|---|---|---|---|")
    for fmt in formats:
        for threads in (1, 2):
            _, _, _, prefill, vratio, _, _ = ours[f"npud {fmt}", threads]
            floor, ceiling = roofline[fmt, threads]
            print(f"| {fmt} | {threads} | {vratio:.2f}x | {floor:.2f}x | {len(long_prompt) / prefill:.1f} | "
                  f"{ceiling:.1f} |")
    print("\n| npud format | 2-thread decode / 1-thread decode | 2-thread / 1-thread read bandwidth |")
    print("|---|---|---|")
    for fmt in formats:
        print(f"| {fmt} | {ours[f'npud {fmt}', 1][2] / ours[f'npud {fmt}', 2][2]:.2f}x | "
              f"{bandwidth[2] / bandwidth[1]:.2f}x |")
    for fmt, by_pass in profiles.items():
        print(f"\n| per-op ms, npud {fmt}, 2 threads | " + " | ".join(by_pass) + " |")
        print("|---|" + "---|" * len(by_pass))
        for cat in CATEGORIES + ["total"]:
            print(f"| {cat} | " + " | ".join(f"{p.get(cat, 0.0):.1f}" for p in by_pass.values()) + " |")


if __name__ == "__main__":
    main()
