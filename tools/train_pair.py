"""Train the bundled model pair (npud/models/pycode-base and pycode-draft) on the CPU.

No model hub is reachable from our machines, so npud ships a small base model and a
speculative draft for it, trained here on the Python standard library of the interpreter
that runs this script. Both are transformers ``Qwen3ForCausalLM`` checkpoints, so they load
through the same code path as real Qwen3 checkpoints.

Stages, each resumable, each reading what the previous one left in ``--work-dir``:

    tokenizer  byte-level BPE on the training split -> work/tokenizer, work/train.npy, work/val.npy
    base       next-token training of the base        -> npud/models/pycode-base
    draft      distillation of the base into a 2-layer draft -> npud/models/pycode-draft
    eval       held-out loss of both, draft/base greedy agreement -> work/eval.json
    fim        continued training of the base with Qwen2.5-Coder's FIM tokens added, on half
               plain windows and half fill-in-the-middle examples -> npud/models/pycode-base
    fim-draft  redistillation of the draft against that base (same vocabulary) -> pycode-draft
    fim-eval   eval, plus FIM on held-out files: middle loss, exact match, valid syntax
    chat       continued training of the FIM base on plain, FIM and chat rows -> pycode-base
    chat-draft redistillation of the draft against that base on the same batches -> pycode-draft
    chat-eval  fim-eval, plus held-out chat: reply loss, whether greedy replies end their turn

The fim stages live in tools/pair_fim.py (its docstring has the example format), the chat
stages in tools/pair_chat.py (its docstring has the conversations' format); after them,
`tools/train_dflash.py --stage train --init-from <the old pycode-dflash>` redistils the DFlash
drafter against the new base.

The learning-rate schedule is a function of ``--steps`` alone, and batches are drawn from a
generator seeded with ``(seed, step)``, so a run resumed from a checkpoint is the run that
was never interrupted. ``--minutes`` is a wall-clock stop: the stage checkpoints and exports
what it has; running the same command again continues it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import shutil
import sys
import sysconfig
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

REPO = pathlib.Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "npud" / "models"

EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]

# ChatML, the same shape Qwen checkpoints ship; the bundled models never saw chat data,
# but the daemon's chat path must have a template to render.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Directory names inside the stdlib that hold tests or bundled third-party code.
SKIPPED_PARTS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
VAL_PERCENT = 5


@dataclass(slots=True, frozen=True)
class Arch:
    num_hidden_layers: int
    hidden_size: int = 256
    intermediate_size: int = 768
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64


ARCHS = {"base": Arch(num_hidden_layers=6), "draft": Arch(num_hidden_layers=2)}


def log(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- corpus and tokenizer


def stdlib_files() -> list[tuple[str, pathlib.Path]]:
    """Return (relative path, path) of every stdlib .py file outside test dirs, sorted."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if SKIPPED_PARTS & set(rel.parts[:-1]):
            continue
        found.append((rel.as_posix(), path))
    found.sort()
    return found


def is_validation(rel: str) -> bool:
    """A file is held out when the sha1 of its relative path falls in the first VAL_PERCENT."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < VAL_PERCENT


def read_split() -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    train, val = [], []
    for rel, path in stdlib_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a handful of stdlib files carry latin-1 test data
        (val if is_validation(rel) else train).append((rel, text))
    return train, val


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer_files(tok, out: pathlib.Path) -> None:
    """Write tokenizer.json and a tokenizer_config.json that carries the chat template."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        # PreTrainedTokenizerFast: the class name every transformers version maps to tokenizer.json
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def encode_files(tok, files: list[tuple[str, str]], eos_id: int) -> np.ndarray:
    """Concatenate the files' tokens, each followed by EOS, as one uint16 stream."""
    out = []
    for enc in tok.encode_batch([text for _, text in files]):
        out.extend(enc.ids)
        out.append(eos_id)
    return np.asarray(out, dtype=np.uint16)


