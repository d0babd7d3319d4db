"""Sampler: greedy, temperature, top-k, top-p, seeding, and the speculative accept/resample rule."""

from __future__ import annotations

import numpy as np
import pytest

from npud.engine.config import ConfigError
from npud.engine.api import SamplingParams
from npud.engine.sampling import Sampler

LOGITS = np.log(np.array([0.05, 0.40, 0.10, 0.30, 0.15])).astype(np.float32)
P = np.array([0.05, 0.40, 0.10, 0.30, 0.15])
# chi2.ppf(0.999, df=4) = 18.47: the threshold for a 5-token histogram
CHI2_999_DF4 = 18.47


def _chi_square(counts, p):
    expected = counts.sum() * p
    keep = p > 0
    assert counts[~keep].sum() == 0  # nothing drawn where the distribution has no mass
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=True), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(seed=-3), "seed"),
    ],
)
def test_config_is_validated(kwargs, field):
    with pytest.raises(ConfigError, match=f"SamplingParams.{field}"):
        SamplingParams(**kwargs)


def test_greedy_is_the_first_index_of_the_maximum():
    s = Sampler()
    assert s.choose(np.array([0.0, 2.0, 2.0, 1.0], np.float32)) == 1
    assert s.probs(np.array([0.0, 2.0, 2.0, 1.0])).tolist() == [0.0, 1.0, 0.0, 0.0]


def test_temperature_one_is_the_softmax():
    assert np.allclose(Sampler(SamplingParams(temperature=1.0)).probs(LOGITS), P)


def test_temperature_sharpens_and_flattens():
    cold = Sampler(SamplingParams(temperature=0.5)).probs(LOGITS)
    hot = Sampler(SamplingParams(temperature=2.0)).probs(LOGITS)
    assert np.allclose(cold, P**2 / (P**2).sum())
    assert np.allclose(hot, np.sqrt(P) / np.sqrt(P).sum())


def test_top_k_keeps_the_k_largest():
    p = Sampler(SamplingParams(temperature=1.0, top_k=2)).probs(LOGITS)
    assert np.allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0])


def test_top_p_keeps_the_smallest_set_reaching_the_mass():
    # sorted: 0.40, 0.30, 0.15, 0.10, 0.05; 0.40 + 0.30 = 0.70 reaches 0.7
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.7)).probs(LOGITS)
    assert np.allclose(p, [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0])
    p = Sampler(SamplingParams(temperature=1.0, top_p=0.71)).probs(LOGITS)
    assert np.allclose(p, [0, 0.40 / 0.85, 0, 0.30 / 0.85, 0.15 / 0.85])


def test_the_same_seed_draws_the_same_tokens():
    a = Sampler(SamplingParams(temperature=1.0, seed=5))
    b = Sampler(SamplingParams(temperature=1.0, seed=5))
    c = Sampler(SamplingParams(temperature=1.0, seed=6))
    draws = [[s.choose(LOGITS) for _ in range(50)] for s in (a, b, c)]
    assert draws[0] == draws[1] != draws[2]


@pytest.mark.parametrize("top_k", [0, 3])
def test_choose_draws_from_probs(top_k):
    s = Sampler(SamplingParams(temperature=1.0, top_k=top_k, seed=11))
    counts = np.bincount([s.choose(LOGITS) for _ in range(20000)], minlength=5)
    assert _chi_square(counts, s.probs(LOGITS)) < CHI2_999_DF4


def test_draw_never_lands_on_a_zero_weight_token():
    s = Sampler(SamplingParams(temperature=1.0, seed=1))
    w = np.array([0.0, 0.5, 0.0, 0.5, 0.0])
    assert set(s.draw(w) for _ in range(2000)) == {1, 3}


def test_greedy_judge_accepts_the_argmax_and_replaces_anything_else():
    s = Sampler()
    assert s.judge(1, None, LOGITS) is None
    assert s.judge(3, None, LOGITS) == 1


Q = np.array([0.30, 0.10, 0.40, 0.10, 0.10])


@pytest.mark.parametrize("q", [Q, None], ids=["sampled_q", "one_hot_q"])
def test_judge_output_is_distributed_as_p(q):
    """Draft d ~ q (or fixed at 2), emit d if accepted else the replacement: the emitted
    token must be distributed as p whatever q is."""
    s = Sampler(SamplingParams(temperature=1.0, seed=21))
    rng = np.random.default_rng(3)
    counts = np.zeros(5, int)
    accepted = 0
    for _ in range(30000):
        d = int(rng.choice(5, p=q)) if q is not None else 2
        out = s.judge(d, q, LOGITS)
        accepted += out is None
        counts[d if out is None else out] += 1
    assert _chi_square(counts, P) < CHI2_999_DF4
    # the accept rate is sum min(p, q) (for one-hot q at 2: p[2])
    expected_rate = np.minimum(P, Q).sum() if q is not None else P[2]
    assert accepted / 30000 == pytest.approx(expected_rate, abs=0.015)


def test_judge_with_top_k_never_emits_a_filtered_token():
    s = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=2))
    outs = {s.judge(0, None, LOGITS) for _ in range(500)}
    assert outs <= {1, 3}  # token 0 has no mass after top-k: never accepted, resampled inside the top 2
