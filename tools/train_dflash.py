"""Train a DFlash draft for the bundled base (npud/models/pycode-base) on the CPU, and measure it.

The draft reads the frozen base's layer taps (the outputs of a few of its layers at every
position), fuses them into one context row per position, and drafts a block of tokens in one
pass: [last token, mask, ..., mask] through two Qwen3-style layers whose attention sees the
context rows and the whole block, then the base's own LM head. The checkpoint is written in
the published DFlash layout (config.json with dflash_config, safetensors), so npud/engine/dflash/
and the reference `dflash` package both load it.

Stages, reading the corpus that ``tools/train_pair.py --stage tokenizer`` left in --work-dir:

    train  draft training on the base's taps -> npud/models/pycode-dflash (+ training.json)
    eval   acceptance through npud.engine.speculative on held-out stdlib files: DFlash against prompt
           lookup and the small draft model (npud/models/pycode-draft) -> work/dflash_eval.json

How it trains: for each window of the corpus the base runs once (no gradient) and gives the
taps at every position. Anchors are drawn in the window; from each anchor a the base continues
greedily for block - 2 more tokens (one extra pass per token for all anchors at once, each
chain seeing the window up to its anchor). That continuation, not the corpus, is what a draft
is accepted against. The draft sees the context rows of positions < a and the block
[x[a], mask * 7] at positions a..a+7, and learns the base's distribution at each position of
the chain (KL to the base, plus cross-entropy on the base's greedy token), weighted
exp(-(j-1)/gamma) along the block because a draft is only worth its accepted prefix. Many
anchors share one pass: each block's rows see only their own block and the context before
their anchor (an attention mask).

The learning-rate schedule is a function of --steps alone and batches come from (seed, step),
so a run resumed from its state is the run that was never interrupted; --minutes stops a run
on the wall clock (it saves its state and exports what it has).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import train_pair  # noqa: E402  (the corpus split, batches and schedule of the bundled pair)

REPO = train_pair.REPO
sys.path.insert(0, str(REPO))
OUT_NAME = "pycode-dflash"
MASK_TOKEN = train_pair.IM_START  # never in the stdlib corpus; its embedding marks the rows to draft


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- the draft, in torch


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, head_dim: int, eps: float):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(d, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, d, bias=False)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=eps)

    def forward(self, h, context, rope_q, rope_k, mask):
        # h: [b, R, D] block rows, context: [b, T, D] fused context rows, mask: [b, 1, R, T + R]
        b, r, _ = h.shape
        q = self.q_norm(self.q_proj(h).view(b, r, self.heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, h], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, *rope_q), _rotate(k, *rope_k)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, r, -1))


def _rotate(x, cos, sin):
    # half-split RoPE, as transformers' rotate_half: cos/sin [b, 1, L, head_dim]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Layer(nn.Module):
    def __init__(self, config):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

        d, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Attention(d, config.num_attention_heads, config.num_key_value_heads, config.head_dim, eps)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(d, eps=eps)
        self.post_attention_layernorm = Qwen3RMSNorm(d, eps=eps)

    def forward(self, x, context, rope_q, rope_k, mask):
        x = x + self.self_attn(self.input_layernorm(x), context, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Draft(nn.Module):
    """The DFlash draft's parameters under the names of the published layout."""

    def __init__(self, config, num_taps: int):
        super().__init__()
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

        d = config.hidden_size
        self.config = config
        self.layers = nn.ModuleList(Layer(config) for _ in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        self.fc = nn.Linear(num_taps * d, d, bias=False)
        self.hidden_norm = Qwen3RMSNorm(d, eps=config.rms_norm_eps)
        theta = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim), persistent=False)

    def rope(self, positions):
        freqs = positions[..., None].float() * self.inv_freq  # [b, L, dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)[:, None]
        return emb.cos(), emb.sin()

    def forward(self, taps, embedded, block_positions, mask):
        """taps [b, T, F] of positions 0..T-1, embedded [b, R, D] block rows at block_positions
        [b, R] -> drafted rows [b, R, D] (final-normed)."""
        b, t, _ = taps.shape
        context = self.hidden_norm(self.fc(taps))
        rope_q = self.rope(block_positions)
        rope_k = self.rope(torch.cat([torch.arange(t).expand(b, t), block_positions], dim=1))
        x = embedded
        for layer in self.layers:
            x = layer(x, context, rope_q, rope_k, mask)
        return self.norm(x)


