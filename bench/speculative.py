"""Speculative vs plain greedy decode: tokens/s, acceptance, base passes per token, byte-equality.

One run, one table. Models: the tiny parity checkpoint of the tests (qwen3, fp32) and the
~0.5B random Qwen3-shaped checkpoint of bench/synth.py (bf16). Prompts: (a) a code edit (the
model is asked to repeat a function with one change), (b) prose, (c) random tokens, where the
break-even fallback must hold the loss to at most 5%. The drafter is prompt lookup (n-gram);
every speculative output is compared with plain greedy's, token for token and as bytes.
Both models are random, so acceptance reflects what a random model repeats, not a trained
model's copying; the ratios (passes per token, fallback loss) are the mechanics.

A second table runs the bundled model pair (npud/models: pycode-base with its draft model
and its DFlash drafter, all trained here) on code completion, a code edit and docstring
prose, plain vs prompt lookup vs draft model vs DFlash, through the daemon's session API;
the same methods then run on the random 0.5B with a random 2-layer draft model and a random
2-layer DFlash (--models ...,drafters): random drafts are almost never accepted, so those rows
show what a drafter's rounds cost on this host before the break-even fallback ends them.

A third table (--models ...,assistant; bench/speculative_assistant.py) runs the Gemma 4 assistant
drafter on the random 0.4B Gemma 4 checkpoint, one-pass and two-pass: base passes per token, the
draft's cost per round in base steps and the break-even acceptance it implies on this host.

Run: .venv/bin/python bench/speculative.py [--tokens N] [--quick] [--reps R] [--models tiny,large,bundled,assistant]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np
from synth import (
    GEMMA4_0P4B,
    QWEN3_0P5B,
    QWEN3_5_0P4B,
    build_random_checkpoint,
    build_random_dflash,
    build_transformers_checkpoint,
)

from npud.engine.drafters import PromptLookupHead
from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.engine.sampling import Sampler
from npud.engine.api import SpecParams
from npud.engine.speculative import DecodeStats, plain_decode, speculative_decode
from npud.engine.tokenizer import Tokenizer

CODE = '''def moving_average(values, window):
    total = 0.0
    out = []
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
'''
CODE_EDIT = f"Repeat this function exactly, but rename `total` to `acc`:\n\n{CODE}\nHere it is:\n\n"
PROSE = (
    "The river had been rising for three days when the ferryman finally agreed to take us "
    "across. He said little, and what he said was mostly about the weather, the price of "
    "grain, and a cousin of his who had gone north and never written. "
)


def run(model: Model, prompt: list[int], n: int, head, config: SpecParams) -> tuple[list[int], DecodeStats]:
    f = Forward(model)
    if len(prompt) > 1:
        f.prefill(prompt[:-1])
    out: list[int] = []
    stats = DecodeStats()
    common = dict(max_new_tokens=n, sampler=Sampler(), on_token=out.append, stats=stats)
    loop = plain_decode(f, prompt, **common) if head is None else speculative_decode(f, head, prompt, config=config, **common)
    for _ in loop:
        pass
    return out, stats


def measure(model, tokenizer, prompt, n, reps, config) -> dict:
    plain_tps, spec_tps, spec_stats = [], [], []
    plain_out = spec_out = None
    for _ in range(reps):  # alternate, so drift on a shared machine hits both alike
        plain_out, s = run(model, prompt, n, None, config)
        plain_tps.append(s.tokens_per_second)
        spec_out, s = run(model, prompt, n, PromptLookupHead(min_n=2, max_n=4), config)
        spec_tps.append(s.tokens_per_second)
        spec_stats.append(s)
    s = spec_stats[-1]
    decodable = all(t < tokenizer.vocab_size for t in plain_out + spec_out)
    same_bytes = (tokenizer.decode(spec_out).encode() == tokenizer.decode(plain_out).encode()) if decodable else True
    return dict(
        # best of reps: on a shared machine the slow runs measure the neighbours, not the loop
        plain=max(plain_tps),
        spec=max(spec_tps),
        acceptance=s.acceptance_rate,
        drafted=s.drafted,
        passes=s.passes_per_token,
        ratio=s.verify_step_ratio,
        fallback=(f"round {s.fallbacks[0].round}" if s.fell_back else "no"),
        equal=spec_out == plain_out and same_bytes,
    )


def prompts(tokenizer, vocab: int) -> dict[str, list[int]]:
    rng = np.random.default_rng(0)
    specials = set(tokenizer.special_token_ids)
    pool = [i for i in range(min(vocab, tokenizer.vocab_size)) if i not in specials]
    return {
        "code edit": tokenizer.encode(CODE_EDIT),
        "prose": tokenizer.encode(PROSE),
        "random tokens": [int(t) for t in rng.choice(pool, 96)],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=256, help="tokens per run on the tiny model")
    ap.add_argument("--tokens-large", type=int, default=64, help="tokens per run on the 0.5B model")
    ap.add_argument("--reps", type=int, default=9, help="runs per cell on the tiny model (best of)")
    ap.add_argument("--models", default="tiny,large,bundled,drafters",
                    help="which of tiny,large,bundled,drafters,gemma4,qwen3_5,assistant to run (drafters: the draft "
                         "model and DFlash rows on the random 0.5B, --tokens-large tokens; gemma4, qwen3_5: 0.4B random "
                         "Gemma4- and Qwen3.5-shaped models, bf16, --tokens-large tokens; assistant: the Gemma 4 "
                         "assistant drafter on the 0.4B Gemma4, --tokens-assistant tokens)")
    ap.add_argument("--tokens-assistant", type=int, default=24, help="tokens per run in the assistant rows")
    ap.add_argument("--reps-large", type=int, default=1, help="runs per cell on the large models (best of)")
    ap.add_argument("--tokens-bundled", type=int, default=96, help="tokens per run on the bundled pair")
    ap.add_argument("--quick", action="store_true", help="a 4-layer 0.5B-wide model, for a smoke run")
    args = ap.parse_args()
    config = SpecParams(k=7)  # k up to 7 (this bench's choice), fallback after 3 rounds (the default)

    from npud.engine.testing.checkpoints import build_tiny_checkpoint

    rows = []
    models = args.models.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tiny_dir = build_tiny_checkpoint(Path(tmp) / "tiny", model_type="qwen3")
        tiny, tok = Model.load(tiny_dir, "fp32"), Tokenizer.from_dir(tiny_dir)
        for label, prompt in prompts(tok, tiny.config.vocab_size).items():
            if "tiny" in models:
                rows.append(("tiny qwen3 (fp32)", label, measure(tiny, tok, prompt, args.tokens, args.reps, config)))

    big_config = dict(QWEN3_0P5B)
    name = "qwen3-0.5b"
    if args.quick:
        big_config["num_hidden_layers"], name = 4, "qwen3-0.5b-4layer"
    if "large" in models:
        big_dir = build_random_checkpoint(name, big_config)
        big, tok = Model.load(big_dir, "bf16"), Tokenizer.from_dir(big_dir)
        for label, prompt in prompts(tok, big.config.vocab_size).items():
            rows.append((f"{name} (bf16)", label, measure(big, tok, prompt, args.tokens_large, args.reps_large, config)))

    for arch, preset, hybrid_name in (("gemma4", GEMMA4_0P4B, "gemma4-0.4b"), ("qwen3_5", QWEN3_5_0P4B, "qwen3_5-0.4b")):
        if arch in models:
            hybrid_dir = build_transformers_checkpoint(hybrid_name, arch, dict(preset))
            hybrid, tok = Model.load(hybrid_dir, "bf16"), Tokenizer.from_dir(hybrid_dir)
            for label, prompt in prompts(tok, hybrid.config.vocab_size).items():
                rows.append((f"{hybrid_name} (bf16)", label, measure(hybrid, tok, prompt, args.tokens_large, args.reps_large, config)))

    head = (f"| {'model':<24} | {'prompt':<13} | {'plain tok/s':>11} | {'spec tok/s':>10} | {'speedup':>7} | "
            f"{'accepted':>13} | {'passes/token':>12} | {'verify/step':>11} | {'fallback':>9} | {'byte-equal':>10} |")
    if rows:
        print(f"\n# bench/speculative.py: prompt lookup (n = 2..4), k up to {config.k} (adapt_k={config.adapt_k}), "
              f"fallback after {config.fallback_rounds} rounds below break-even; greedy; tiny: {args.tokens} tokens, "
              f"best of {args.reps}; large models: {args.tokens_large} tokens, best of {args.reps_large}\n")
        print(head)
        print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for model_name, label, r in rows:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        accepted = f"{r['acceptance']:.2f} of {r['drafted']}"
        print(
            f"| {model_name:<24} | {label:<13} | {r['plain']:>11.1f} | {r['spec']:>10.1f} | "
            f"{r['spec'] / r['plain']:>6.2f}x | {accepted:>13} | {r['passes']:>12.3f} | {ratio:>11} | "
            f"{r['fallback']:>9} | {('yes' if r['equal'] else 'NO'):>10} |"
        )
    print()
    if "bundled" in models:
        bundled_table(args.tokens_bundled, args.reps)
    if "drafters" in models:
        random_drafters_table(args.tokens_large, args.reps_large, args.quick)
    if "assistant" in models:
        from speculative_assistant import assistant_table

        assistant_table(args.tokens_assistant)
    for model_name, label, r in rows:
        if label == "random tokens":
            loss = 1.0 - r["spec"] / r["plain"]
            verdict = "within" if loss <= 0.05 else "OVER"
            print(f"{model_name}, random tokens: loss vs plain {loss:+.1%} ({verdict} the 5% bound)")


BUNDLED_PROMPTS = {
    "code completion": "class LineCounter:\n    \"\"\"Count the lines of the files it is given.\"\"\"\n\n    def __init__(self):",
    "code edit": (
        "def parse_header(line):\n    name, _, value = line.partition(':')\n    name = name.strip().lower()\n"
        "    value = value.strip()\n    if not name:\n        raise ValueError('empty header name')\n"
        "    return name, value\n\n\n# The same function, renamed to parse_field:\ndef parse_field(line):"
    ),
    "docstring prose": "def merge_intervals(intervals):\n    \"\"\"Merge overlapping intervals.\n\n    The intervals",
}


# (key, spec method, fallback_rounds, label): the "kept" rows switch the break-even fallback
# off, to show what each drafter would buy where a verify costs what a step costs (the NPU)
BUNDLED_METHODS = (
    ("plain", "none", 3, "plain greedy"),
    ("ngram", "ngram", 3, "prompt lookup"),
    ("draft", "draft", 3, "draft model"),
    ("dflash", "dflash", 3, "DFlash"),
    ("draft-kept", "draft", 0, "draft model, no fallback"),
    ("dflash-kept", "dflash", 0, "DFlash, no fallback"),
)


def bundled_table(n: int, reps: int) -> None:
    """plain vs prompt lookup vs draft model vs DFlash on the bundled pair, through sessions."""
    from npud.engine.session import LoadedModel

    root = Path(__file__).resolve().parent.parent / "npud" / "models"
    served = LoadedModel.load("pycode", root / "pycode-base", draft_dir=root / "pycode-draft",
                              dflash_dir=root / "pycode-dflash", weight_format="bf16")
    drafter_table(f"bundled pair (pycode-base 5.8M, bf16): {n} tokens, k up to 7, best of {reps} per cell",
                  served, n, reps)


def random_drafters_table(n: int, reps: int, quick: bool) -> None:
    """The same methods on the random 0.5B Qwen3 (bf16) with a random 2-layer draft model of its
    width and a random 2-layer DFlash: acceptance is what random drafts get (about none), so
    the rows measure what each drafter's rounds cost before the break-even fallback ends them."""
    from npud.engine.session import LoadedModel

    config, name = dict(QWEN3_0P5B), "qwen3-0.5b"
    if quick:
        config["num_hidden_layers"], name = 4, "qwen3-0.5b-4layer"
    base = build_random_checkpoint(name, config)
    draft = build_random_checkpoint(f"{name}-draft2", dict(config, num_hidden_layers=2), seed=1)
    dflash = build_random_dflash(f"{name}-dflash2", config, layers=2, seed=2)
    served = LoadedModel.load(name, base, draft_dir=draft, dflash_dir=dflash, weight_format="bf16")
    drafter_table(f"random {name} (bf16) with a random 2-layer draft model and a random 2-layer DFlash: "
                  f"{n} tokens, k up to 7, best of {reps} per cell", served, n, reps)


