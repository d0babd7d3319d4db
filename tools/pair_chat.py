"""Chat for the bundled pair: the chat stages of tools/train_pair.py.

    chat        continued training of the FIM pycode-base on batches of plain windows, FIM
                examples and chat conversations -> npud/models/pycode-base
    chat-draft  redistillation of pycode-draft against that base on the same batches
    chat-eval   fim-eval, plus held-out chat: the loss of the reply and its end of turn, how often
                a greedy reply ends its turn by itself and parses as Python, sample replies

A conversation is made from one function of a training file that has a docstring: the user
asks for it (its docstring's first line in one of a few phrasings, or its signature and
docstring, sometimes after a system message) and the assistant answers with the function's
code. It is rendered by the bundled model's own chat template and encoded exactly as npud
encodes a chat (npud.engine.tokenizer.Tokenizer.encode_chat: the template's markup as control
tokens, what the messages say as text), and it ends with the end-of-turn token <|im_end|>:

    <|im_start|>user\\nWrite a Python function `f`: Return ...<|im_end|>\\n<|im_start|>assistant\\n
    def f(...):\\n    ...<|im_end|>

Only the reply and its <|im_end|> are trained on (the rest of the row has target IGNORE); with
--markup-only (pair_fim.markup_only, the shipped base) the reply ends with <|endoftext|> instead. The
exported generation_config.json lists only <|endoftext|> as an end-of-sequence id: npud ends a
chat reply at its template's end of turn (<|im_end|>) by itself, and a plain completion is not
cut short by an <|im_end|> the model writes out of place. Conversations come from
a generator seeded with (seed, step, 2), so a resumed run is the run that was never interrupted.
"""

from __future__ import annotations

import ast
import json
import pathlib
import sys
import textwrap

import numpy as np
import torch
import torch.nn.functional as F

import train_pair as tp

sys.path.insert(0, str(tp.REPO))
IGNORE = -100
MAX_CODE_CHARS = 900
SYSTEMS = ("You are a helpful assistant.", "You are a Python programmer. Answer with code.",
           "You write Python.")


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:] if text[1:2].islower() else text


def request(fn: dict, kind: int) -> str:
    """What the user says for function `fn` in phrasing `kind` (0 to 5)."""
    first = fn["first"]
    if kind == 0:
        return f"Write a Python function `{fn['name']}`: {first}"
    if kind == 1:
        return f"Write a function {fn['call']} in Python. {first}"
    if kind == 2:
        return first
    if kind == 3:
        return f"Complete this function:\n\n{fn['head']}"
    if kind == 4:
        return fn["head"]
    return f"How do I {_lower_first(first).rstrip('.')} in Python?"


KINDS_N = 6


def functions(files: list[tuple[str, str]]) -> list[dict]:
    """The functions of the files that have a docstring and are at most MAX_CODE_CHARS long:
    {name, call, first (docstring's first line), head (signature and docstring), code}."""
    out = []
    for rel, text in files:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or not isinstance(node.body[0], ast.Expr) or len(node.body) < 2:
                continue
            first = doc.strip().splitlines()[0].strip()
            if not 10 <= len(first) <= 120:
                continue
            code = textwrap.dedent("".join(lines[node.lineno - 1: node.end_lineno])).rstrip()
            if len(code) > MAX_CODE_CHARS or "\t" in code:
                continue
            head = textwrap.dedent("".join(lines[node.lineno - 1: node.body[0].end_lineno])).rstrip()
            try:
                call = f"{node.name}({ast.unparse(node.args)})"
            except (ValueError, AttributeError):
                continue
            out.append({"rel": rel, "name": node.name, "call": call, "first": first, "head": head, "code": code})
    return out