def block_inputs(ids: torch.Tensor, anchors: torch.Tensor, block: int, mask_id: int):
    """Block token ids [b, A * block], positions [b, A * block] and the attention mask
    [b, 1, A * block, T + A * block] for anchors [b, A] in windows ids [b, T]."""
    b, t = ids.shape
    a = anchors.shape[1]
    offsets = torch.arange(block)
    positions = (anchors[..., None] + offsets).reshape(b, a * block)
    tokens = torch.full((b, a, block), mask_id, dtype=torch.long)
    tokens[..., 0] = ids.gather(1, anchors)
    row_anchor = anchors.repeat_interleave(block, dim=1)  # [b, R]
    sees_context = torch.arange(t)[None, None, :] < row_anchor[..., None]  # positions before the anchor
    which = torch.arange(a).repeat_interleave(block)
    sees_block = (which[:, None] == which[None, :]).expand(b, -1, -1)  # the whole own block
    mask = torch.cat([sees_context, sees_block], dim=2)[:, None]
    return tokens.reshape(b, a * block), positions, mask


def base_layers(base) -> int:
    return base.config.num_hidden_layers


def draft_config(base_config, layers: int, block: int, mask_id: int, target_layer_ids):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=base_config.vocab_size,
        hidden_size=base_config.hidden_size,
        intermediate_size=base_config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=base_config.num_attention_heads,
        num_key_value_heads=base_config.num_key_value_heads,
        head_dim=base_config.head_dim,
        max_position_embeddings=base_config.max_position_embeddings,
        max_window_layers=layers,
        rope_parameters=dict(base_config.rope_parameters),
        rms_norm_eps=base_config.rms_norm_eps,
        tie_word_embeddings=False,
        num_target_layers=base_config.num_hidden_layers,
        dflash_config={"target_layer_ids": list(target_layer_ids), "block_size": block, "mask_token_id": mask_id},
        architectures=["DFlashDraftModel"],
    )


def init_from_base(draft: Draft, base) -> None:
    """Start the draft's layers from the base's top layers and fc from 'take the deepest tap':
    the first drafted row then begins as the base's own next-token guess from the anchor."""
    n = len(draft.layers)
    src = base.model.layers[-n:]
    with torch.no_grad():
        for mine, theirs in zip(draft.layers, src):
            for name, p in mine.named_parameters():
                p.copy_(theirs.get_parameter(name))
        draft.norm.weight.copy_(base.model.norm.weight)
        d = draft.config.hidden_size
        draft.fc.weight.normal_(0.0, 0.02 / math.sqrt(draft.fc.weight.shape[1] / d))
        draft.fc.weight[:, -d:] += torch.eye(d)


# ---------------------------------------------------------------- the base's own continuations


