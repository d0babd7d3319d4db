"""bench/speculative.py's assistant rows: the Gemma 4 assistant drafter on the random 0.4B
Gemma 4 checkpoint, in one-pass and two-pass rounds, all measured in one run.

The assistant is random too (transformers' init, ordered embeddings with 2048 centroids, top 32),
so its own drafts are almost never accepted: those rows show what a round costs. The "oracle"
rows keep the assistant's forward (the same draft cost) but take each token from plain decode's
stream, so every draft is accepted: they show the passes per token a perfect assistant reaches.
Two tables: what a round costs in base steps (a step, the verify batches and the drafts timed in
turn, medians), with the break-even acceptance that cost implies on this host (a round pays when
it yields `cost` tokens, t1 plus cost - 1 accepted drafts: (cost - 1) / k); and the loop itself:
base passes per token, acceptance, tok/s against plain decode, byte-equality.
"""

from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path

from synth import GEMMA4_0P4B, OUT, build_transformers_checkpoint

from npud.engine.assistant import Assistant, AssistantHead
from npud.engine.forward import Forward
from npud.engine.model import Model
from npud.engine.sampling import Sampler
from npud.engine.api import SpecParams
from npud.engine.speculative import DecodeStats, plain_decode, speculative_decode
from npud.engine.tokenizer import Tokenizer

# a 4-layer assistant of width 256 for the 0.4B base (backbone 1024): its sliding layers read the
# base's 1 x 128 sliding plane, its full layer the 1 x 256 full plane (keys as values)
ASSISTANT_TEXT = dict(
    vocab_size=65536, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=1, head_dim=128, global_head_dim=256, num_global_key_value_heads=1, attention_k_eq_v=True,
    sliding_window=512, layer_types=["sliding_attention"] * 3 + ["full_attention"], hidden_size_per_layer_input=0,
    vocab_size_per_layer_input=0, max_position_embeddings=4096, eos_token_id=0, bos_token_id=None, pad_token_id=0,
)


