"""Fill-in-the-middle for the bundled pair: the FIM stages of tools/train_pair.py.

    fim        continued training of pycode-base with the Qwen2.5-Coder FIM tokens added
    fim-draft  redistillation of pycode-draft against the FIM base (same vocabulary)
    fim-eval   held-out plain loss, FIM middle loss / exact match / valid syntax, draft agreement

The tokens are appended after the 4096 of the BPE tokenizer, so every id the corpus had keeps
its meaning: <|fim_prefix|> 4096, <|fim_middle|> 4097, <|fim_suffix|> 4098, <|fim_pad|> 4099,
<|repo_name|> 4100, <|file_sep|> 4101 (Qwen2.5-Coder's names and relative order). Their
embedding rows (tied with the LM head) start at the mean of the old rows.

A batch is half plain next-token windows (train_pair.batch_at, the base's own batches) and
half FIM examples cut from the training files: prefix, suffix and middle are encoded one by
one and joined as ids, in PSM order, exactly as npud/engine/fim.py builds an /infill prompt,
including, for a quarter of them, an `input_extra`-style chunk of the same file after
<|file_sep|>:

    [<|file_sep|> name "\\n" chunk <|file_sep|>] <|fim_prefix|> prefix <|fim_suffix|> suffix
    <|fim_middle|> middle <|endoftext|>

The middle is a function body (35%), one to four whole lines (40%) or a span that starts
mid-line (25%). Examples come from a generator seeded with (seed, step, 1), so a resumed run
is the run that was never interrupted.
"""

from __future__ import annotations

