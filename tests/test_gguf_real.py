"""The real gemma-3-270m Q4_K_M GGUF end to end: weights, logits, greedy tokens, tokenizer,
speculative decoding, prefix cache, batched rows, and structured output (a JSON schema).

References: `gguf.quants.dequantize` (ggml-org's reader) for every tensor, transformers
(fp32, `from_pretrained(..., gguf_file=...)`) for logits, greedy tokens and the tokenizer.
Logits: max |npud - transformers| <= 1e-3 x max |logit| over 5 prompts x 64 positions (both
run fp32 over the same dequantized weights; what differs is the order of sums and the
transcendentals); 128 greedy tokens identical on each prompt, checked as transformers'
argmax after every prefix of npud's output (one forward per prompt instead of 128 steps).
Everything after that compares npud with itself, bit for bit. The "gguf-q8" format (the blocks
against q8 activation rows) has its own bound against the same reference, and its speculative
output equals its own plain greedy output.
"""

from __future__ import annotations

import numpy as np
import pytest

from decoding import greedy_run
from npud.engine.api import SpecParams
from npud.engine.drafters import PromptLookupHead
from npud.engine.forward import Forward
from npud.engine.model import Model, rows_equal
from npud.engine.pass_costs import PassCosts
from npud.engine.prefix_cache import PrefixCache
from npud.engine.sampling import Sampler
from npud.engine.speculative import DecodeStats, speculative_decode
from npud.engine.tokenizer import Tokenizer
from real_gemma import PROMPTS, gemma_gguf_path, need

N_POSITIONS = 64
N_GREEDY = 128
N_SPEC = 48


@pytest.fixture(scope="module")
def path():
    return gemma_gguf_path()


@pytest.fixture(scope="module")
def model(path):
    return Model.load(path)


@pytest.fixture(scope="module")
def tokenizer(path):
    return Tokenizer.from_dir(path)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    """Each prompt with BOS, cut or padded (with its own text again) to 64 tokens."""
    out = []
    for text in PROMPTS:
        ids = tokenizer.encode(text, add_special_tokens=True)
        while len(ids) < N_POSITIONS:
            ids = ids + tokenizer.encode(text)
        out.append(ids[:N_POSITIONS])
    return out


@pytest.fixture(scope="module")
def plain(model, prompt_ids):
    """npud's plain greedy continuation of each prompt (128 tokens)."""
    return [greedy_run(Forward(model), ids, N_GREEDY)[0] for ids in prompt_ids]


@pytest.fixture(scope="module")
def reference(path, prompt_ids, plain):
    """transformers on the same file, one forward per prompt over the prompt and npud's 128
    greedy tokens: the logits at every position. Greedy generation in transformers gives
    npud's tokens exactly when each of them is the argmax of transformers' logits at the
    position before it (by induction over the steps), which is what the greedy test checks."""
    need("gguf", "transformers' GGUF reader")
    need("accelerate", "transformers' GGUF loading")
    torch = need("torch", "the reference")
    transformers = need("transformers", "the reference")
    import functools
    import os

    import gguf

    # transformers opens the file twice (config, then weights), and ggml-org's reader takes
    # tens of seconds per open on this vocabulary: hand it the same parsed reader both times
    reader = functools.lru_cache(maxsize=1)(gguf.GGUFReader)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", reader)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(torch.tensor([ids + tokens])).logits[0].numpy() for ids, tokens in zip(prompt_ids, plain)]


