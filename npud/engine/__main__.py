"""Development CLI: stream a generation from a checkpoint directory, no daemon.

    python -m engine CHECKPOINT_DIR "def fib(n):" --max-tokens 64 [--draft DIR] [--spec ngram]
"""

from __future__ import annotations

import argparse
import json
import sys

import structlog

from npud.engine.api import (
    DEFAULT_LOOKUP_K,
    DEFAULT_SPEC_K,
    DEFAULT_SPEC_METHOD,
    SPEC_METHODS,
    GenerateRequest,
    GenerationParams,
    SamplingParams,
    SpecParams,
)
from npud.engine.session import LoadedModel


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m engine", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a Hugging Face-style checkpoint directory")
    ap.add_argument("prompt", help="the prompt text (with --chat: the user message)")
    ap.add_argument("--chat", action="store_true", help="render the prompt through the chat template")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    ap.add_argument("--format", default="bf16", choices=["fp32", "bf16", "int8", "int8-q8", "int8-q16", "bf16-bf16"], help="host weight format")
    ap.add_argument("--draft", help="a draft model checkpoint directory (same tokenizer)")
    ap.add_argument("--dflash", help="a DFlash drafter checkpoint directory trained on this base")
    ap.add_argument("--assistant", help="a Gemma 4 assistant (gemma4_assistant) checkpoint directory for this base")
    ap.add_argument("--spec", default=DEFAULT_SPEC_METHOD, choices=SPEC_METHODS)
    ap.add_argument("--k", type=int, default=None,
                    help=f"tokens drafted per round (default: {DEFAULT_LOOKUP_K} for prompt lookup, {DEFAULT_SPEC_K} otherwise)")
    ap.add_argument("--stats", action="store_true", help="print the run's statistics as JSON to stderr")
    args = ap.parse_args(argv)
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is the text
    try:
        served = LoadedModel.load("cli", args.checkpoint, args.draft, args.format, dflash_dir=args.dflash,
                                   assistant_dir=args.assistant)
        params = GenerationParams(
            max_tokens=args.max_tokens,
            sampling=SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
            stop=tuple(args.stop),
            spec=SpecParams(method=args.spec, k=args.k),
        )
        req = GenerateRequest(
            prompt=None if args.chat else args.prompt,
            messages=({"role": "user", "content": args.prompt},) if args.chat else None,
            params=params,
        )
        session = served.start(req)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    while not session.done:
        for event in session.run_round():
            sys.stdout.write(event.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    if args.stats:
        result = session.result()
        print(json.dumps({"finish_reason": result.finish_reason, **result.stats}, default=str), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