class BaseRunner:
    """The frozen base run by hand from its own modules, so that extra tokens can see a chosen
    prefix of a window: what the greedy chain of every anchor needs in one pass per step."""

    def __init__(self, base):
        self.base, self.model = base, base.model
        self.head_dim = base.config.head_dim
        self.last = base.config.num_hidden_layers - 1

    def run(self, ids, positions, mask, past=None, taps=()):
        """ids, positions [b, L]; mask [b, 1, L, keys]; past: per layer (k, v) before these
        -> (logits [b, L, V], per layer (k, v) including these, {layer: its output [b, L, D]})."""
        x = self.model.embed_tokens(ids)
        cos, sin = self.model.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]
        b, n, _ = x.shape
        kvs, outputs = [], {}
        for i, layer in enumerate(self.model.layers):
            at = layer.self_attn
            h = layer.input_layernorm(x)
            q = _rotate(at.q_norm(at.q_proj(h).view(b, n, -1, self.head_dim)).transpose(1, 2), cos, sin)
            k = _rotate(at.k_norm(at.k_proj(h).view(b, n, -1, self.head_dim)).transpose(1, 2), cos, sin)
            v = at.v_proj(h).view(b, n, -1, self.head_dim).transpose(1, 2)
            if past is not None:
                k, v = torch.cat([past[i][0], k], dim=2), torch.cat([past[i][1], v], dim=2)
            kvs.append((k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
            x = x + at.o_proj(out.transpose(1, 2).reshape(b, n, -1))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if i in taps:
                # transformers' hidden_states[L] (the reference's tap of the last layer) is normed
                outputs[i] = self.model.norm(x) if i == self.last else x
        return self.base.lm_head(self.model.norm(x)), kvs, outputs

    @torch.no_grad()
    def window_and_chains(self, rows, anchors, block: int, tap_ids):
        """One pass over the windows rows [b, T], then the base's greedy continuation of every
        anchor: returns taps [b, T, F] and the base's log-distributions [b, A, block - 1, V] for
        positions a+1 .. a+block-1, each given the window up to a and the base's own choices
        after it (what a draft of that block must match to be accepted)."""
        b, t = rows.shape
        a = anchors.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        logits, kvs, outputs = self.run(rows, torch.arange(t).expand(b, t), causal, taps=set(tap_ids))
        taps = torch.cat([outputs[i] for i in tap_ids], dim=-1)
        first = logits.gather(1, anchors[..., None].expand(-1, -1, logits.shape[-1]))  # row a predicts a+1
        steps = [F.log_softmax(first.float(), dim=-1)]
        sees_window = torch.arange(t)[None, None, :] <= anchors[..., None]  # [b, A, T]: the prefix x[..a]
        past = kvs
        for j in range(1, block - 1):
            chosen = steps[-1].argmax(-1)  # the base's token at position a + j
            entries = torch.arange(a * j)  # chain entries so far, step-major: (step, anchor)
            sees_chain = (entries[None, :] % a == torch.arange(a)[:, None]).expand(b, -1, -1)
            mask = torch.cat([sees_window, sees_chain], dim=2)[:, None]
            logits, past, _ = self.run(chosen, anchors + j, mask, past)
            steps.append(F.log_softmax(logits.float(), dim=-1))
        return taps, torch.stack(steps, dim=2)


# ---------------------------------------------------------------- training


def stage_train(args) -> None:
    from npud.engine.dflash import build_target_layer_ids
    from npud.engine.weights import checkpoint_fingerprint

    work = args.work_dir
    if not (work / "train.npy").exists():
        sys.exit(f"error: no tokenized corpus in {work}; run tools/train_pair.py --stage tokenizer first")
    base_dir = args.models_dir / "pycode-base"
    if not (base_dir / "config.json").exists():
        sys.exit(f"error: the draft reads the base's taps, and {base_dir} does not exist")
    data = np.load(work / "train.npy")
    fingerprint = checkpoint_fingerprint(base_dir)  # a draft is trained on one base's taps
    base = train_pair.load_model(base_dir)
    for p in base.parameters():
        p.requires_grad_(False)
    from transformers import AutoTokenizer

    mask_id = AutoTokenizer.from_pretrained(base_dir).convert_tokens_to_ids(MASK_TOKEN)
    ids = tuple(args.target_layers) if args.target_layers else build_target_layer_ids(base_layers(base), args.layers)
    config = draft_config(base.config, args.layers, args.block, mask_id, ids)
    torch.manual_seed(args.seed)
    draft = Draft(config, len(ids))
    init_from_base(draft, base)
    if args.init_from is not None and not (work / "dflash.state.pt").exists():
        # a short redistillation: the layers of a drafter trained on an earlier base (its
        # weights do not depend on the vocabulary: the base's embedding and head are read)
        from safetensors.torch import load_file

        earlier = load_file(str(args.init_from / "model.safetensors"))
        draft.load_state_dict({k: v.float() for k, v in earlier.items()})
        log(f"dflash: starting from {args.init_from}")
    runner = BaseRunner(base)
    check_runner(runner, base, data, ids)
    embed = base.model.embed_tokens.weight  # frozen; tied with the base's LM head
    head = base.get_output_embeddings().weight
    opt = torch.optim.AdamW([p for p in draft.parameters()], lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    weights = torch.exp(-torch.arange(args.block - 1, dtype=torch.float32) / args.gamma)  # row j=1.. of a block

    state_path = work / "dflash.state.pt"
    step, elapsed_before, history = 0, 0.0, []
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        if state["steps"] != args.steps:
            sys.exit(f"error: {state_path} was trained with --steps {state['steps']}, not {args.steps}")
        if state.get("base_fingerprint") != fingerprint:
            sys.exit(f"error: {state_path} was trained on another {base_dir.name}; remove it to start over")
        draft.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed_before, history = state["step"], state["elapsed"], state["history"]
        log(f"dflash: resumed at step {step} ({elapsed_before:.0f}s)")
    log(f"dflash: {sum(p.numel() for p in draft.parameters())} parameters, taps {list(ids)} of "
        f"{base_layers(base)} base layers, block {args.block}, mask token {mask_id}")

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": draft.state_dict(), "optimizer": opt.state_dict(), "step": step, "steps": args.steps,
                    "elapsed": elapsed_before + time.monotonic() - t0, "history": history,
                    "base_fingerprint": fingerprint}, tmp)
        os.replace(tmp, state_path)

    t0 = time.monotonic()
    window = {"loss": 0.0, "top1": 0.0, "first": 0.0, "n": 0, "t": t0}
    draft.train()
    while step < args.steps:
        if train_pair.out_of_budget("dflash", step, t0, args):
            break
        for group in opt.param_groups:
            group["lr"] = train_pair.lr_at(step, args)
        rows = train_pair.batch_at(data, args.seed, step, args.batch, args.seq_len)[:, :-1]  # [b, T]
        anchors = anchors_at(args, step, rows.shape[1])
        taps, target_logp = runner.window_and_chains(rows, anchors, args.block, ids)  # [b, A, block - 1, V]
        tokens, positions, mask = block_inputs(rows, anchors, args.block, mask_id)
        hidden = draft(taps, F.embedding(tokens, embed), positions, mask)  # [b, A * block, D]
        b, a = anchors.shape
        drafted = hidden.view(b, a, args.block, -1)[:, :, 1:]  # rows for positions a+1 .. a+block-1
        logits = drafted @ head.T  # [b, A, block - 1, V]
        logp = F.log_softmax(logits, dim=-1)
        kl = (target_logp.exp() * (target_logp - logp)).sum(-1)  # KL(base || draft) per row
        ce = -logp.gather(-1, target_logp.argmax(-1, keepdim=True))[..., 0]  # the base's greedy token
        per_row = args.distill * kl + (1 - args.distill) * ce
        loss = (per_row * weights).sum(-1).mean() / weights.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        step += 1
        with torch.no_grad():
            agree = (logits.argmax(-1) == target_logp.argmax(-1)).float()
            window["loss"] += loss.item()
            window["top1"] += agree.mean().item()
            window["first"] += agree[..., 0].mean().item()
            window["n"] += 1
        if step % args.log_every == 0 or step == args.steps:
            now = time.monotonic()
            n = window["n"]
            entry = {"step": step, "loss": round(window["loss"] / n, 4), "agree": round(window["top1"] / n, 4),
                     "agree_first": round(window["first"] / n, 4), "s_per_step": round((now - window["t"]) / n, 2),
                     "elapsed": round(elapsed_before + now - t0)}
            history.append(entry)
            log("dflash " + " ".join(f"{k} {v}" for k, v in entry.items()))
            window = {"loss": 0.0, "top1": 0.0, "first": 0.0, "n": 0, "t": now}
        if step % args.save_every == 0:
            save_state()
    save_state()
    draft.eval()
    if checkpoint_fingerprint(base_dir) != fingerprint:
        sys.exit(f"error: {base_dir} changed while the draft trained on it; train again (the state is kept)")
    out_dir = args.models_dir / OUT_NAME
    staging = args.models_dir / f".{OUT_NAME}.new"
    export(draft, staging)
    check_export(draft, base, staging, data, args, ids)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)
    elapsed = elapsed_before + time.monotonic() - t0
    summary = {
        "parameters": sum(p.numel() for p in draft.parameters()), "steps": step, "planned_steps": args.steps,
        "train_seconds": round(elapsed, 1), "threads": args.threads, "seed": args.seed, "batch": args.batch,
        "seq_len": args.seq_len, "anchors": args.anchors, "block": args.block, "lr": args.lr,
        "gamma": args.gamma, "distill": args.distill, "target_layer_ids": list(ids),
        "windows_seen": step * args.batch, "blocks_seen": step * args.batch * args.anchors,
        "last_log": history[-1] if history else None,
        # a draft is trained on one base's taps: a retrained base needs a retrained draft
        "base_fingerprint": fingerprint,
        "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
    }
    (out_dir / "training.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "training.json").chmod(0o644)
    log(f"dflash: exported {out_dir} after {step} steps, {elapsed:.0f}s")


@torch.no_grad()
def check_runner(runner: BaseRunner, base, data: np.ndarray, ids) -> None:
    """The hand-run base gives transformers' logits and hidden states, and a chain step gives
    what running the chosen token after the prefix gives."""
    rows = torch.from_numpy(data[:64].astype(np.int64))[None]
    out = base(input_ids=rows, output_hidden_states=True)
    taps, chains = runner.window_and_chains(rows, torch.tensor([[20, 40]]), 3, ids)
    want_taps = torch.cat([out.hidden_states[i + 1] for i in ids], dim=-1)
    first = out.logits[0, [20, 40]].softmax(-1)
    errors = [float((taps - want_taps).abs().max()), float((chains[0, :, 0].exp() - first).abs().max())]
    for anchor, chain in ((20, chains[0, 0]), (40, chains[0, 1])):
        prefix = torch.cat([rows[:, : anchor + 1], chain[0].argmax()[None, None]], dim=1)
        errors.append(float((chain[1].exp() - base(input_ids=prefix).logits[0, -1].softmax(-1)).abs().max()))
    log(f"dflash: hand-run base vs transformers: max differences {', '.join(f'{e:.1e}' for e in errors)}")
    if max(errors) > 1e-3:
        sys.exit("error: the hand-run base disagrees with transformers")


def anchors_at(args, step: int, seq_len: int) -> torch.Tensor:
    """Anchors [batch, anchors] of a step, distinct per window, each with a full block after it."""
    rng = np.random.default_rng([args.seed, step, 1])
    picks = [np.sort(rng.choice(np.arange(1, seq_len - args.block + 1), size=args.anchors, replace=False))
             for _ in range(args.batch)]
    return torch.from_numpy(np.stack(picks).astype(np.int64))


def export(draft: Draft, out: pathlib.Path) -> None:
    """The published layout: config.json (a Qwen3 config with dflash_config) and bf16 safetensors."""
    from safetensors.torch import save_file

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    config = draft.config
    config.dtype = torch.bfloat16
    config.save_pretrained(out)
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in draft.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for path in out.iterdir():
        path.chmod(0o644)


@torch.no_grad()
def check_export(draft: Draft, base, out: pathlib.Path, data: np.ndarray, args, ids) -> None:
    """The shipped checkpoint through npud/engine/dflash/ drafts what the training module drafts
    with the same (bf16-rounded) weights: the two implementations agree on the architecture."""
    from npud.engine.dflash import DFlashDraft, TapRows
    from npud.engine.forward import Forward
    from npud.engine.model import Model

    rounded = Draft(draft.config, len(ids))
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in draft.state_dict().items()})
    rounded.eval()
    model = Model.load(args.models_dir / "pycode-base", "fp32")
    engine_draft = DFlashDraft.load(out, model, "fp32")
    window = torch.from_numpy(data[:97].astype(np.int64))[None]  # 96 context tokens, then the anchor
    forward = Forward(model)
    sink = TapRows(engine_draft.tap_width)
    forward.set_layer_taps(ids, sink)
    forward.prefill(window[0, :96].tolist())
    ours = engine_draft.hidden_from_scratch(sink.rows(), int(window[0, 96]), args.block - 1)
    hidden_states = base(input_ids=window, output_hidden_states=True).hidden_states
    taps = torch.cat([hidden_states[i + 1] for i in ids], dim=-1)  # the anchor's own row is masked out
    tokens, positions, mask = block_inputs(window, torch.tensor([[96]]), args.block, engine_draft.config.mask_token_id)
    theirs = rounded(taps, F.embedding(tokens, base.model.embed_tokens.weight), positions, mask)[0, 1:].numpy()
    err = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    log(f"dflash: engine vs training module on the shipped weights: max relative difference {err:.2e}")
    if err > 1e-3:
        sys.exit(f"error: npud/engine/dflash/ and the training module disagree (relative difference {err:.2e})")


