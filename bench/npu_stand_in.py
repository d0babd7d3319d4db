"""A decode on the NPU stand-in (tests/fake_pyxrt.py, arithmetic off): what one token costs
the NPU path in calls, not in time. Prints JSON per model: dispatches_per_token (kernel runs),
worker_round_trips_per_token (and per layer), contexts_opened (at load, and re-opened while
decoding), bytes_copied_per_token (activations to the device, outputs from it, the frames
through the worker's pipes and the arrays through its shared region, each also apart), the
weight bytes copied to the device during the load and during the decode (0: weights stay
resident), and the weight bytes resident on the device per weight format
(`weight_bytes_resident`). Each model runs in each of --formats: "bf16" (the model's weights to
bf16 designs, each shape for the build tool's default M: the smallest the device's tiles allow
and 128) and "int8" (the same checkpoint loaded as int8 rows with a scale each, to int8
designs: i8 B buffers, M = 64 rows a pass).

The models are shaped as Qwen3-0.6B (28 layers, hidden 1024, 16 x 128 query heads, 8 KV heads,
MLP 3072, vocabulary 151936, tied head) and gemma-3-270m (18 layers, hidden 640, 4 x 256 query
heads, 1 KV head, MLP 2048, vocabulary 262144), with random weights (--layers N: N layers each,
quicker; the figures are per token and per layer). "qwen3-0.6b+draft" adds a smaller draft model of the same vocabulary on npu1 (6
hardware contexts), decoded with speculation: the case where contexts thrash.

The simulator is not an NPU: these are counts, and the start-up check is skipped (its
arithmetic is off). On hardware, tools/npu_checklist.py times the same path.

    .venv/bin/python bench/npu_stand_in.py [--tokens 8] [--layers 2] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import fake_pyxrt  # noqa: E402

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, max_position_embeddings=4096)
QWEN3_DRAFT = dict(vocab_size=151936, hidden_size=512, intermediate_size=1536, num_attention_heads=8,
                   num_key_value_heads=4, head_dim=64, tie_word_embeddings=True, max_position_embeddings=4096)
GEMMA3_270M = dict(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, sliding_window=512, query_pre_attn_scalar=256,
                   max_position_embeddings=4096, pad_token_id=0, eos_token_id=1, bos_token_id=2)
PROMPT = "def add(a, b):\n    return a + b\n"


class _Patch:
    def setitem(self, mapping, key, value):
        mapping[key] = value

    def setattr(self, obj, name, value):
        setattr(obj, name, value)


def _build(folder: Path, kind: str, params: dict, layers: int, seed: int) -> Path:
    """A random checkpoint of `params`' shapes with `layers` layers (cached in `folder`)."""
    import torch
    import transformers

    from npud.engine.testing.checkpoints import write_tokenizer

    if (folder / "config.json").exists():
        return folder
    torch.manual_seed(seed)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=layers, **params))
    else:
        types = ["sliding_attention"] * (layers - 1) + ["full_attention"]
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            num_hidden_layers=layers, layer_types=types, **params))
    model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder, vocab_size=320)
    return folder


def _shapes(dirs: list[Path], weight_format: str = "bf16") -> list[tuple[int, int]]:
    tool = fake_pyxrt.build_tool()
    return sorted({(s.K, s.N) for s in tool.gemm_shapes(dirs, weight_format)})