def stage_tokenizer(args) -> None:
    work = args.work_dir
    tok_dir = work / "tokenizer"
    if (work / "val.npy").exists():
        log(f"tokenizer: already built in {tok_dir}")
        return
    train, val = read_split()
    log(f"corpus: {len(train)} train files ({sum(len(t) for _, t in train)} chars), "
        f"{len(val)} validation files ({sum(len(t) for _, t in val)} chars)")
    t0 = time.monotonic()
    tok = build_tokenizer([text for _, text in train], args.vocab_size)
    eos_id = tok.token_to_id(EOS)
    save_tokenizer_files(tok, tok_dir)
    train_ids = encode_files(tok, train, eos_id)
    val_ids = encode_files(tok, val, eos_id)
    np.save(work / "train.npy", train_ids)
    np.save(work / "val.npy", val_ids)
    (work / "val_files.txt").write_text("".join(rel + "\n" for rel, _ in val))
    log(f"tokenizer: vocab {tok.get_vocab_size()}, {len(train_ids)} train tokens, "
        f"{len(val_ids)} validation tokens, {time.monotonic() - t0:.1f}s")


# ---------------------------------------------------------------- models


def make_config(arch: Arch, vocab_size: int, eos_id: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_hidden_layers,
        num_attention_heads=arch.num_attention_heads,
        num_key_value_heads=arch.num_key_value_heads,
        head_dim=arch.head_dim,
        max_position_embeddings=2048,
        max_window_layers=arch.num_hidden_layers,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        attention_dropout=0.0,
        use_cache=True,
    )


def load_model(path: pathlib.Path):
    from transformers import Qwen3ForCausalLM

    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return model


def count_params(model) -> int:
    # Tied embeddings are one tensor; parameters() yields it once.
    return sum(p.numel() for p in model.parameters())


def export(model, tok_dir: pathlib.Path, out: pathlib.Path) -> None:
    """Save the model in bf16 with the tokenizer files and a generation config."""
    from transformers import GenerationConfig

    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model.config.dtype = torch.bfloat16
    model.to(torch.bfloat16).save_pretrained(out)
    model.to(torch.float32)
    eos_id = model.config.eos_token_id
    generation = GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    generation.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tok_dir / name, out / name)
    for path in out.iterdir():
        path.chmod(0o644)  # safetensors writes 0600; the daemon runs as its own user


# ---------------------------------------------------------------- training


