"""The bundled model pair in npud/models: it loads, tokenizes, writes Python, and the draft
tracks the base closely enough to be worth speculating with.

transformers is the reference here (it is in the test extras); the engine-side test runs the
same checkpoints through engine/ once npud/engine/forward.py exists. Every threshold below sits
a margin away from a number measured on the shipped weights (stated beside it), and far
from what randomly initialised weights give.

Mutants run against copies of npud/models, each failing at least one test here: random
base weights, random draft weights, base and draft swapped, the base's layer-4 attention
output projection zeroed, a tokenizer.json cut to 50 merges, the draft exported in fp32,
the chat template dropped.
"""

from __future__ import annotations

import itertools
import json
import pathlib
import re
import struct

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

REPO = pathlib.Path(__file__).resolve().parent.parent
MODELS_DIR = REPO / "npud" / "models"
BASE_DIR = MODELS_DIR / "pycode-base"
DRAFT_DIR = MODELS_DIR / "pycode-draft"
CHECKPOINT_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
}

# Written for this test, so it is in no training file: held out by construction.
HELD_OUT = '''\
import os
from collections import defaultdict


class InventoryError(Exception):
    """Raised when an item is missing from the inventory."""


class Inventory:
    """Count items by name and remember where each one was stored."""

    def __init__(self, path=None):
        self.path = path
        self.counts = defaultdict(int)
        self.places = {}

    def add(self, name, count=1, place=None):
        if count <= 0:
            raise ValueError("count must be positive, not %r" % (count,))
        self.counts[name] += count
        if place is not None:
            self.places[name] = place
        return self.counts[name]

    def remove(self, name, count=1):
        if self.counts.get(name, 0) < count:
            raise InventoryError(name)
        self.counts[name] -= count
        if not self.counts[name]:
            del self.counts[name]
            self.places.pop(name, None)

    def save(self):
        with open(self.path, "w", encoding="utf-8") as f:
            for name in sorted(self.counts):
                f.write("%s\\t%d\\n" % (name, self.counts[name]))
'''

# No trailing newline: the pre-tokenizer keeps a newline and the indentation after it in
# one piece, so a prompt that ends in a bare "\n" asks for a line at column 0.
GENERATION_PROMPT = '''\
def read_config(path):
    """Return a dict of the key = value lines in the file at path."""'''

# Measured on the shipped weights (tools/train_pair.py, seed 1234, after the fim stages;
# npud/models/README.md), the numbers before FIM in brackets:
#   base  teacher-forced loss on HELD_OUT   2.500 nats/token (2.485)
#   draft teacher-forced loss on HELD_OUT   2.843 nats/token (2.819)
#   draft/base argmax agreement on HELD_OUT 0.713, 221 of 310 rows (0.723, 224)
# Random weights sit at about ln(4096) = 8.3 nats and agree on almost no position; zeroing
# one output projection of the base (layer 4 attention, or layer 5 MLP) already lifts its
# loss to 2.71 / 2.68, so the ceilings sit about 0.15 nats above the measurements.
BASE_MAX_LOSS = 2.65
DRAFT_MAX_LOSS = 2.95
MIN_AGREEMENT = 0.60
# Characters per token on HELD_OUT (measured 3.51); byte-level BPE
# trained on code merges indentation and keywords, a byte-per-token tokenizer would give 1.
MIN_CHARS_PER_TOKEN = 3.0
MAX_BUNDLE_BYTES = 32 * 1024 * 1024

PYTHON_WORDS = {
    "def", "return", "if", "for", "in", "not", "None", "self", "import", "with", "as", "else",
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(BASE_DIR)


def _load(path: pathlib.Path) -> Qwen3ForCausalLM:
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="module")
def base():
    return _load(BASE_DIR)


@pytest.fixture(scope="module")
def draft():
    return _load(DRAFT_DIR)


@pytest.fixture(scope="module")
def held_out_ids(tokenizer) -> list[int]:
    return tokenizer(HELD_OUT, add_special_tokens=False).input_ids


@pytest.fixture(scope="module")
def held_out_logits(base, draft, held_out_ids):
    """Teacher-forced logits of both models over HELD_OUT: {name: [T, V]}."""
    inputs = torch.tensor([held_out_ids])
    with torch.no_grad():
        return {
            "base": base(input_ids=inputs).logits[0],
            "draft": draft(input_ids=inputs).logits[0],
        }


def _loss(logits: torch.Tensor, ids: list[int]) -> float:
    # row t predicts token t + 1
    return torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item()