def run_model(name: str, base: Path, draft: Path | None, device: str, tokens: int, folder: Path,
              one_xclbin: bool = True, weight_format: str = "bf16") -> dict:
    """Load `base` (with `draft`) in `weight_format` on a stand-in table for `device`, decode, count."""
    from npud.engine.api import GenerateRequest, GenerationParams, SpecParams
    from npud.engine.loader import load_model
    dirs = [base] + ([draft] if draft is not None else [])
    shapes = _shapes(dirs, weight_format)
    if weight_format == "int8":  # the int8 kernels' multiples of 16 (tools/build_npu_designs.py --int8-rows 64)
        tiling = dict(device=device, M=64, tile=(16, 64, 32), columns=4, weight_format="int8")
    elif device == "npu1":  # the build tool's default sizes: the smallest M the tiles allow, and 128
        tiling = dict(device="npu1", M=16, tile=(4, 64, 32), columns=4, more_m=(128,))
    else:
        tiling = dict(device="npu2", M=32, tile=(8, 64, 32), columns=4, more_m=(128,))
    # as tools/build_npu_designs.py builds them: every design a kernel of one xclbin (or one each)
    linked = {"one_xclbin": True} if one_xclbin else {}  # (a tree from before one_xclbin takes no such key)
    table = fake_pyxrt.write_design_table(folder / f"designs-{name}-{weight_format}-{int(one_xclbin)}", shapes,
                                          **linked, **tiling)
    served = load_model(name, base, draft_dir=draft, weight_format=weight_format, backend="xrt", xrt_design=table)
    backend = served.model.backend
    try:
        layers = served.model.config.num_layers + (served.draft.config.num_layers if served.draft else 0)
        method = "draft" if draft is not None else "none"
        params = GenerationParams(max_tokens=tokens + 2, spec=SpecParams(method=method, k=3))
        loaded = backend.stats()
        session = served.start(GenerateRequest(prompt=PROMPT, params=params))
        session.run_round()  # the prefill and the first token: not steady state
        # the worker's counters are read before each stats() call goes through the worker: two
        # calls in a row measure one call's own round trip and frames, taken off the window below
        first, warm = backend.stats(), backend.stats()
        own = {k: warm[k] - first[k] for k in ("worker_round_trips", "pipe_bytes", "shared_bytes")}
        emitted = 0
        while not session.done:
            emitted += sum(1 for e in session.run_round() if e.token_id is not None)
        after = backend.stats()
        step = _one_step(served.model)
    finally:
        backend.close()
    for k, v in own.items():
        after[k] -= v  # `warm`'s own call
    per = {k: (after[k] - warm[k]) / max(emitted, 1) for k in ("passes", "worker_round_trips", "pipe_bytes",
                                                              "shared_bytes", "bytes_to_device",
                                                              "bytes_from_device")}
    base_layers = served.model.config.num_layers
    return {
        "model": name, "weight_format": weight_format, "device": device, "layers": base_layers, "draft_layers": layers - base_layers,
        "gemm_shapes": len(shapes), "tokens_measured": emitted, "speculation": method,
        "dispatches_per_token": round(per["passes"], 2),
        "worker_round_trips_per_token": round(per["worker_round_trips"], 2),
        "worker_round_trips_per_layer_per_token": round(per["worker_round_trips"] / layers, 2),
        # one plain decode step of the base model alone (a token's window above may hold more than
        # one forward pass, and speculation's batches)
        "worker_round_trips_per_step": step,
        "worker_round_trips_per_layer_per_step": round(step / served.model.config.num_layers, 3),
        "contexts_opened": loaded["contexts_opened"],
        "contexts_reopened_while_decoding": after["contexts_opened"] - warm["contexts_opened"],
        "bytes_copied_per_token": int(per["bytes_to_device"] + per["bytes_from_device"] + per["pipe_bytes"]
                                      + per["shared_bytes"]),
        "bytes_through_pipes_per_token": int(per["pipe_bytes"]),
        "bytes_through_shared_memory_per_token": int(per["shared_bytes"]),
        "weight_bytes_at_load": loaded["weight_bytes"],
        "weight_bytes_while_decoding": after["weight_bytes"] - warm["weight_bytes"],
        "weight_bytes_resident": after.get("weight_bytes_resident", {}),
    }


def _one_step(model) -> int:
    """The worker round trips of one plain decode step of `model` (a fresh state, a 4-token prompt)."""
    from npud.engine.forward import Forward

    f = Forward(model)
    f.prefill([5, 6, 7, 8])
    before = model.backend.device.round_trips
    f.step(9, f.positions_held)
    return model.backend.device.round_trips - before


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8, help="tokens decoded after the first")
    p.add_argument("--layers", type=int, default=None,
                   help="layers of each model (default: theirs, 28 and 18; the figures are per token and per layer)")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "npud-stand-in")
    p.add_argument("--json", action="store_true")
    p.add_argument("--formats", default="bf16,int8",
                   help="weight formats to load each model in, comma-separated (bf16, int8)")
    p.add_argument("--xclbin-per-shape", action="store_true",
                   help="one xclbin per shape, as tools/build_npu_designs.py --xclbin-per-shape builds them")
    args = p.parse_args(argv)
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))  # stdout is the JSON
    fake_pyxrt.install(_Patch())
    from npud.kernels import xrt, xrt_check

    xrt.probe = lambda accel_dir="/dev/accel": (True, "the pyxrt stand-in (tests/fake_pyxrt.py)")
    xrt_check.check_design = lambda *a, **k: ([], [])  # its arithmetic is off: nothing to check
    folder = args.workdir
    folder.mkdir(parents=True, exist_ok=True)
    control = folder / "control.json"
    control.write_text(json.dumps({"mode": "compute", "on": False}))
    os.environ["FAKE_PYXRT_CONTROL"] = str(control)
    q_layers, g_layers = (args.layers, args.layers) if args.layers else (28, 18)
    qwen = _build(folder / f"qwen3-0.6b-{q_layers}l", "qwen3", QWEN3_06B, q_layers, 0)
    qdraft = _build(folder / "qwen3-draft-1l", "qwen3", QWEN3_DRAFT, 1, 1)
    gemma = _build(folder / f"gemma3-270m-{g_layers}l", "gemma3", GEMMA3_270M, g_layers, 2)
    one = not args.xclbin_per_shape
    formats = [f for f in args.formats.split(",") if f]
    if not formats or any(f not in ("bf16", "int8") for f in formats):
        p.error(f"--formats {args.formats!r}: bf16, int8 or both")
    results = [r for fmt in formats for r in (
        run_model("qwen3-0.6b", qwen, None, "npu2", args.tokens, folder, one, fmt),
        run_model("qwen3-0.6b+draft", qwen, qdraft, "npu1", args.tokens, folder, one, fmt),
        run_model("gemma-3-270m", gemma, None, "npu2", args.tokens, folder, one, fmt))]
    if args.json:
        print(json.dumps({"stand_in": results}, indent=1))
    else:
        for r in results:
            print(", ".join(f"{k} {v}" for k, v in r.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