def drafter_table(title: str, served, n: int, reps: int) -> None:
    """plain vs prompt lookup vs draft model vs DFlash on `served`, through sessions."""
    from npud.engine.api import GenerateRequest, GenerationParams

    print(f"# {title}\n")
    print("| prompt | method | tok/s | vs plain | accepted / drafted | tokens per round | base passes/token | byte-equal |")
    print("|---|---|---|---|---|---|---|---|")
    for label, prompt in BUNDLED_PROMPTS.items():
        results = {}
        for _ in range(reps):  # alternate methods, so drift hits them alike
            for key, method, fallback, _ in BUNDLED_METHODS:
                params = GenerationParams(max_tokens=n, use_prefix_cache=False,
                                          spec=SpecParams(method=method, k=7, fallback_rounds=fallback))
                req = GenerateRequest(prompt=prompt, params=params)
                session = served.start(req)
                while not session.done:
                    session.run_round()
                r = session.result()
                best = results.get(key)
                if best is None or r.stats["tokens_per_second"] > best.stats["tokens_per_second"]:
                    results[key] = r
        plain = results["plain"]
        for key, _, _, name in BUNDLED_METHODS:
            r = results[key]
            st = r.stats
            per_round = (st["accepted"] + st["rounds"]) / st["rounds"] if st["rounds"] else 0.0
            print(f"| {label} | {name} | {st['tokens_per_second']:.0f} | "
                  f"{st['tokens_per_second'] / plain.stats['tokens_per_second']:.2f}x | "
                  f"{st['accepted']} / {st['drafted']} | {per_round:.2f} | {st['passes_per_token']:.3f} | "
                  f"{'yes' if r.text.encode() == plain.text.encode() else 'NO'} |")
    print()


if __name__ == "__main__":
    main()
