"""Samplers and the repetition penalty; the penalty is checked against transformers' processor."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from sluice.errors import RequestError
from sluice.sampling import _filter, apply_logits_processors, make_logits_processors, make_sampler

# probabilities 0.5, 0.3, 0.15, 0.05 (temperature 1)
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _draws(sampler, logits: torch.Tensor, n: int = 400) -> Counter:
    return Counter(sampler(logits) for _ in range(n))


def test_greedy_is_argmax() -> None:
    g = torch.Generator().manual_seed(0)
    sample = make_sampler()
    for _ in range(20):
        logits = torch.randn(1000, generator=g)
        assert sample(logits) == int(torch.argmax(logits))


def test_seeded_sampling_is_reproducible() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    for kw in ({}, {"top_p": 0.9, "top_k": 50, "min_p": 0.01}):
        a, b = make_sampler(temperature=1.0, seed=7, **kw), make_sampler(temperature=1.0, seed=7, **kw)
        seq_a, seq_b = [a(logits) for _ in range(50)], [b(logits) for _ in range(50)]
        assert seq_a == seq_b
        c = make_sampler(temperature=1.0, seed=8, **kw)
        assert [c(logits) for _ in range(50)] != seq_a


def test_top_k_1_and_tiny_top_p_equal_greedy() -> None:
    g = torch.Generator().manual_seed(2)
    greedy = make_sampler()
    for kw in ({"top_k": 1}, {"top_p": 1e-6}):
        sample = make_sampler(temperature=1.5, seed=0, **kw)
        for _ in range(20):
            logits = torch.randn(300, generator=g)
            assert sample(logits) == greedy(logits)
    tied = torch.tensor([0.0, 3.0, 1.0, 3.0])  # a tie at the max: argmax's first index wins in both
    assert make_sampler(temperature=1.0, top_k=1, seed=0)(tied) == greedy(tied) == 1


@pytest.mark.parametrize("kw", [
    {"temperature": 1.0, "top_p": 1e-300},  # top_p * total underflowed in float32: no token kept, an IndexError
    {"temperature": 1.0, "top_p": 5e-324},
    {"temperature": 5e-324, "top_p": 0.5},  # the temperature rounded to 0 in float32: NaN probabilities
    {"temperature": 5e-324},
    {"temperature": 1e-40, "top_k": 3},
    {"temperature": 1e-37, "min_p": 0.5},  # logits / temperature overflowed to inf
    {"temperature": 1e-38},
    {"temperature": 1e-30, "top_p": 1e-300, "min_p": 1e-300},
])
def test_extreme_valid_values_behave_like_greedy(kw: dict) -> None:
    g = torch.Generator().manual_seed(4)
    sample, greedy = make_sampler(seed=0, **kw), make_sampler()
    for scale in (1.0, 30.0):
        for _ in range(10):
            logits = torch.randn(300, generator=g) * scale
            assert sample(logits) == greedy(logits)


def test_a_tiny_temperature_draws_among_tied_maxima() -> None:
    tied = torch.tensor([0.0, 3.0, -math.inf, 3.0, 2.9999998])
    drawn = {make_sampler(temperature=5e-324, seed=s)(tied) for s in range(40)}
    assert drawn == {1, 3}  # the limit of softmax(x / T) as T -> 0: the tied maxima, evenly


def test_a_huge_temperature_is_uniform() -> None:
    counts = _draws(make_sampler(temperature=1e300, seed=5, top_p=0.99), torch.tensor([50.0, 0.0, -50.0, -1e30]),
                    n=4000)
    assert all(900 < counts.get(i, 0) < 1100 for i in range(4)), counts


def test_unfiltered_sampling_follows_softmax() -> None:
    counts = _draws(make_sampler(temperature=1.0, seed=3), LOGITS, n=4000)
    for i, p in enumerate(PROBS.tolist()):
        assert abs(counts[i] / 4000 - p) < 0.03


def test_top_k_and_top_p_filters() -> None:
    assert set(_draws(make_sampler(temperature=1.0, top_k=2, seed=4), LOGITS)) == {0, 1}
    # top_p 0.7: 0.5 alone is short of 0.7, 0.5 + 0.3 reaches it; the smallest such set is {0, 1}
    assert set(_draws(make_sampler(temperature=1.0, top_p=0.7, seed=5), LOGITS)) == {0, 1}
    assert set(_draws(make_sampler(temperature=1.0, top_p=0.85, seed=5), LOGITS)) == {0, 1, 2}
    # top_p is over what top_k kept: {0, 1} renormalized is 0.625 / 0.375, so 0.6 keeps token 0 alone
    assert set(_draws(make_sampler(temperature=1.0, top_k=2, top_p=0.6, seed=6), LOGITS)) == {0}


def _reference_filter(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> list[int]:
    # The textbook version: sort the whole vocabulary, cut three times.
    probs = torch.softmax(x, dim=-1)
    order = torch.sort(x, descending=True, stable=True).indices.tolist()
    if top_k > 0:
        order = order[:top_k]
    if top_p < 1.0:
        total, kept, mass = sum(probs[i].item() for i in order), [], 0.0
        for i in order:
            kept.append(i)
            mass += probs[i].item()
            if mass >= top_p * total:
                break
        order = kept
    return [i for i in order if probs[i] >= min_p * probs[order[0]]]


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # flat logits need the candidate set to grow past its start
@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 0.9, 0.0), (0, 0.5, 0.0), (0, 1.0, 0.05), (0, 1.0, 0.9),
                                                 (0, 0.95, 0.01), (40, 0.8, 0.0), (500, 1.0, 0.2), (3, 0.3, 0.5)])
def test_filter_matches_full_sort(scale: float, top_k: int, top_p: float, min_p: float) -> None:
    x = torch.randn(5000, generator=torch.Generator().manual_seed(11)) * scale
    ids, _ = _filter(x, top_k, top_p, min_p)
    ref = _reference_filter(x, top_k, top_p, min_p)
    # float32 vs python-float sums may move the top_p cut by one token at most
    assert ids.tolist()[: len(ref) - 1] == ref[:-1] and abs(len(ids) - len(ref)) <= 1


def test_min_p() -> None:
    # min_p 0.5 drops what is below 0.5 * 0.5 = 0.25: tokens 2 and 3
    assert set(_draws(make_sampler(temperature=1.0, min_p=0.5, seed=7), LOGITS)) == {0, 1}
    assert set(_draws(make_sampler(temperature=1.0, min_p=0.2, seed=7), LOGITS)) == {0, 1, 2}
    assert set(_draws(make_sampler(temperature=1.0, min_p=0.99, seed=7), LOGITS)) == {0}


def test_sampler_accepts_other_shapes_and_dtypes() -> None:
    logits = torch.randn(1, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    assert 0 <= make_sampler(temperature=0.7, top_p=0.9, seed=0)(logits) < 64
    assert make_sampler()(logits) == int(torch.argmax(logits))


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    transformers = pytest.importorskip("transformers")
    g = torch.Generator().manual_seed(10)
    logits = torch.randn(200, generator=g) * 3
    ids = torch.randint(0, 200, (60,), generator=g)  # repeats included
    (process,) = make_logits_processors(repetition_penalty=penalty)
    ref = transformers.RepetitionPenaltyLogitsProcessor(penalty)(ids[None], logits[None].clone())[0]
    assert torch.equal(process(ids.tolist(), logits), ref)
    # only the last 10 ids count with a context size
    processors = make_logits_processors(repetition_penalty=penalty, context_size=10)
    ref10 = transformers.RepetitionPenaltyLogitsProcessor(penalty)(ids[None, -10:], logits[None].clone())[0]
    assert torch.equal(apply_logits_processors(processors, ids, logits), ref10)


def test_repetition_penalty_off_and_empty_context() -> None:
    assert make_logits_processors() == []
    (process,) = make_logits_processors(repetition_penalty=2.0)
    logits = torch.randn(10)
    assert torch.equal(process([], logits), logits)


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": -1e-300}, "top_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"min_p": 1.0}, "min_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"seed": "x"}, "seed"),
    ],
)
def test_bad_sampler_parameters_name_themselves(kwargs: dict, name: str) -> None:
    with pytest.raises(RequestError, match=name):
        make_sampler(**kwargs)


@pytest.mark.parametrize("kwargs", [{"repetition_penalty": 0.0}, {"repetition_penalty": -1.0},
                                    {"repetition_penalty": 1.2, "context_size": 0}])
def test_bad_penalty_parameters(kwargs: dict) -> None:
    with pytest.raises(RequestError, match="repetition"):
        make_logits_processors(**kwargs)
