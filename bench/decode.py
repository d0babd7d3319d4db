"""Plain greedy decode on a random checkpoint of a few hundred million parameters: ours vs transformers vs roofline.

One run, one table, every figure from this run (the machines are shared and noisy, so the
comparisons are ratios measured side by side). Run: .venv/bin/python bench/decode.py
Options: --tokens N (decode steps timed, default 32), --quick (a 4-layer model, for a smoke run),
--arch qwen3|gemma4|qwen3_5 (bench/synth.py's 0.5B Qwen3, 0.4B Gemma4 or 0.4B Qwen3.5 shape),
--formats (our weight formats to time, default fp32,bf16,int8).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from synth import GEMMA4_0P4B, QWEN3_0P5B, QWEN3_5_0P4B, build_random_checkpoint, build_transformers_checkpoint

from engine.forward import Forward
from engine.model import Model


def measure_read_bandwidth(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes per second a parallel sum reads from an array much larger than the caches."""
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

    a = np.ones((nbytes // 4 // 4096, 4096), np.float32)
    total(a)
    best = min(_timed(lambda: total(a)) for _ in range(repeats))
    return a.nbytes / best


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def our_decode(model: Model, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    """Median seconds per greedy decode step after a prefill; also the tokens."""
    f = Forward(model)
    logits = f.prefill(prompt)
    times, out = [], []
    for _ in range(steps):
        t = int(np.argmax(logits))
        out.append(t)
        t0 = time.perf_counter()
        logits = f.step(t, f.positions_held)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def batch_ratios(model: Model, prompt: list[int], step_s: float) -> dict[int, float]:
    ratios = {}
    for m in (2, 4, 8, 16):
        times = []
        for _ in range(5):
            f = Forward(model)
            f.prefill(prompt)
            times.append(_timed(lambda: f.step_batch_all(prompt[:m], len(prompt))))
        ratios[m] = statistics.median(times) / step_s
    return ratios


def hf_decode(ckpt, dtype: str, prompt: list[int], steps: int) -> tuple[float, list[int]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype)).eval()
    times, out = [], []
    with torch.no_grad():
        res = model(torch.tensor([prompt]), use_cache=True)
        pkv, logits = res.past_key_values, res.logits[0, -1]
        for _ in range(steps):
            t = int(torch.argmax(logits))
            out.append(t)
            t0 = time.perf_counter()
            res = model(torch.tensor([[t]]), past_key_values=pkv, use_cache=True)
            times.append(time.perf_counter() - t0)
            pkv, logits = res.past_key_values, res.logits[0, -1]
    del model
    return statistics.median(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--arch", choices=("qwen3", "gemma4", "qwen3_5"), default="qwen3")
    ap.add_argument("--formats", default="fp32,bf16,int8")
    args = ap.parse_args()
    formats = args.formats.split(",")

    import torch

    torch.set_num_threads(2)
    presets = {"qwen3": (QWEN3_0P5B, "qwen3-0.5b"), "gemma4": (GEMMA4_0P4B, "gemma4-0.4b"),
               "qwen3_5": (QWEN3_5_0P4B, "qwen3_5-0.4b")}
    config, name = dict(presets[args.arch][0]), presets[args.arch][1]
    if args.quick:
        config["num_hidden_layers"], name = 4, f"{name}-4layer"
        if args.arch == "gemma4":
            config["layer_types"], config["num_kv_shared_layers"] = ["sliding_attention", "full_attention"] * 2, 1
    if args.arch == "qwen3":
        ckpt = build_random_checkpoint(name, config)
    else:
        ckpt = build_transformers_checkpoint(name, args.arch, config)
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, config["vocab_size"], 16)]

    bandwidth = measure_read_bandwidth()
    rows = []
    models = {}
    for fmt in formats:
        model = Model.load(ckpt, fmt)
        s, toks = our_decode(model, prompt, args.tokens)
        bytes_per_token = model.weight_bytes_per_token()
        rows.append((f"npud host, {fmt} weights", s, bytes_per_token, toks))
        models[fmt] = model if fmt == "bf16" else None
        if fmt != "bf16":
            del model
    for dtype in ("float32", "bfloat16"):
        s, toks = hf_decode(ckpt, dtype, prompt, args.tokens)
        rows.append((f"transformers {torch.__version__}, {dtype}", s, None, toks))

    hf_fp32 = next(r for r in rows if r[0].endswith("float32"))
    hf_bf16 = next(r for r in rows if r[0].endswith("bfloat16"))
    print(f"\n# bench/decode.py: {name}, {args.tokens} greedy steps after a 16-token prompt, "
          f"numba threads={_threads()}, torch threads={torch.get_num_threads()}")
    print(f"# measured read bandwidth: {bandwidth / 1e9:.1f} GB/s\n")
    print(f"| {'decoder':<34} | {'tok/s':>7} | {'vs HF fp32':>10} | {'vs HF bf16':>10} | {'roofline tok/s':>14} | {'of roofline':>11} |")
    print(f"|{'-' * 36}|{'-' * 9}|{'-' * 12}|{'-' * 12}|{'-' * 16}|{'-' * 13}|")
    for label, s, nbytes, _ in rows:
        roof = bandwidth / nbytes if nbytes else None
        print(
            f"| {label:<34} | {1 / s:>7.1f} | {hf_fp32[1] / s:>9.2f}x | {hf_bf16[1] / s:>9.2f}x | "
            f"{(f'{roof:.1f}' if roof else '-'):>14} | {(f'{(1 / s) / roof:.0%}' if roof else '-'):>11} |"
        )
    if "fp32" in formats:
        same = rows[formats.index("fp32")][3] == hf_fp32[3]
        print(f"\ngreedy tokens, ours fp32 == transformers fp32: {same}")
    if "bf16" not in formats:
        return
    bf16_model = models["bf16"]
    bf16_step = rows[formats.index("bf16")][1]
    ratios = batch_ratios(bf16_model, prompt, bf16_step)
    print("\n| step_batch_all rows (bf16) | " + " | ".join(f"M={m}" for m in ratios) + " |")
    print("|---|" + "---|" * len(ratios))
    print("| time / one step | " + " | ".join(f"{r:.2f}x" for r in ratios.values()) + " |")


def _threads() -> int:
    import numba

    return numba.get_num_threads()


if __name__ == "__main__":
    main()