def host_line() -> str:
    """The CPU model and the load average, printed beside every timing."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
        load = Path("/proc/loadavg").read_text().split()[:3]
    except OSError:
        load = ["?"] * 3
    return f"CPU: {model}; load average {' '.join(load)}"


def build_assistant_checkpoint(name: str = "gemma4-0.4b-assistant", seed: int = 0) -> Path:
    """A random transformers Gemma4AssistantForCausalLM (bf16) for GEMMA4_0P4B, once."""
    import torch
    import transformers

    out = OUT / name
    done = out / ".complete"
    if done.exists():
        return out
    config = transformers.Gemma4AssistantConfig(
        text_config=transformers.Gemma4TextConfig(**ASSISTANT_TEXT), backbone_hidden_size=GEMMA4_0P4B["hidden_size"],
        use_ordered_embeddings=True, num_centroids=2048, centroid_intermediate_top_k=32,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises the ordering to zeros, which no trained checkpoint has
        model.masked_embedding.token_ordering.copy_(torch.randperm(ASSISTANT_TEXT["vocab_size"]))
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    done.write_text("ok\n")
    return out


def _run(model, prompt, n, head=None, k=7):
    f = Forward(model)
    f.prefill(prompt[:-1])
    if head is not None:
        head.reset()
        head.attach(f)
    out, stats = [], DecodeStats()
    common = dict(max_new_tokens=n, sampler=Sampler(), on_token=out.append, stats=stats)
    loop = (plain_decode(f, prompt, **common) if head is None
            else speculative_decode(f, head, prompt, config=SpecParams(k=k, adapt_k=False, fallback_rounds=0),
                                    **common))
    for _ in loop:
        pass
    return out, stats


def _costs(model, assistant, stream: list[int], k: int, reps: int) -> dict[str, float]:
    """Median seconds of a base step, the verify batches (k + 1 and k rows), and a one-pass and a
    two-pass draft of k tokens, taken in turn `reps` times so that drift hits them alike."""
    ctx = stream[:-1]  # t1 = ctx[-1] at position p = len(ctx) - 1
    p = len(ctx) - 1
    one = Forward(model)
    one.prefill(ctx[:-1])  # the one-pass state: positions < p
    two = Forward(model)
    two.prefill(ctx)  # the two-pass state: t1 run, rows p - 1 and p
    h1, h2 = AssistantHead(assistant), AssistantHead(assistant, two_pass=True)
    samples: dict[str, list[float]] = {name: [] for name in ("step", "verify_k1", "verify_k", "draft1", "draft2")}

    def timed(name, fn):
        started = time.perf_counter()
        fn()
        samples[name].append(time.perf_counter() - started)

    batch = stream[p:p + k + 1]
    for _ in range(reps):
        timed("step", lambda: one.step(ctx[-1], p))
        one.truncate(p)
        timed("verify_k1", lambda: one.step_batch_all(batch, p))
        one.truncate(p)
        if k > 1:
            timed("verify_k", lambda: one.step_batch_all(batch[:k], p))
            one.truncate(p)
        h1.reset()
        h1.attach(one)
        timed("draft1", lambda: h1.draft(ctx, k))
        h2.reset()
        h2.attach(two)
        h2.commit_rows(ctx[-2:], two.last_hidden_rows()[-2:], 2)
        timed("draft2", lambda: h2.draft(ctx, k))
    out = {name: statistics.median(v) for name, v in samples.items() if v}
    out.setdefault("verify_k", out["step"])  # one row is a step
    return out


def assistant_table(n: int = 32, ks: tuple[int, ...] = (1, 3, 7), reps: int = 9) -> None:
    """Print the assistant rows: a cost table and a loop table, all measured in this run."""
    base_dir = build_transformers_checkpoint("gemma4-0.4b", "gemma4", dict(GEMMA4_0P4B))
    model = Model.load(base_dir, "bf16")
    assistant = Assistant.load(build_assistant_checkpoint(), model, "bf16")
    tok = Tokenizer.from_dir(base_dir)
    prompt = tok.encode("The river had been rising for three days when the ferryman finally agreed to take us across.")
    started = time.perf_counter()
    plain, plain_stats = _run(model, prompt, n)
    stream = prompt + plain

    def oracle(logits, position):
        return stream[position] if position < len(stream) else 0

    costs = {k: _costs(model, assistant, stream, k, reps) for k in ks}
    rows = []
    for k in ks:
        for two_pass in (False, True):
            for drafts, pick in (("random assistant", None), ("oracle", oracle)):
                head = AssistantHead(assistant, two_pass=two_pass, **({"pick": pick} if pick else {}))
                out, s = _run(model, prompt, n, head, k)
                rows.append((k, two_pass, drafts, s, out == plain))
    print(f"\n# bench/speculative.py, assistant rows: gemma4-0.4b (bf16) + a random 4-layer assistant (width 256, "
          f"ordered embeddings 2048/32, bf16); {time.perf_counter() - started:.0f} s for both tables")
    print(host_line())
    print(f"\n## what a round costs, in base steps (medians of {reps}, taken in turn; prompt {len(prompt)} tokens)\n")
    head = ("| k | base step ms | draft one-pass | per draft step | verify k+1 rows | one-pass round "
            "| break-even (one-pass) | draft two-pass | verify k rows | two-pass round | break-even (two-pass) |")
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for k, c in costs.items():
        step = c["step"]
        d1, d2, v1, v2 = c["draft1"] / step, c["draft2"] / step, c["verify_k1"] / step, c["verify_k"] / step
        one, two = d1 + v1, 1.0 + d2 + v2  # two-pass: t1's step, the draft, the batch of d1..dk
        print(f"| {k} | {step * 1e3:.1f} | {d1:.3f} | {d1 / k:.3f} | {v1:.2f} | {one:.2f} | {(one - 1) / k:.2f} | "
              f"{d2:.3f} | {v2:.2f} | {two:.2f} | {(two - 1) / k:.2f} |")
    print("\nround cost: one-pass draft + verify of k + 1 rows; two-pass step + draft + verify of k rows (a two-pass "
          "round whose d1 is rejected costs step + draft for one token). break-even: the acceptance at which a round "
          "yields its cost in tokens, t1 plus cost - 1 drafts: (cost - 1) / k.")
    print(f"\n## the loop: {n} greedy tokens, k fixed, fallback off; plain decode {plain_stats.tokens_per_second:.2f} "
          f"tok/s\n")
    head = "| k | round | drafts | base passes/token | accepted | tok/s vs plain | byte-equal |"
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for k, two_pass, drafts, s, equal in rows:
        print(f"| {k} | {'two-pass' if two_pass else 'one-pass'} | {drafts} | {s.passes_per_token:.3f} | "
              f"{s.accepted} / {s.drafted} | {s.tokens_per_second / plain_stats.tokens_per_second:.2f}x | "
              f"{'yes' if equal else 'NO'} |")
    print("\noracle: the assistant's forward runs (same draft cost) but each token is taken from plain decode's "
          "stream, so every draft is accepted; the random assistant's own drafts almost never are.")


if __name__ == "__main__":
    assistant_table()
