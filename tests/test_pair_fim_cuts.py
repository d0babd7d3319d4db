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