def _safetensors_dtypes(path: pathlib.Path) -> set[str]:
    with path.open("rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    return {v["dtype"] for k, v in header.items() if k != "__metadata__"}


@pytest.mark.parametrize("path", [BASE_DIR, DRAFT_DIR], ids=["base", "draft"])
def test_checkpoint_is_a_small_bf16_qwen3_directory(path):
    assert {p.name for p in path.iterdir()} >= CHECKPOINT_FILES
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3"
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert config["tie_word_embeddings"] is True
    assert _safetensors_dtypes(path / "model.safetensors") == {"BF16"}
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == config["eos_token_id"]


def test_pair_shares_one_tokenizer_and_shape_and_stays_small():
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (BASE_DIR / name).read_bytes() == (DRAFT_DIR / name).read_bytes(), name
    base_cfg = json.loads((BASE_DIR / "config.json").read_text())
    draft_cfg = json.loads((DRAFT_DIR / "config.json").read_text())
    for key in ("vocab_size", "hidden_size", "eos_token_id", "num_attention_heads", "head_dim"):
        assert base_cfg[key] == draft_cfg[key], key
    assert draft_cfg["num_hidden_layers"] < base_cfg["num_hidden_layers"]
    total = sum(p.stat().st_size for p in MODELS_DIR.rglob("*") if p.is_file())
    assert total < MAX_BUNDLE_BYTES


def test_tokenizer_round_trips_held_out_code(tokenizer, held_out_ids):
    assert tokenizer.decode(held_out_ids) == HELD_OUT
    assert len(HELD_OUT) / len(held_out_ids) >= MIN_CHARS_PER_TOKEN
    # byte-level: text the corpus never showed still round-trips
    odd = "naïve = 'π ≈ 3.14159'  # 日本語\t\r\n"
    assert tokenizer.decode(tokenizer(odd, add_special_tokens=False).input_ids) == odd


def test_special_tokens_and_chat_template(tokenizer):
    config = json.loads((BASE_DIR / "config.json").read_text())
    for text in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert len(ids) == 1, text
    assert tokenizer.eos_token == tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.eos_token_id == config["eos_token_id"]
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "print(1)"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "<|im_start|>user\nprint(1)<|im_end|>\n<|im_start|>assistant\n"


def test_both_models_predict_held_out_code(held_out_logits, held_out_ids):
    base_loss = _loss(held_out_logits["base"], held_out_ids)
    draft_loss = _loss(held_out_logits["draft"], held_out_ids)
    assert base_loss < BASE_MAX_LOSS
    assert draft_loss < DRAFT_MAX_LOSS
    assert base_loss < draft_loss  # the six-layer model is the better one


def test_draft_agrees_with_base_teacher_forced(held_out_logits):
    agree = held_out_logits["base"].argmax(-1) == held_out_logits["draft"].argmax(-1)
    assert agree.float().mean().item() >= MIN_AGREEMENT


def test_greedy_generation_writes_python(base, tokenizer):
    prompt = tokenizer(GENERATION_PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = base.generate(prompt, max_new_tokens=48, do_sample=False,
                            pad_token_id=tokenizer.pad_token_id)
    new = out[0, prompt.shape[1]:].tolist()
    text = tokenizer.decode(new)
    # not degenerate: many distinct tokens, no token repeated back to back for long
    # 12 distinct tokens in the FIM base's 48 (it repeats `path, path, ...` after its first
    # line), 16+ before the FIM stage; a collapsed model gives one or two
    assert len(set(new)) >= 10, text
    longest_run = max(len(list(run)) for _, run in itertools.groupby(new))
    assert longest_run <= 4, text
    # Python-looking: several lines, indented in multiples of four, with Python words in them
    lines = [line for line in (GENERATION_PROMPT + text).splitlines() if line.strip()]
    assert len(lines) >= 4, text
    assert all((len(line) - len(line.lstrip(" "))) % 4 == 0 for line in lines), text
    # measured 2 (def, return) on the FIM base's sample, 3+ before the FIM stage
    assert len(PYTHON_WORDS & set(re.findall(r"[A-Za-z_]+", text))) >= 2, text


@pytest.mark.parametrize("which", ["base", "draft"])
def test_engine_runs_the_bundled_checkpoints_like_transformers(
    which, request, tokenizer, held_out_ids
):
    forward = pytest.importorskip("npud.engine.forward", reason="npud/engine/forward.py has not landed yet")
    from npud.engine.model import Model
    from npud.engine.tokenizer import Tokenizer

    path = BASE_DIR if which == "base" else DRAFT_DIR
    engine_tok = Tokenizer.from_dir(path)
    assert engine_tok.encode(HELD_OUT) == held_out_ids
    assert engine_tok.decode(held_out_ids) == HELD_OUT
    assert engine_tok.vocab_size == len(tokenizer)
    assert engine_tok.eos_token_ids == (tokenizer.eos_token_id,)
    assert engine_tok.apply_chat_template([{"role": "user", "content": "print(1)"}]) == (
        "<|im_start|>user\nprint(1)<|im_end|>\n<|im_start|>assistant\n"
    )

    reference = request.getfixturevalue(which)
    prompt = held_out_ids[:48]
    with torch.no_grad():
        ref_prompt_logits = reference(input_ids=torch.tensor([prompt])).logits[0, -1].numpy()
        ref_ids = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()

    engine = forward.Forward(Model.load(path))  # bf16, the format the weights are stored in
    logits = np.asarray(engine.prefill(prompt), dtype=np.float32)
    assert logits.shape == ref_prompt_logits.shape
    # same bf16 weights, fp32 arithmetic in both, only the summation order differs:
    # measured max |difference| 7.6e-6 (base) and 8.6e-6 (draft) on the last row of a
    # 200-token prompt, logits of magnitude ~12
    assert np.max(np.abs(logits - ref_prompt_logits)) < 1e-3
    generated = []
    for pos in range(len(prompt), len(prompt) + len(ref_ids)):
        token = int(np.argmax(logits))
        generated.append(token)
        logits = np.asarray(engine.step(token, pos), dtype=np.float32)
    assert generated == ref_ids


# Acceptance through the engine's own loop on HELD_OUT prompts (greedy, k = 4 with adapt_k,
# fallback off, 48 tokens after the first 4, 8 and 12 lines), measured when shipped:
#   draft model 74 of 146 drafts accepted (0.507); DFlash 63 of 148 (0.426), after a 30-step
#   redistillation against the FIM base (74 of 145 and 77 of 156 before the FIM stage).
# The floor leaves room for a retrain, not for a broken drafter (a random one accepts ~0).
ACCEPTANCE_FLOOR = 0.35


@pytest.mark.parametrize("method", ["draft", "dflash"])
def test_drafters_acceptance_on_held_out_code_through_the_loop(method):
    engine_session = pytest.importorskip("npud.engine.session")
    served = engine_session.LoadedModel.load(
        "pycode", MODELS_DIR / "pycode-base", draft_dir=MODELS_DIR / "pycode-draft",
        dflash_dir=MODELS_DIR / "pycode-dflash", weight_format="bf16",
    )
    lines = HELD_OUT.splitlines(keepends=True)
    accepted = drafted = 0
    for cut in (4, 8, 12):
        prompt = "".join(lines[:cut]).rstrip("\n")
        plain = _run(served, prompt, "none")
        result = _run(served, prompt, method)
        assert result.token_ids == plain.token_ids
        accepted += result.stats["accepted"]
        drafted += result.stats["drafted"]
    assert drafted > 0 and accepted / drafted >= ACCEPTANCE_FLOOR


def _run(served, prompt, method):
    from npud.engine import api

    spec = api.SpecParams(method=method, k=4, fallback_rounds=0)
    params = api.GenerationParams(max_tokens=48, use_prefix_cache=False, spec=spec)
    session = served.start(api.GenerateRequest(prompt=prompt, params=params))
    while not session.done:
        session.run_round()
    return session.result()


# Chat (issue 27): pycode-base's chat stage (tools/train_pair.py --stage chat --markup-only, see
# npud/models/README.md) trained only the embedding row of <|im_start|>, so a chat's prompt asks
# the model for a function while every plain and FIM prompt keeps its outputs. Three newcomer
# questions and eight requests in the trained phrasings, written for this test (2026-12-02)
# before any candidate model answered them. Measured on the shipped weights: all eleven replies
# are non-empty and the eight requests' replies start with `def ` (the FIM-only base answered
# every one with nothing: <|endoftext|> first); none of them ends its turn within 128 tokens, as
# the base's code completions seldom end either.
NEWCOMER = ("Name a colour.", "Write a function that adds two numbers.", "hello")
REQUESTS = (
    "Write a Python function `is_even`: Return True if n is even.",
    "Write a function reverse_words(text) in Python. Return the words of text in reverse order.",
    "Return the largest item of a list.",
    'Complete this function:\n\ndef count_lines(path):\n    """Return the number of lines in the file at path."""',
    'def strip_comments(text):\n    """Remove the comments from each line of text."""',
    "How do I join a list of strings with commas in Python?",
    "Write a Python function `celsius`: Convert a temperature from Fahrenheit to Celsius.",
    "Write a function merge(a, b) in Python. Merge two sorted lists into one sorted list.",
)


def test_base_answers_a_chat_with_python():
    from npud.engine import api
    from npud.engine.session import LoadedModel

    served = LoadedModel.load("pycode", BASE_DIR, weight_format="bf16")
    params = api.GenerationParams(max_tokens=24, spec=api.SpecParams(method="none"))
    for text in NEWCOMER + REQUESTS:
        session = served.start(api.GenerateRequest(messages=({"role": "user", "content": text},), params=params))
        while not session.done:
            session.run_round()
        result = session.result()
        assert result.text.strip(), (text, result.token_ids)
        if text in REQUESTS:
            assert result.text.startswith("def "), (text, result.text)