class Chat:
    """Conversations from a list of functions, encoded by npud's tokenizer of a checkpoint."""

    def __init__(self, checkpoint: pathlib.Path, fns: list[dict]):
        from npud.engine.tokenizer import Tokenizer

        self.tok = Tokenizer.from_dir(checkpoint)
        self.im_end = self.tok.token_id(tp.IM_END)
        self.eos = self.tok.token_id(tp.EOS)
        self.fns = fns
        self.end = self.im_end  # the token a reply ends with (pair_fim.markup_only: <|endoftext|>)

    def messages(self, rng: np.random.Generator) -> tuple[list[dict], str]:
        fn = self.fns[int(rng.integers(len(self.fns)))]
        messages = [{"role": "user", "content": request(fn, int(rng.integers(KINDS_N)))}]
        if rng.random() < 0.25:
            messages.insert(0, {"role": "system", "content": SYSTEMS[int(rng.integers(len(SYSTEMS)))]})
        return messages, fn["code"]

    def example(self, messages: list[dict], reply: str) -> tuple[list[int], int]:
        """The ids of the conversation through the reply's <|im_end|>, and where the reply starts:
        the prompt as npud encodes it, then the reply's tokens as the model would write them
        after it (rendering the reply into the template instead could merge the prompt's last
        "\n" with the reply's first characters into a token npud never shows the model)."""
        prompt = self.tok.encode_chat(messages, add_generation_prompt=True)
        return prompt + self.tok.encode_text(reply) + [self.end], len(prompt)

    def rows(self, seed: int, step: int, n: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """n conversations as (inputs, targets) of `length` positions; only the reply is a target."""
        rng = np.random.default_rng([seed, step, 2])
        inputs = np.full((n, length), self.eos, dtype=np.int64)
        targets = np.full((n, length), IGNORE, dtype=np.int64)
        row = 0
        while row < n:
            ids, start = self.example(*self.messages(rng))
            if len(ids) > length + 1:
                continue
            ids = np.asarray(ids, dtype=np.int64)
            inputs[row, : len(ids) - 1] = ids[:-1]
            targets[row, start - 1: len(ids) - 1] = ids[start:]
            row += 1
        return torch.from_numpy(inputs), torch.from_numpy(targets)


def train_chat(args) -> Chat:
    files, _ = tp.read_split()
    return Chat(args.models_dir / "pycode-base", functions(files))


# ---------------------------------------------------------------- evaluation

SAMPLE_QUESTIONS = ("Name a colour.", "Write a function that adds two numbers.",
                    "How do I read a file line by line?")


@torch.no_grad()
def greedy_reply(model, chat: Chat, messages: list[dict], limit: int) -> tuple[str, bool]:
    """The greedy reply's text and whether it ended its turn within `limit` tokens."""
    prompt = chat.tok.encode_chat(messages, add_generation_prompt=True)
    stops = [chat.eos, chat.im_end]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=limit, do_sample=False, eos_token_id=stops,
                         pad_token_id=chat.eos)[0, len(prompt):].tolist()
    ended = bool(out) and out[-1] in stops
    return chat.tok.decode([t for t in out if t not in stops]), ended


@torch.no_grad()
def stage_chat_eval(args) -> None:
    """fim-eval, then chat on conversations made from the validation files' functions: loss of
    the reply tokens and its <|im_end|> (base and draft), and for the greedy replies of the base
    how many are not empty, how many of those end their turn by themselves (within 32 tokens
    more than the reference reply) and how many parse as Python; plus sample replies."""
    import pair_fim

    pair_fim.stage_fim_eval(args)
    work = args.work_dir
    result = json.loads((work / "eval.json").read_text())
    _, val = tp.read_split()
    chat = Chat(args.models_dir / "pycode-base", functions(val))
    models = {name: tp.load_model(args.models_dir / f"pycode-{name}") for name in ("base", "draft")}
    rng = np.random.default_rng([args.seed, 9])
    sums = {"base": 0.0, "draft": 0.0}
    tokens = said = ended = parses = agree = 0
    n = args.chat_eval_examples
    for i in range(n):
        messages, reply = chat.messages(rng)
        ids, start = chat.example(messages, reply)
        x = torch.tensor([ids])
        target = x[0, start:]
        logits = {}
        for name, model in models.items():
            logits[name] = model(input_ids=x[:, :-1]).logits[0, start - 1:].float()
            sums[name] += F.cross_entropy(logits[name], target, reduction="sum").item()
        agree += (logits["base"].argmax(-1) == logits["draft"].argmax(-1)).sum().item()
        tokens += len(target)
        if i < args.chat_greedy_examples:
            text, done = greedy_reply(models["base"], chat, messages, len(target) + 32)
            said += bool(text.strip())
            ended += done and bool(text.strip())
            parses += pair_fim._parses(text) and bool(text.strip())
    g = min(n, args.chat_greedy_examples)
    result["chat"] = {
        "examples": n, "reply_tokens": tokens, "reply_loss": round(sums["base"] / tokens, 4),
        "draft_reply_loss": round(sums["draft"] / tokens, 4), "draft_agreement": round(agree / tokens, 4),
        "greedy_examples": g, "greedy_says_something": round(said / g, 4), "greedy_ends_turn": round(ended / g, 4), "greedy_parses": round(parses / g, 4),
    }
    result["chat_samples"] = [
        {"question": q, "reply": greedy_reply(models["base"], chat, [{"role": "user", "content": q}], 64)[0]}
        for q in SAMPLE_QUESTIONS
    ]
    (work / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    tp.log(json.dumps({"chat": result["chat"], "chat_samples": result["chat_samples"]}, indent=2))