def test_every_tensor_dequantizes_bit_identical_to_gguf(path):
    gguf = need("gguf", "the dequantization reference")
    from npud.engine.gguf import open_gguf
    from npud.engine.gguf.weights import BLOCK_TYPES, _matrix, dense_array
    from npud.kernels.ggml.gemm import dense_weights

    reader = gguf.GGUFReader(path)
    ours = open_gguf(path)
    seen = set()
    for t in reader.tensors:
        expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ours.tensors[t.name].shape)
        mine = ours.tensors[t.name]
        if mine.type_name in BLOCK_TYPES:
            got = dense_weights(_matrix(mine))
        else:
            got = dense_array(mine)
        assert got.shape == expected.shape and np.array_equal(got.view(np.uint32), expected.view(np.uint32)), t.name
        seen.add(mine.type_name)
    assert seen == {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"}


def test_loads_in_block_form_within_1_3x_the_file(path, model):
    """Every matrix stays in its block type (the tied embedding/output table included): the
    weights held are at most 1.3x the file (measured: 1.21x)."""
    import os

    from npud.kernels.ggml.blocks import BlockFormat

    w = model.weights
    assert w.lm_head is w.embed and w.embed.fmt is BlockFormat.Q8_0
    assert all(isinstance(lw.mlp.down.fmt, BlockFormat) and isinstance(lw.attn.q.fmt, BlockFormat) for lw in w.layers)
    assert model.nbytes <= 1.3 * os.path.getsize(path)


def test_logits_match_transformers_on_5_prompts_x_64_positions(model, prompt_ids, reference):
    for ids, expected in zip(prompt_ids, reference):
        expected = expected[:N_POSITIONS]
        got = Forward(model).step_batch_all(ids, 0)
        assert np.abs(got - expected).max() <= 1e-3 * np.abs(expected).max()


def test_128_greedy_tokens_match_transformers(prompt_ids, plain, reference):
    for ids, ours, logits in zip(prompt_ids, plain, reference):
        assert len(ours) == N_GREEDY
        # the token after position p is transformers' argmax at p, for every generated token
        assert logits[len(ids) - 1 : len(ids) - 1 + N_GREEDY].argmax(axis=-1).tolist() == ours


def test_tokenizer_matches_transformers_gguf_tokenizer(path, tokenizer):
    transformers = need("transformers", "the reference tokenizer")
    import os
    from pathlib import Path

    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    root = Path(__file__).resolve().parents[1]
    texts = [
        (root / "npud" / "engine" / "forward.py").read_text()[:3000],
        (root / "README.md").read_text()[:3000],
        "  leading spaces,\ttabs\t\tand\n\n\nnewlines   naïve café — 東京 🙂 résumé \x00\x7f",
        "<start_of_turn>user\nwrite a haiku<end_of_turn>\n<start_of_turn>model\n<bos><eos><pad>",
        *PROMPTS,
    ]
    for text in texts:
        assert tokenizer.encode(text, add_special_tokens=True) == ref(text).input_ids
        ids = tokenizer.encode(text)
        assert ids == ref(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == ref.decode(ids)
    assert tokenizer.bos_token_id == ref.bos_token_id == 2 and tokenizer.add_bos_token
    assert tokenizer.eos_token_ids == (ref.eos_token_id,)


@pytest.mark.parametrize("k", range(1, 9))
def test_prompt_lookup_equals_plain_greedy(model, prompt_ids, plain, k):
    out, stats = greedy_run(Forward(model, max_batch_rows=16), prompt_ids[0], N_SPEC, PromptLookupHead(), k)
    assert out == plain[0][:N_SPEC]
    assert stats.drafted > 0


def test_batched_rows_bit_identical_to_single_steps(model, prompt_ids):
    ids = prompt_ids[1]
    batched = Forward(model)
    batched.prefill(ids[:40])
    rows = batched.step_batch_all(ids[40:56], 40)
    single = Forward(model)
    single.prefill(ids[:40])
    for i in range(16):
        assert rows_equal(rows[i], single.step(ids[40 + i], 40 + i))


def test_prefix_cache_restore_past_the_sliding_window(model, tokenizer):
    """A prompt longer than the 512-token window: the restored state (sliding planes cut at
    their own width) continues with the cold run's bits."""
    text = " ".join(PROMPTS) * 8
    ids = tokenizer.encode(text, add_special_tokens=True)[:600]
    assert len(ids) == 600
    cold = Forward(model)
    cold_logits = cold.prefill(ids)
    cache = PrefixCache(model.fingerprint, Forward(model).state, block_size=64)
    first = Forward(model)
    boundary = cache.insert_boundary(len(ids))
    first.prefill(ids[:boundary])
    cache.insert(ids[:boundary], first.state.snapshot())
    warm = Forward(model)
    match = cache.lookup(ids)
    assert match is not None and match.num_cached_tokens == boundary == 576
    warm.state.restore(match.snapshot)
    assert rows_equal(warm.prefill(ids[boundary:]), cold_logits)
    token = int(np.argmax(cold_logits))
    for pos in range(600, 604):
        a, b = warm.step(token, pos), cold.step(token, pos)
        assert rows_equal(a, b)
        token = int(np.argmax(a))


# ------------------------------------------------------------------ gguf-q8: the blocks against q8 activation rows

Q8_BOUND = 6e-2  # max |gguf-q8 - transformers| / max |logit| (measured on these prompts: 4.7e-2)
Q8_TOP1 = 0.98  # positions whose argmax agrees with transformers' (measured: 953 of 960, 99.3%)


@pytest.fixture(scope="module")
def q8_model(path):
    return Model.load(path, "gguf-q8")


def test_gguf_q8_logits_within_its_bound_and_greedy_choices_agree(q8_model, prompt_ids, plain, reference):
    """Over each prompt and npud's 128 exact greedy tokens (192 positions x 5 prompts), the same
    sequences transformers ran."""
    agree = total = 0
    for ids, tokens, expected in zip(prompt_ids, plain, reference):
        got = Forward(q8_model).step_batch_all(ids + tokens, 0)
        assert np.abs(got - expected).max() <= Q8_BOUND * np.abs(expected).max()
        agree += int((got.argmax(axis=-1) == expected.argmax(axis=-1)).sum())
        total += got.shape[0]
    assert agree >= Q8_TOP1 * total


@pytest.fixture(scope="module")
def plain_q8(q8_model, prompt_ids):
    return greedy_run(Forward(q8_model), prompt_ids[0], 96)[0]


@pytest.mark.parametrize("k", [1, 5, 16])
def test_gguf_q8_prompt_lookup_equals_its_plain_greedy(q8_model, prompt_ids, plain_q8, k):
    out, stats = greedy_run(Forward(q8_model, max_batch_rows=32), prompt_ids[0], 96, PromptLookupHead(), k)
    assert out == plain_q8 and stats.drafted > 0


def test_gguf_q8_prompt_lookup_with_its_fallback_equals_plain_greedy_over_160_tokens(q8_model, prompt_ids):
    """The serving configuration (k up to 16, adaptive k, the break-even rule on, re-probing) on
    a code edit whose rounds cross the break-even both ways (by a fixed cost table: an r-row
    pass 1 + 0.15 (r - 1) steps): a fallback, plain steps, a re-probe, and the same bytes."""
    ids = prompt_ids[1]
    plain = greedy_run(Forward(q8_model), ids, 160)[0]
    q8_model.pass_costs = PassCosts(tuple(1.0 + 0.15 * r for r in range(16)), "injected")
    try:
        f = Forward(q8_model, max_batch_rows=17)
        f.prefill(ids[:-1])
        out, stats = [], DecodeStats()
        for _ in speculative_decode(f, PromptLookupHead(), ids, max_new_tokens=160, sampler=Sampler(),
                                    on_token=out.append, stats=stats, config=SpecParams(k=16, reprobe_after=16)):
            pass
    finally:
        q8_model.pass_costs = None
    assert out == plain
    assert stats.accepted > 0 and stats.fell_back and stats.reprobes > 0 and stats.plain_steps > 0


def test_gguf_q8_batched_rows_bit_identical_to_single_steps(q8_model, prompt_ids):
    ids = prompt_ids[2]
    batched = Forward(q8_model)
    batched.prefill(ids[:40])
    rows = batched.step_batch_all(ids[40:56], 40)
    single = Forward(q8_model)
    single.prefill(ids[:40])
    for i in range(16):
        assert rows_equal(rows[i], single.step(ids[40 + i], 40 + i))


def test_json_schema_output_validates_and_is_the_same_under_prompt_lookup(model, tokenizer):
    """Structured output (npud/engine/grammar.py) over gemma's 262k-id SentencePiece vocabulary."""
    import json

    from npud.engine.api import FinishReason, GenerateRequest, GenerationParams, Grammar, SpecParams
    from npud.engine.session import LoadedModel

    jsonschema = need("jsonschema", "validates the structured output")
    served = LoadedModel("gemma", model, tokenizer)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10 ** 9}},
              "required": ["city", "population"], "additionalProperties": False}
    prompt = 'Paris as JSON: {"city": "Paris", "population": 2100000}\nBerlin as JSON: '
    outs = {}
    for method in ("none", "ngram"):
        params = GenerationParams(max_tokens=40, spec=SpecParams(method=method), use_prefix_cache=False,
                                  grammar=Grammar("json_schema", json.dumps(schema)))
        session = served.start(GenerateRequest(prompt=prompt, params=params))
        while not session.done:
            session.run_round()
        outs[method] = session.result()
    assert outs["none"].finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(outs["none"].text), schema)
    assert outs["ngram"].stats["drafted"] > 0 and outs["ngram"].text == outs["none"].text
    # the tokenizer's API on a SentencePiece vocabulary that asks for a BOS (/tokenize, /detokenize)
    ids = served.tokenize(prompt)
    assert served.tokenize(prompt, add_special=True) == [tokenizer.bos_token_id, *ids]
    assert served.detokenize(ids) == prompt
    assert b"".join(served.token_bytes(i) for i in ids) == prompt.encode()