import ast
import json
import math
import os
import pathlib
import re
import shutil
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import train_pair as tp

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"
FIM_PAD, REPO_NAME, FILE_SEP = "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"
FIM_TOKENS = [FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD, REPO_NAME, FILE_SEP]
IGNORE = -100
_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def [^\n]*:[ \t]*(?:#[^\n]*)?\n", re.M)
MAX_MIDDLE_CHARS = 320


# ---------------------------------------------------------------- tokenizer


def build_fim_tokenizer(work: pathlib.Path) -> pathlib.Path:
    """work/tokenizer plus the six FIM tokens -> work/tokenizer-fim (idempotent)."""
    from tokenizers import AddedToken, Tokenizer

    src, out = work / "tokenizer", work / "tokenizer-fim"
    if (out / "tokenizer.json").exists():
        return out
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    if tok.get_vocab_size() != 4096:
        sys.exit(f"error: expected the 4096-entry tokenizer in {src}")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in FIM_TOKENS])
    tp.save_tokenizer_files(tok, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["additional_special_tokens"] = [tp.IM_START, tp.IM_END, *FIM_TOKENS]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


class Fim:
    """Token ids and the encoder the examples are built with."""

    def __init__(self, tok_dir: pathlib.Path):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
        ids = [self.tok.token_to_id(t) for t in FIM_TOKENS]
        if None in ids:
            sys.exit(f"error: {tok_dir} has no FIM tokens")
        self.prefix, self.middle, self.suffix, self.pad, self.repo_name, self.file_sep = ids
        self.eos = self.tok.token_to_id(tp.EOS)
        self.vocab = self.tok.get_vocab_size()
        # what ends a greedy middle: EOS, or a FIM token written where text should be
        self.stops = sorted({self.eos, self.pad, self.file_sep, self.repo_name, self.prefix, self.suffix, self.middle})

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids if text else []


# ---------------------------------------------------------------- examples


def _line_starts(text: str) -> list[int]:
    return [0] + [m.end() for m in re.finditer("\n", text)]


def pick_middle(text: str, rng: np.random.Generator, kind: str, indent_rate: float = 0.0) -> tuple[int, int] | None:
    """(start, end) character offsets of a middle of the given kind, or None; a body or lines
    middle starts after its first line's indentation with probability `indent_rate`."""
    starts = _line_starts(text)
    if kind == "body":
        defs = list(_DEF.finditer(text))
        if not defs:
            return None
        m = defs[int(rng.integers(len(defs)))]
        indent, start = len(m.group(1).expandtabs()), m.end()
        end = start
        for line in re.finditer(r"[^\n]*\n|[^\n]+$", text[start:]):
            body = line.group(0)
            if body.strip() and len(body) - len(body.lstrip()) <= indent:
                break
            end = start + line.end()
        while end > start and text[start:end].endswith("\n\n"):
            end -= 1  # blank lines after the body belong to the suffix
        if end - start == 0:
            return None
        # sometimes the docstring stays in the prefix, as when one writes it first
        doc = re.match(r'[ \t]*(?:"""|\'\'\')[\s\S]*?(?:"""|\'\'\')[^\n]*\n', text[start:end])
        if doc and rng.random() < 0.5 and start + doc.end() < end:
            start += doc.end()
        start = _after_indent(text, start, end, rng, indent_rate)
        return (start, end) if end - start <= MAX_MIDDLE_CHARS else None
    if len(starts) < 3:
        return None
    i = int(rng.integers(len(starts) - 1))
    n = int(rng.integers(1, 5))
    end = starts[min(i + n, len(starts) - 1)]
    start = starts[i]
    if kind == "span":
        line_end = text.find("\n", start)
        line_end = len(text) if line_end < 0 else line_end
        if line_end - start < 2:
            return None
        start += int(rng.integers(1, line_end - start))
        if rng.random() < 0.5:
            end = line_end + 1 if line_end < len(text) else line_end  # the rest of the line
    else:
        start = _after_indent(text, start, end, rng, indent_rate)
    end = min(end, start + MAX_MIDDLE_CHARS)
    return (start, end) if end > start and text[start:end].strip() else None


def _after_indent(text: str, start: int, end: int, rng: np.random.Generator, rate: float) -> int:
    """`start` (a line start), or with probability `rate` the end of that line's indentation: an
    editor's cursor on a new indented line. llama.vim sends the indentation as `prompt`, so the
    prefix ends with it, encoded as one token (a newline and all the spaces) that running text
    never has before a statement (there the last space joins the word: "\n       ", " return").
    Rate 0 draws nothing, so the fim stage's batches are what they were."""
    indent = len(text[start:end]) - len(text[start:end].lstrip(" \t"))
    return start + indent if rate > 0 and 0 < indent < end - start and rng.random() < rate else start


def fim_example(fim: Fim, rel: str, text: str, span: tuple[int, int], rng: np.random.Generator,
                length: int, extra: bool) -> tuple[list[int], int, int]:
    """The ids of one PSM example of at most `length` tokens, and where its middle starts/ends."""
    start, end = span
    middle = fim.encode(text[start:end]) + [fim.eos]
    head: list[int] = []
    if extra:
        starts = _line_starts(text)
        i = int(rng.integers(len(starts)))
        chunk = text[starts[i]: starts[min(i + int(rng.integers(2, 8)), len(starts) - 1)]][:240]
        head = [fim.file_sep, *fim.encode(f"{rel}\n{chunk}"), fim.file_sep]
    budget = length - len(middle) - len(head) - 3
    if budget < 16:
        head, budget = [], length - len(middle) - 3
    if budget < 16:
        return [], 0, 0
    prefix = fim.encode(text[max(0, start - 4 * budget): start])
    suffix = fim.encode(text[end: end + 2 * budget])
    keep_suffix = min(len(suffix), max(budget // 3, budget - len(prefix)))
    keep_prefix = min(len(prefix), budget - keep_suffix)
    ids = [*head, fim.prefix, *prefix[len(prefix) - keep_prefix:], fim.suffix, *suffix[:keep_suffix], fim.middle]
    return ids + middle, len(ids), len(ids) + len(middle)


KINDS = ("body", "lines", "span")
KIND_P = (0.35, 0.40, 0.25)


def fim_rows(fim: Fim, files: list[tuple[str, str]], weights: np.ndarray, seed: int, step: int,
             n: int, length: int, indent_rate: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """n FIM examples as (inputs, targets) of `length` positions; padding has target IGNORE.
    `indent_rate`: see pick_middle."""
    rng = np.random.default_rng([seed, step, 1])
    inputs = np.full((n, length), fim.eos, dtype=np.int64)
    targets = np.full((n, length), IGNORE, dtype=np.int64)
    row = 0
    while row < n:
        rel, text = files[int(rng.choice(len(files), p=weights))]
        span = pick_middle(text, rng, KINDS[int(rng.choice(3, p=KIND_P))], indent_rate)
        if span is None:
            continue
        ids, _, _ = fim_example(fim, rel, text, span, rng, length + 1, bool(rng.random() < 0.25))
        if not ids:
            continue
        ids = np.asarray(ids, dtype=np.int64)
        inputs[row, : len(ids) - 1] = ids[:-1]
        targets[row, : len(ids) - 1] = ids[1:]
        row += 1
    return torch.from_numpy(inputs), torch.from_numpy(targets)


def batch_groups(args, chat) -> list[tuple[str, int]]:
    """The rows of a step's batch, in order: (kind, count) for plain, FIM and (chat stages) chat."""
    n_chat = round(args.batch * args.chat_rate) if chat is not None else 0
    n_fim = round(args.batch * args.fim_rate)
    groups = [("plain", args.batch - n_fim - n_chat), ("fim", n_fim)]
    return groups + [("chat", n_chat)] if chat is not None else groups


def mixed_batch(args, fim: Fim, data, files, weights, step: int, chat=None):
    """The plain windows of the step, its FIM examples, then (chat stages) its conversations
    (tools/pair_chat.py): (inputs, targets)."""
    (_, n_plain), (_, n_fim), *rest = batch_groups(args, chat)
    rows = tp.batch_at(data, args.seed, step, n_plain, args.seq_len)
    f_in, f_tg = fim_rows(fim, files, weights, args.seed, step, n_fim, args.seq_len, args.fim_indent_rate)
    inputs, targets = [rows[:, :-1], f_in], [rows[:, 1:], f_tg]
    if rest:
        c_in, c_tg = chat.rows(args.seed, step, rest[0][1], args.seq_len)
        inputs.append(c_in)
        targets.append(c_tg)
    return torch.cat(inputs), torch.cat(targets)


# ---------------------------------------------------------------- training


def resize_vocab(model, vocab: int, source=None) -> None:
    """Grow the tied embedding to `vocab` rows: the new rows are `source`'s (another model's
    embedding) or the mean of the old rows."""
    old = model.model.embed_tokens.weight.detach().clone()
    model.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        w = model.model.embed_tokens.weight
        w[: old.shape[0]] = old
        w[old.shape[0]:] = source[old.shape[0]: vocab] if source is not None else old.mean(0)
    model.config.vocab_size = vocab
    model.tie_weights()


def keep_loss(kl: torch.Tensor, ce: torch.Tensor, valid: torch.Tensor, n_chat: int) -> torch.Tensor:
    """The chat stage's loss with --keep-from: per position [rows, length], KL to the kept
    checkpoint on every row but the last `n_chat` (the plain and FIM rows, which then keep its
    completions and middles), cross-entropy on those (the chat rows), averaged over the valid
    positions together."""
    rows = kl.shape[0] - n_chat
    return (torch.cat([kl[:rows], ce[rows:]]) * valid).sum() / valid.sum()


class _Restore:
    """Puts back every embedding row but `rows` after an optimizer step (AdamW's weight decay
    moves a row whose gradient is zero)."""

    def __init__(self, weight: torch.Tensor, rows: list[int], trained: torch.Tensor):
        self.weight, self.rows = weight, rows
        self.frozen = trained[:, 0] == 0
        self.saved = weight.detach()[self.frozen].clone()

    def __call__(self) -> None:
        with torch.no_grad():
            self.weight[self.frozen] = self.saved


def markup_only(model, chat) -> _Restore:
    """--markup-only: train nothing but the (tied) embedding row of <|im_start|>, which no plain
    or FIM input holds, and end each reply with <|endoftext|> (npud stops a chat at either). Every
    hidden state of a plain or FIM prompt then stays what it was, bit for bit, and of its logits
    only <|im_start|>'s can move (down: it is never a target): the base's completions and middles
    are kept. (Training <|im_end|>'s row too made it the likeliest token where a FIM middle's line
    ends: its output row is tied.) Returns the call that undoes each step's drift of the other rows."""
    rows = [chat.tok.token_id("<|im_start|>")]
    chat.end = chat.eos
    for p in model.parameters():
        p.requires_grad_(False)
    weight = model.get_input_embeddings().weight
    assert weight is model.get_output_embeddings().weight, "the bundled base ties its embedding"
    weight.requires_grad_(True)
    trained = torch.zeros(weight.shape[0], 1)
    trained[rows] = 1.0
    weight.register_hook(lambda grad: grad * trained)  # so clipping sees only the trained rows
    return _Restore(weight, rows, trained)


def stage_fim(args, which: str, chat=None) -> None:
    """Continued training of the shipped base (which='base') or redistillation of the shipped
    draft against the FIM base (which='draft'), on mixed plain/FIM batches; with `chat` (a
    pair_chat.Chat), the chat stages: chat rows too, continuing the FIM checkpoints."""
    work = args.work_dir
    if not (work / "train.npy").exists():
        sys.exit("error: no tokenized corpus in --work-dir; run --stage tokenizer first")
    tok_dir = build_fim_tokenizer(work)
    fim = Fim(tok_dir)
    data = np.load(work / "train.npy")
    files, _ = tp.read_split()
    weights = np.asarray([len(t) for _, t in files], dtype=np.float64)
    weights /= weights.sum()
    name = f"{'chat' if chat is not None else 'fim'}-{which}"
    state_path = work / f"{name}.state.pt"
    out_dir = args.models_dir / f"pycode-{which}"

    # the model whose outputs the student learns: the base, for the draft; with --keep-from, the
    # checkpoint the chat stage holds the plain and FIM rows to
    keep = args.keep_from if chat is not None and which == "base" else None
    teacher_dir = args.models_dir / "pycode-base" if which == "draft" else keep
    teacher = None
    if teacher_dir is not None:
        teacher = tp.load_model(teacher_dir)
        if teacher.config.vocab_size != fim.vocab:
            sys.exit(f"error: {teacher_dir} has no FIM tokens yet; run --stage fim first")
        for p in teacher.parameters():
            p.requires_grad_(False)
    torch.manual_seed(args.seed)
    if state_path.exists():
        from transformers import Qwen3ForCausalLM

        state = torch.load(state_path, weights_only=False)
        model = Qwen3ForCausalLM(state["config"])
    else:
        model = tp.load_model(out_dir)  # the shipped checkpoint this stage continues
        if chat is not None:
            if model.config.vocab_size != fim.vocab:
                sys.exit(f"error: {out_dir} has no FIM tokens; the chat stages continue the FIM checkpoints")
        elif model.config.vocab_size != 4096:
            sys.exit(f"error: {out_dir} already has {model.config.vocab_size} tokens; "
                     f"this stage continues the 4096-token checkpoint")
        else:
            resize_vocab(model, fim.vocab, teacher.model.embed_tokens.weight if teacher is not None else None)
        state = None
    opt = tp.make_optimizer(model, args.lr)
    step, tokens_seen, elapsed_before = 0, 0, 0.0
    if state is not None:
        if state["steps"] != args.steps:
            sys.exit(f"error: {state_path} was trained with --steps {state['steps']}, "
                     f"not {args.steps}; pass the same value or remove the state")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, tokens_seen, elapsed_before = state["step"], state["tokens"], state["elapsed"]
        log(f"{name}: resumed at step {step} ({tokens_seen} tokens, {elapsed_before:.0f}s)")
    restore = markup_only(model, chat) if chat is not None and which == "base" and args.markup_only else None
    groups = batch_groups(args, chat)
    log(f"{name}: {tp.count_params(model)} parameters, vocab {fim.vocab}, rows {groups}"
        + (f", training only the embedding rows {restore.rows}" if restore is not None else ""))
    t0 = time.monotonic()

    def save_state() -> None:
        tmp = state_path.with_suffix(".tmp")
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "config": model.config,
                    "step": step, "tokens": tokens_seen, "steps": args.steps,
                    "elapsed": elapsed_before + time.monotonic() - t0}, tmp)
        os.replace(tmp, state_path)

    if step == 0:
        save_state()  # resumes never read the shipped checkpoint again (the export replaces it)
    model.train()

    def new_window(t: float) -> dict:
        return {**{kind: 0.0 for kind, _ in groups}, "n": 0, "t": t, "tokens": 0}

    window = new_window(t0)
    while step < args.steps:
        if tp.out_of_budget(name, step, t0, args):
            break
        for group in opt.param_groups:
            group["lr"] = tp.lr_at(step, args)
        inputs, targets = mixed_batch(args, fim, data, files, weights, step, chat)
        logits = model(input_ids=inputs).logits.float()
        ce_rows = F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE, reduction="none")
        valid = (targets != IGNORE).float()
        ce = (ce_rows * valid).sum() / valid.sum()
        if teacher is not None:
            with torch.no_grad():
                teacher_logp = F.log_softmax(teacher(input_ids=inputs).logits.float(), dim=-1)
            kl = F.kl_div(F.log_softmax(logits, dim=-1), teacher_logp, log_target=True,
                          reduction="none").sum(-1)
            if keep is not None:
                loss = keep_loss(kl, ce_rows, valid, groups[-1][1])
            else:
                loss = args.distill * (kl * valid).sum() / valid.sum() + (1.0 - args.distill) * ce
        else:
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if restore is not None:
            restore()
        step += 1
        tokens_seen += int(valid.sum().item())
        row = 0
        for kind, count in groups:
            part = slice(row, row + count)
            window[kind] += (ce_rows[part] * valid[part]).sum().item() / max(1.0, valid[part].sum().item())
            row += count
        window["n"] += 1
        window["tokens"] += int(valid.sum().item())
        if step % args.log_every == 0 or step == args.steps:
            now = time.monotonic()
            n = window["n"]
            losses = " ".join(f"{kind} {window[kind] / n:.4f}" for kind, _ in groups)
            log(f"{name} step {step}/{args.steps} ce {losses} "
                f"lr {tp.lr_at(step - 1, args):.2e} tok/s {window['tokens'] / (now - window['t']):.0f} "
                f"elapsed {elapsed_before + now - t0:.0f}s")
            window = new_window(now)
        if step % args.save_every == 0:
            save_state()
    save_state()
    model.eval()
    # <|im_end|> is not an end-of-sequence id: npud ends a chat reply at its template's end of
    # turn, and a plain completion that met a stray <|im_end|> would stop there
    tp.export(model, tok_dir, out_dir)
    elapsed = elapsed_before + time.monotonic() - t0
    summary = {
        "parameters": tp.count_params(model), "steps": step, "planned_steps": args.steps,
        "tokens": tokens_seen, "train_seconds": round(elapsed, 1), "threads": args.threads,
        "keep_from": str(keep) if keep is not None else None,
        "markup_only": restore.rows if restore is not None else None,
        "seed": args.seed, "batch": args.batch, "fim_rate": args.fim_rate,
        "chat_rate": args.chat_rate if chat is not None else 0.0, "seq_len": args.seq_len,
        "lr": args.lr, "warmup": args.warmup, "vocab": fim.vocab,
        "command": " ".join([os.path.relpath(sys.argv[0], tp.REPO)] + sys.argv[1:]),
    }
    (work / f"{name}.summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"{name}: exported {out_dir} after {step} steps, {elapsed:.0f}s")


log = tp.log


# ---------------------------------------------------------------- evaluation


def held_out_examples(fim: Fim, n_per_kind: int, seed: int, length: int):
    """Deterministic FIM examples from the validation files: (kind, rel, text, span, ids, m0, m1)."""
    _, val = tp.read_split()
    rng = np.random.default_rng([seed, 7])
    out = []
    for kind in ("body", "lines"):
        got, tries = 0, 0
        while got < n_per_kind and tries < 50 * n_per_kind:
            tries += 1
            rel, text = val[int(rng.integers(len(val)))]
            span = pick_middle(text, rng, kind)
            if span is None:
                continue
            ids, m0, m1 = fim_example(fim, rel, text, span, rng, length, False)
            if ids:
                out.append((kind, rel, text, span, ids, m0, m1))
                got += 1
    return out


def _parses(text: str) -> bool:
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    return True


def editor_cases(n: int, seed: int) -> list[tuple[str, str, str]]:
    """llama.vim's request on the validation files: the cursor after the indentation of a line
    in an indented block (the editor sends that indentation as `prompt`, the end of the prefix),
    the middle the rest of the line and up to two more: (prefix, middle, suffix)."""
    _, val = tp.read_split()
    rng = np.random.default_rng([seed, 8])
    out = []
    while len(out) < n:
        _, text = val[int(rng.integers(len(val)))]
        lines = text.splitlines(keepends=True)
        i = int(rng.integers(len(lines)))
        indent = len(lines[i]) - len(lines[i].lstrip(" "))
        if indent == 0 or not lines[i].strip() or lines[i].lstrip()[0] in "#\"')]}":
            continue
        start = sum(map(len, lines[:i]))
        end = start + sum(map(len, lines[i:i + int(rng.integers(1, 4))]))
        out.append((text[:start + indent], text[start + indent:end], text[end:]))
    return out


@torch.no_grad()
def editor_eval(model, fim: Fim, n: int, seed: int, limit: int = 64) -> dict:
    """How often the greedy middle of an editor_cases request ends by itself within `limit`
    tokens (llama.vim's n_predict), and how often it also is not blank and the file parses."""
    ends = good = 0
    cases = editor_cases(n, seed)
    for prefix, _, suffix in cases:
        ids = [fim.prefix, *fim.encode(prefix)[-600:], fim.suffix, *fim.encode(suffix)[:300], fim.middle]
        out = model.generate(torch.tensor([ids]), max_new_tokens=limit, do_sample=False, eos_token_id=fim.stops,
                             pad_token_id=fim.eos)[0, len(ids):].tolist()
        ended = bool(out) and out[-1] in fim.stops
        middle = fim.tok.decode(out[:-1] if ended else out, skip_special_tokens=False)
        ends += ended
        good += ended and bool(middle.strip()) and _parses(prefix + middle + suffix)
    return {"examples": len(cases), "ends": round(ends / len(cases), 4), "ends_and_parses": round(good / len(cases), 4)}


@torch.no_grad()
def greedy_middle(model, fim: Fim, prompt: list[int], limit: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=limit, do_sample=False,
                         eos_token_id=fim.stops, pad_token_id=fim.eos)[0, len(prompt):].tolist()
    return [t for t in out if t not in fim.stops] if out and out[-1] in fim.stops else out


@torch.no_grad()
def stage_fim_eval(args) -> None:
    """Plain held-out loss and agreement (train_pair's eval), then FIM on held-out files: the
    middle's loss (its tokens and the EOS after it), greedy exact match, whether the file with
    the greedy middle put back still parses, and draft/base agreement on the middle."""
    work = args.work_dir
    tp.stage_eval(args)
    result = json.loads((work / "eval.json").read_text())
    base = tp.load_model(args.models_dir / "pycode-base")
    draft = tp.load_model(args.models_dir / "pycode-draft")
    tok_dir = args.models_dir / "pycode-base"
    if base.config.vocab_size == 4096:
        log("fim-eval: the base has no FIM tokens; plain evaluation only")
        return
    fim = Fim(tok_dir)
    examples = held_out_examples(fim, args.fim_eval_examples, args.seed, args.seq_len)
    stats = {k: {"examples": 0, "middle_tokens": 0, "loss_sum": 0.0, "exact": 0, "parses": 0,
                 "parses_reference": 0, "agree": 0, "draft_loss_sum": 0.0} for k in ("body", "lines")}
    samples = []
    for kind, rel, text, (s, e), ids, m0, m1 in examples:
        x = torch.tensor([ids])
        targets = x[0, m0:m1]
        lb = base(input_ids=x[:, :-1]).logits[0, m0 - 1: m1 - 1].float()
        ld = draft(input_ids=x[:, :-1]).logits[0, m0 - 1: m1 - 1].float()
        st = stats[kind]
        st["examples"] += 1
        st["middle_tokens"] += len(targets)
        st["loss_sum"] += F.cross_entropy(lb, targets, reduction="sum").item()
        st["draft_loss_sum"] += F.cross_entropy(ld, targets, reduction="sum").item()
        st["agree"] += (lb.argmax(-1) == ld.argmax(-1)).sum().item()
        got = greedy_middle(base, fim, ids[:m0], len(targets) + 16)
        middle = fim.tok.decode(got, skip_special_tokens=False)
        st["exact"] += middle == text[s:e]
        st["parses"] += _parses(text[:s] + middle + text[e:])
        st["parses_reference"] += _parses(text)
        if len(samples) < 6 and kind == "lines":
            samples.append({"file": rel, "want": text[s:e], "got": middle})
    fim_result = {}
    for kind, st in stats.items():
        n, t = max(1, st["examples"]), max(1, st["middle_tokens"])
        fim_result[kind] = {
            "examples": st["examples"], "middle_tokens": st["middle_tokens"],
            "middle_loss": round(st["loss_sum"] / t, 4), "draft_middle_loss": round(st["draft_loss_sum"] / t, 4),
            "exact_match": round(st["exact"] / n, 4), "parses": round(st["parses"] / n, 4),
            "reference_parses": round(st["parses_reference"] / n, 4),
            "draft_agreement": round(st["agree"] / t, 4),
        }
    fim_result["editor"] = editor_eval(base, fim, args.fim_eval_examples, args.seed)
    result["fim"] = fim_result
    result["fim_samples"] = samples
    (work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    log(json.dumps({"fim": fim_result}, indent=2))
