"""tools/pair_fim.py's FIM cuts: with --fim-indent-rate a middle may start after its first line's
indentation (llama.vim's cursor on a new indented line), and at rate 0 the cuts, and the random
stream behind every later draw, are those of the stage that made the shipped FIM base."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from test_npud_support import REPO

pytest.importorskip("torch")
sys.path.insert(0, str(REPO / "tools"))
import pair_fim  # noqa: E402

TEXT = "".join(f"def f{i}(x):\n    if x:\n        return {i}\n    return -x\n\n\n" for i in range(30))


@pytest.mark.parametrize("kind", ["body", "lines"])
def test_at_rate_one_an_indented_middle_starts_at_its_statement(kind):
    moved = 0
    for seed in range(200):
        span = pair_fim.pick_middle(TEXT, np.random.default_rng(seed), kind, indent_rate=1.0)
        if span is None:
            continue
        start, end = span
        line_start = TEXT.rfind("\n", 0, start) + 1
        if start > line_start:  # the prefix ends with the indentation alone, the middle at a statement
            assert TEXT[line_start:start].strip(" ") == "" and TEXT[start] not in " \t\n"
            moved += 1
    assert moved > 50


def test_at_rate_zero_the_cuts_and_the_random_stream_are_the_old_ones():
    starts = pair_fim._line_starts(TEXT)
    for seed in range(100):
        rng, old = np.random.default_rng(seed), np.random.default_rng(seed)
        span = pair_fim.pick_middle(TEXT, rng, "lines", indent_rate=0.0)
        # the draws of the cut before the indentation rule existed: a line, then 1 to 4 lines
        i, n = int(old.integers(len(starts) - 1)), int(old.integers(1, 5))
        want = (starts[i], starts[min(i + n, len(starts) - 1)])
        assert span == (want if TEXT[want[0]:want[1]].strip() else None)
        assert rng.random() == old.random()  # nothing more was drawn: every later draw is the old one
    for seed in range(100):
        span = pair_fim.pick_middle(TEXT, np.random.default_rng(seed), "body", indent_rate=0.0)
        assert span is None or TEXT[span[0] - 1] == "\n"  # a body starts at a line start


def test_keep_loss_holds_plain_and_fim_rows_to_the_kept_model_and_trains_chat_rows():
    """--keep-from (the chat stage): KL on the rows before the last n_chat, cross-entropy on
    those, over the valid positions of both together; what a row's other loss says is unused."""
    import torch

    gen = torch.Generator().manual_seed(0)
    kl, ce = torch.rand(5, 7, generator=gen), torch.rand(5, 7, generator=gen)
    valid = (torch.rand(5, 7, generator=gen) > 0.3).float()
    loss = pair_fim.keep_loss(kl, ce, valid, n_chat=2)
    expected = ((kl[:3] * valid[:3]).sum() + (ce[3:] * valid[3:]).sum()) / valid.sum()
    assert torch.isclose(loss, expected, rtol=1e-6, atol=0)
    kl2, ce2 = kl.clone(), ce.clone()
    kl2[3:] += 9.0  # a chat row's KL and a FIM row's cross-entropy do not count
    ce2[:3] += 9.0
    assert torch.equal(pair_fim.keep_loss(kl2, ce2, valid, n_chat=2), loss)
    kl2[0, valid[0].argmax()] += 1.0  # a valid FIM position's KL does
    assert pair_fim.keep_loss(kl2, ce2, valid, n_chat=2) > loss
    assert torch.equal(pair_fim.keep_loss(kl, ce, valid, n_chat=0), (kl * valid).sum() / valid.sum())


def test_markup_only_moves_the_im_start_row_and_nothing_else():
    """--markup-only (the chat stage): after AdamW steps with weight decay on a tied Qwen3, only
    the embedding row of <|im_start|> differs; every other parameter is bit-equal, and replies
    end with <|endoftext|>."""
    import types

    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, str(REPO / "tools"))
    import train_pair

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = {"<|im_start|>": 5, "<|im_end|>": 9}
    chat = types.SimpleNamespace(tok=types.SimpleNamespace(token_id=ids.get), im_end=9, eos=0, end=9)
    restore = pair_fim.markup_only(model, chat)
    opt = train_pair.make_optimizer(model, 1e-2)
    for _ in range(3):
        inputs = torch.randint(0, 64, (2, 12))
        inputs[:, 3] = 5
        inputs[:, 7] = 9  # <|im_end|> in the input too: its row still stays
        loss = model(input_ids=inputs, labels=inputs).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        restore()
    after = model.state_dict()
    weight = after["model.embed_tokens.weight"]
    assert restore.rows == [5] and chat.end == 0
    assert not torch.equal(weight[5], before["model.embed_tokens.weight"][5])
    others = [i for i in range(64) if i != 5]
    assert torch.equal(weight[others], before["model.embed_tokens.weight"][others])
    for key, value in after.items():
        if key not in ("model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(value, before[key]), key