def batch_at(data: np.ndarray, seed: int, step: int, batch: int, seq_len: int) -> torch.Tensor:
    """The batch of a step: random windows of seq_len + 1 tokens, drawn from (seed, step)."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    rows = np.stack([data[s : s + seq_len + 1] for s in starts]).astype(np.int64)
    return torch.from_numpy(rows)


def out_of_budget(which: str, step: int, t0: float, args) -> bool:
    """Whether a training loop stops before `step`: its wall-clock budget (--minutes, from t0)
    spent or the step --stop-at names reached; says which."""
    if args.minutes is not None and time.monotonic() - t0 > args.minutes * 60:
        log(f"{which}: wall-clock budget of {args.minutes} min reached at step {step}")
        return True
    if getattr(args, "stop_at", None) is not None and step >= args.stop_at:
        log(f"{which}: stopping at step {step} as asked (--stop-at)")
        return True
    return False


def make_optimizer(model, lr: float):
    """AdamW with weight decay on matrices only, not on norm gains."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def lr_at(step: int, args) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak at --steps."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.steps - args.warmup))
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def stage_train(args, which: str) -> None:
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    work = args.work_dir
    tok_dir = work / "tokenizer"
    if not (work / "train.npy").exists():
        sys.exit("error: no tokenized corpus in --work-dir; run --stage tokenizer first")
    data = np.load(work / "train.npy")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    state_path = work / f"{which}.state.pt"
    out_dir = args.models_dir / f"pycode-{which}"

    torch.manual_seed(args.seed)
    model = Qwen3ForCausalLM(make_config(ARCHS[which], len(tok), tok.eos_token_id))
    teacher = None
    if which == "draft":
        base_dir = args.models_dir / "pycode-base"
        if not base_dir.exists():
            sys.exit(f"error: the draft distils the base, and {base_dir} does not exist")
        teacher = load_model(base_dir)
        for p in teacher.parameters():
            p.requires_grad_(False)
        # Share the base's token space: start from its embedding (tied with the head)
        # and final norm, so the draft's logits begin on the base's scale.
        with torch.no_grad():
            model.model.embed_tokens.weight.copy_(teacher.model.embed_tokens.weight)
            model.model.norm.weight.copy_(teacher.model.norm.weight)

    opt = make_optimizer(model, args.lr)

    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed"]
        if state["steps"] != args.steps:
            sys.exit(f"error: {state_path} was trained with --steps {state['steps']}, "
                     f"not {args.steps}; pass the same value or remove the state")
        log(f"{which}: resumed at step {step} ({tokens_seen} tokens, {elapsed_before:.0f}s)")
    log(f"{which}: {count_params(model)} parameters, {len(data)} training tokens available")

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({
            "model": model.state_dict(), "optimizer": opt.state_dict(), "step": step,
            "tokens": tokens_seen, "elapsed": elapsed_before + time.monotonic() - t0,
            "steps": args.steps,
        }, tmp)
        os.replace(tmp, state_path)

    model.train()
    t0 = time.monotonic()
    window_t, window_tokens, window_loss, window_steps = t0, 0, 0.0, 0
    while step < args.steps:
        if out_of_budget(which, step, t0, args):
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        rows = batch_at(data, args.seed, step, args.batch, args.seq_len)
        inputs, targets = rows[:, :-1], rows[:, 1:]
        logits = model(input_ids=inputs).logits.float()
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        if teacher is not None:
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
            # KL(base || draft) per position: the draft learns the base's whole distribution,
            # which is what speculative acceptance rewards.
            kl = F.kl_div(F.log_softmax(logits, dim=-1), teacher_logp, log_target=True,
                          reduction="none").sum(-1).mean()
            loss = args.distill * kl + (1.0 - args.distill) * ce
        else:
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += inputs.numel()
        window_tokens += inputs.numel()
        window_loss += ce.item()
        window_steps += 1
        if step % args.log_every == 0 or step == args.steps:
            now = time.monotonic()
            log(f"{which} step {step}/{args.steps} tokens {tokens_seen} "
                f"ce {window_loss / window_steps:.4f} lr {lr_at(step - 1, args):.2e} "
                f"tok/s {window_tokens / (now - window_t):.0f} "
                f"elapsed {elapsed_before + now - t0:.0f}s")
            window_t, window_tokens, window_loss, window_steps = now, 0, 0.0, 0
        if step % args.save_every == 0:
            save_state()
    save_state()
    model.eval()
    export(model, tok_dir, out_dir)
    elapsed = elapsed_before + time.monotonic() - t0
    summary = {
        "parameters": count_params(model), "steps": step, "planned_steps": args.steps,
        "tokens": tokens_seen, "train_seconds": round(elapsed, 1), "threads": args.threads,
        "seed": args.seed, "batch": args.batch, "seq_len": args.seq_len, "lr": args.lr,
        "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
    }
    (work / f"{which}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"{which}: exported {out_dir} after {step} steps, {tokens_seen} tokens, {elapsed:.0f}s")


# ---------------------------------------------------------------- evaluation


@torch.no_grad()
def stage_eval(args) -> None:
    """Held-out loss of the shipped (bf16) checkpoints and teacher-forced greedy agreement."""
    work = args.work_dir
    val = np.load(work / "val.npy")
    base = load_model(args.models_dir / "pycode-base")
    draft = load_model(args.models_dir / "pycode-draft")
    n_windows = (len(val) - 1) // args.seq_len
    if args.eval_windows is not None:
        n_windows = min(n_windows, args.eval_windows)
    totals = {"base": 0.0, "draft": 0.0}
    agree, positions = 0, 0
    for i in range(n_windows):
        rows = torch.from_numpy(val[i * args.seq_len : (i + 1) * args.seq_len + 1].astype(np.int64))
        inputs, targets = rows[None, :-1], rows[1:]
        logits = {}
        for name, model in (("base", base), ("draft", draft)):
            logits[name] = model(input_ids=inputs).logits[0].float()
            totals[name] += F.cross_entropy(logits[name], targets, reduction="sum").item()
        agree += (logits["base"].argmax(-1) == logits["draft"].argmax(-1)).sum().item()
        positions += targets.numel()
    result = {"validation_tokens": positions, "windows": n_windows, "seq_len": args.seq_len}
    for name in ("base", "draft"):
        loss = totals[name] / positions
        result[name] = {"val_loss": round(loss, 4), "val_ppl": round(math.exp(loss), 2),
                        "parameters": count_params(base if name == "base" else draft)}
    result["greedy_agreement"] = round(agree / positions, 4)
    (work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    log(json.dumps(result, indent=2))


# ---------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--stage", required=True, choices=["tokenizer", "base", "draft", "eval", "fim", "fim-draft", "fim-eval",
                                                     "chat", "chat-draft", "chat-eval"])
    p.add_argument("--work-dir", type=pathlib.Path, default=pathlib.Path("/tmp/npud-train"))
    p.add_argument("--models-dir", type=pathlib.Path, default=MODELS_DIR,
                   help="where pycode-base/ and pycode-draft/ are written (default: npud/models)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--minutes", type=float, default=None,
                   help="wall-clock stop for this invocation")
    p.add_argument("--steps", type=int, default=1000, help="planned steps; fixes the lr schedule")
    p.add_argument("--stop-at", type=int, default=None,
                   help="checkpoint and export at this step; the same command resumes from it")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--distill", type=float, default=0.8,
                   help="draft only: weight of KL to the base; the rest is next-token CE")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--fim-rate", type=float, default=0.5,
                   help="fim stages: the share of each batch that is FIM examples")
    p.add_argument("--fim-indent-rate", type=float, default=0.0,
                   help="fim/chat stages: how often a body or lines middle starts after its first line's "
                        "indentation, as llama.vim's requests do (pair_fim.pick_middle; default 0)")
    p.add_argument("--chat-rate", type=float, default=0.375,
                   help="chat stages: the share of each batch that is conversations")
    p.add_argument("--keep-from", type=pathlib.Path, default=None,
                   help="chat stage: train the plain and FIM rows on KL to this checkpoint (the shipped FIM "
                        "base) instead of cross-entropy, so its completions and middles stay as they were "
                        "while the chat rows teach chat")
    p.add_argument("--markup-only", action="store_true",
                   help="chat stage: train only the embedding row of <|im_start|>, replies ending with "
                        "<|endoftext|> (pair_fim.markup_only): plain and FIM outputs keep every other logit")
    p.add_argument("--chat-eval-examples", type=int, default=100, help="chat-eval: held-out conversations")
    p.add_argument("--chat-greedy-examples", type=int, default=40,
                   help="chat-eval: of those, how many the base answers greedily")
    p.add_argument("--fim-eval-examples", type=int, default=100,
                   help="fim-eval: held-out examples of each kind (function body, lines)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--eval-windows", type=int, default=None,
                   help="evaluate on at most this many windows (default: the whole split)")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq_len", "warmup", "threads", "log_every", "save_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if not 0.0 <= args.fim_rate <= 1.0:
        p.error(f"--fim-rate must be within [0, 1], not {args.fim_rate}")
    if args.stage.startswith("chat") and not 0.0 <= args.chat_rate <= 1.0 - args.fim_rate:
        p.error(f"--chat-rate must be within [0, 1 - --fim-rate], not {args.chat_rate}")
    if not 0.0 <= args.distill <= 1.0:
        p.error(f"--distill must be within [0, 1], not {args.distill}")

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.stage.startswith("chat"):
        import pair_chat
        import pair_fim

        if args.stage == "chat-eval":
            pair_chat.stage_chat_eval(args)
        else:
            pair_fim.stage_fim(args, "draft" if args.stage == "chat-draft" else "base", pair_chat.train_chat(args))
    elif args.stage.startswith("fim"):
        import pair_fim

        if args.stage == "fim-eval":
            pair_fim.stage_fim_eval(args)
        else:
            pair_fim.stage_fim(args, "draft" if args.stage == "fim-draft" else "base")
    elif args.stage == "tokenizer":
        stage_tokenizer(args)
    elif args.stage == "eval":
        stage_eval(args)
    else:
        stage_train(args, args.stage)


if __name__ == "__main__":
    main()