# ---------------------------------------------------------------- evaluation through the engine's loop


def eval_prompts(tokenizer, per_task: int, seed: int) -> dict[str, list[list[int]]]:
    """Prompts from the held-out stdlib files (train_pair's validation split), three tasks:

    completion  ~700 characters of a file, cut at a line end: continue the code
    edit        a function, then its first lines again with one name changed: repeat the rest
    docstring   code up to the first sentence of a long docstring: continue the prose
    """
    import re

    _, val = train_pair.read_split()
    rng = np.random.default_rng(seed)
    tasks: dict[str, list[list[int]]] = {"completion": [], "edit": [], "docstring": []}
    for rel, text in sorted(val, key=lambda f: rng.random()):
        lines = text.splitlines(keepends=True)
        if len(tasks["completion"]) < per_task and len(text) > 3000:
            start = int(rng.integers(0, len(lines) // 2))
            chunk = "".join(lines[start:])[:700]
            tasks["completion"].append(tokenizer.encode(chunk[: chunk.rfind("\n") + 1]))
        methods = re.finditer(r"^    def (\w+)\(.*?(?=^    def |\Z)", text, re.M | re.S)
        funcs = [m for m in methods if 250 < len(m.group(0)) < 900]
        if len(tasks["edit"]) < per_task and funcs:
            m = funcs[int(rng.integers(0, len(funcs)))]
            name, body = m.group(1), m.group(0).rstrip() + "\n"
            renamed = body.replace(f"def {name}(", f"def {name}_v2(", 1)
            head = "".join(renamed.splitlines(keepends=True)[:2])
            tasks["edit"].append(tokenizer.encode(body + "\n" + head))
        docs = [m for m in re.finditer(r'"""([A-Z][^"]{400,})"""', text)]
        if len(tasks["docstring"]) < per_task and docs:
            m = docs[0]
            first = m.group(1).find(". ")
            if first > 0:
                cut = m.start(1) + first + 2
                tasks["docstring"].append(tokenizer.encode(text[max(0, cut - 600) : cut]))
        if all(len(v) >= per_task for v in tasks.values()):
            break
    return tasks


def stage_eval(args) -> None:
    from npud.engine.dflash import DFlashDraft, DFlashHead
    from npud.engine.drafters import DraftModelHead, PromptLookupHead
    from npud.engine.forward import Forward
    from npud.engine.model import Model
    from npud.engine.sampling import Sampler
    from npud.engine.api import SpecParams
    from npud.engine.speculative import DecodeStats, plain_decode, speculative_decode
    from npud.engine.tokenizer import Tokenizer
    from npud.engine.weights import checkpoint_fingerprint

    base_dir, draft_dir = args.models_dir / "pycode-base", args.models_dir / "pycode-draft"
    model = Model.load(base_dir, args.weight_format)
    tokenizer = Tokenizer.from_dir(base_dir)
    small = Model.load(draft_dir, args.weight_format) if draft_dir.exists() else None
    dflash = DFlashDraft.load(args.models_dir / OUT_NAME, model)
    record = json.loads((args.models_dir / OUT_NAME / "training.json").read_text())
    # also_serves: later bases whose taps and head on the corpus are the trained-on one's (each with why)
    served = {record.get("base_fingerprint")} | {b["base_fingerprint"] for b in record.get("also_serves", ())}
    if checkpoint_fingerprint(base_dir) not in served:
        sys.exit(f"error: {OUT_NAME} was trained on another pycode-base; train it again for this one")
    # acceptance as it is: k drafts every round, no break-even fallback
    config = SpecParams(k=args.k, adapt_k=False, fallback_rounds=0)

    def make_head(name, forward):
        if name == "prompt_lookup":
            return PromptLookupHead()
        if name == "draft_model":
            return DraftModelHead(Forward(small), tokenizer, Tokenizer.from_dir(draft_dir))
        head = DFlashHead(dflash)
        head.attach(forward)  # before the prompt runs: the sink needs every position's row
        return head

    def run(prompt, name=None):
        forward = Forward(model)
        head = None if name is None else make_head(name, forward)
        forward.prefill(prompt[:-1])
        out, stats = [], DecodeStats()
        common = dict(max_new_tokens=args.tokens, sampler=Sampler(), on_token=out.append, stats=stats)
        loop = (plain_decode(forward, prompt, **common) if head is None
                else speculative_decode(forward, head, prompt, config=config, **common))
        for _ in loop:
            pass
        return out, stats

    tasks = eval_prompts(tokenizer, args.prompts, args.seed)
    methods = ["prompt_lookup"] + (["draft_model"] if small is not None else []) + ["dflash"]
    result = {"tokens": args.tokens, "k": args.k, "weight_format": args.weight_format, "tasks": {}}
    for task, prompts in tasks.items():
        totals = {m: {"emitted": 0, "rounds": 0, "drafted": 0, "accepted": 0, "passes": 0, "seconds": 0.0}
                  for m in ["plain"] + methods}
        for prompt in prompts:
            plain, stats = run(prompt)
            _add(totals["plain"], stats)
            for m in methods:
                out, stats = run(prompt, m)
                if out != plain:
                    sys.exit(f"error: {m} on {task} differs from plain greedy")
                _add(totals[m], stats)
        plain_tps = totals["plain"]["emitted"] / totals["plain"]["seconds"]
        rows = {}
        for m in methods:
            t = totals[m]
            rows[m] = {
                "acceptance_rate": round(t["accepted"] / max(t["drafted"], 1), 3),
                "tokens_per_round": round((t["accepted"] + t["rounds"]) / max(t["rounds"], 1), 2),
                "passes_per_token": round(t["passes"] / t["emitted"], 3),
                "tokens_per_second": round(t["emitted"] / t["seconds"], 1),
                "speedup": round(t["emitted"] / t["seconds"] / plain_tps, 2),
            }
        rows["plain"] = {"tokens_per_second": round(plain_tps, 1), "passes_per_token": 1.0}
        result["tasks"][task] = {"prompts": len(prompts), "methods": rows}
        log(f"{task} ({len(prompts)} prompts x {args.tokens} tokens):")
        for m, row in rows.items():
            log(f"  {m:14s} " + " ".join(f"{k} {v}" for k, v in row.items()))
    path = args.work_dir / "dflash_eval.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    log(f"wrote {path}")


def _add(total: dict, stats) -> None:
    total["emitted"] += stats.emitted
    total["rounds"] += stats.rounds
    total["drafted"] += stats.drafted
    total["accepted"] += stats.accepted
    total["passes"] += stats.base_passes
    total["seconds"] += stats.seconds


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stage", required=True, choices=["train", "eval"])
    p.add_argument("--work-dir", type=pathlib.Path, default=pathlib.Path("/tmp/npud-train"))
    p.add_argument("--models-dir", type=pathlib.Path, default=train_pair.MODELS_DIR)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--minutes", type=float, default=None, help="wall-clock stop for this invocation")
    p.add_argument("--steps", type=int, default=1000, help="planned steps; fixes the lr schedule")
    p.add_argument("--batch", type=int, default=4, help="corpus windows per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--anchors", type=int, default=24, help="blocks drafted per window")
    p.add_argument("--block", type=int, default=8, help="block size: the last token and block - 1 drafts")
    p.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    p.add_argument("--target-layers", type=int, nargs="*", default=None,
                   help="base layers to tap (default: the reference's spread for --layers)")
    p.add_argument("--init-from", type=pathlib.Path, default=None,
                   help="train: start from this drafter's weights (a redistillation against a changed base)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--gamma", type=float, default=4.0, help="loss weight exp(-(j-1)/gamma) of block row j")
    p.add_argument("--distill", type=float, default=0.8,
                   help="weight of KL to the base; the rest is CE on the base's greedy token")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--prompts", type=int, default=6, help="eval: prompts per task")
    p.add_argument("--tokens", type=int, default=64, help="eval: tokens generated per prompt")
    p.add_argument("--k", type=int, default=7, help="eval: drafts per round")
    p.add_argument("--weight-format", default="bf16", help="eval: weight format of the served models")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.stage == "train":
        stage_train(args)
    else:
        stage_eval(args)


if __name__ == "__main__":
    main()
