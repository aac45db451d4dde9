"""Samplers and logits processors as small closures (the mlx-lm shape).

`make_sampler(...)` returns `logits [V] -> token id`; `make_logits_processors(...)` returns a list of
`(token ids so far, logits [V]) -> logits [V]` applied before sampling. Parameters are validated once, when the
closure is built, so a bad request fails before any compute.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from sluice.errors import RequestError

Sampler = Callable[[torch.Tensor], int]
# The seeds torch.Generator.manual_seed takes (a negative one wraps modulo 2**64); outside, it raises.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
LogitsProcessor = Callable[[Sequence[int] | torch.Tensor, torch.Tensor], torch.Tensor]


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_sampling(
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
) -> None:
    """Raise RequestError naming the first parameter outside its range."""
    if not (_is_number(temperature) and 0 <= temperature < math.inf):
        raise RequestError(f"temperature must be a finite number >= 0 (0 = greedy); got {temperature!r}")
    if not (_is_number(top_p) and 0 < top_p <= 1):
        raise RequestError(f"top_p must be in (0, 1]; got {top_p!r}")
    if not (isinstance(top_k, int) and not isinstance(top_k, bool) and top_k >= 0):
        raise RequestError(f"top_k must be an integer >= 0 (0 = off); got {top_k!r}")
    if not (_is_number(min_p) and 0 <= min_p < 1):
        raise RequestError(f"min_p must be in [0, 1); got {min_p!r}")
    if not (_is_number(repetition_penalty) and 0 < repetition_penalty < math.inf):
        raise RequestError(f"repetition_penalty must be a finite number > 0 (1 = off); got {repetition_penalty!r}")
    if seed is not None:
        if not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise RequestError(f"seed must be an integer or null; got {seed!r}")
        if not SEED_MIN <= seed <= SEED_MAX:
            shown = seed if abs(seed) < 10**30 else f"an integer of {seed.bit_length()} bits"
            raise RequestError(f"seed must be in [-2**63, 2**64 - 1] (64 bits); got {shown}")


def make_sampler(
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
) -> Sampler:
    """Build `sample(logits [V]) -> token id`.

    temperature 0 is greedy argmax (the other knobs are then moot). Otherwise the probabilities of
    `logits / temperature` are filtered by top_k (keep the k most likely), then top_p (keep the smallest set whose
    probability, renormalized over what top_k kept, reaches top_p), then min_p (drop tokens below min_p * the top
    probability); the most likely token always survives, whatever the values (top_p 1e-300, temperature 5e-324:
    one too small for float32 is taken at its limit, greedy). Draws come from a private CPU generator seeded with
    `seed`, so a seeded run repeats exactly whatever device produced the logits; seed None draws fresh entropy.
    """
    validate_sampling(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed)
    if temperature == 0:
        return _greedy

    gen = torch.Generator(device="cpu")
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    filtered = top_k > 0 or top_p < 1.0 or min_p > 0.0

    def sample(logits: torch.Tensor) -> int:
        x = _scaled(logits.detach().reshape(-1).to("cpu", torch.float32), temperature)  # [V]
        if not filtered:
            return _draw(torch.softmax(x, dim=-1), gen)
        ids, p = _filter(x, top_k, top_p, min_p)
        return int(ids[_draw(p, gen)])

    return sample


def _scaled(x: torch.Tensor, temperature: float) -> torch.Tensor:
    """`x / temperature`, or its limit where float32 cannot hold it.

    A temperature below ~1e-36 overflows x / temperature to inf (and softmax of inf is NaN), one below float32's
    smallest subnormal (1.4e-45) rounds to 0 (0 / 0). Then the distribution's limit is taken: the largest logits
    share all the probability (greedy, a tie drawn among the tied tokens). It is exact there: two float32 logits
    that differ at all differ by > 1e31 times such a temperature, and e^-1e31 is 0.
    """
    scaled = x / temperature
    if math.isfinite(float(scaled.max())):
        return scaled
    return torch.where(x == x.max(), 0.0, -math.inf)


def _filter(x: torch.Tensor, top_k: int, top_p: float, min_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens top_k, then top_p, then min_p keep from logits `x [V]`, most likely first: (ids [K], probs [K]).

    Probabilities are not renormalized; the draw does not need it.
    """
    probs = torch.softmax(x, dim=-1)  # [V]
    ids, p = _candidates(x, probs, top_k, top_p, min_p)  # [C], [C]
    if top_k > 0:
        ids, p = ids[:top_k], p[:top_k]
    if top_p < 1.0:
        # float64: top_p * total underflowed to 0 in float32 for top_p <= ~1e-45, and kept no token (IndexError)
        total = (p if top_k > 0 else probs).double().sum()  # top_p is a share of what top_k kept
        mass_before = torch.cumsum(p.double(), dim=-1) - p.double()  # mass of the strictly more likely tokens
        keep = max(1, int((mass_before < top_p * total).sum()))  # until the kept mass first reaches top_p
        ids, p = ids[:keep], p[:keep]
    if min_p > 0.0:
        keep = int((p >= min_p * p[0]).sum())  # p is sorted, so the survivors are a prefix
        ids, p = ids[:keep], p[:keep]
    return ids, p


# Why not sort all V logits: at V = 152k a full sort measured ~45 ms and torch.multinomial ~25 ms (2-core CPU), more
# than a decode step of a small model; topk + sorting a few hundred candidates + one uniform draw take ~1 ms.
_FIRST_CANDIDATES = 256


def _candidates(
    x: torch.Tensor, probs: torch.Tensor, top_k: int, top_p: float, min_p: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens, enough of them for the filters, sorted by probability (ties: lower id first).

    Grows the candidate set until it is certain to hold everything top_k / top_p / min_p could keep.
    """
    vocab = x.numel()
    m = min(vocab, top_k if top_k > 0 else _FIRST_CANDIDATES)
    while True:
        # Every token tied with the m-th value joins, so ties are broken by id below, as argmax does.
        ids = torch.nonzero(x >= torch.topk(x, m).values[-1]).reshape(-1)  # [C >= m], ascending ids
        ids = ids[torch.sort(x[ids], descending=True, stable=True).indices]
        p = probs[ids]  # [C]
        if top_k > 0 or len(ids) >= vocab:
            return ids, p
        # Done once an active filter's cutoff falls inside the candidates: every later token is dropped anyway.
        nucleus_inside = top_p < 1.0 and bool(p.sum() >= top_p * probs.sum())
        min_p_inside = min_p > 0.0 and bool(p[-1] < min_p * p[0])
        if nucleus_inside or min_p_inside:
            return ids, p
        m = min(vocab, m * 4)


def _draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """Index drawn with probability proportional to `p` (unnormalized, >= 0): one uniform and a binary search."""
    cdf = torch.cumsum(p.double(), dim=-1)  # float64: a float32 running sum over 152k terms drifts
    u = torch.rand((1,), generator=gen, dtype=torch.float64) * cdf[-1]
    return min(int(torch.searchsorted(cdf, u, right=True)), p.numel() - 1)


def _greedy(logits: torch.Tensor) -> int:
    return int(torch.argmax(logits.reshape(-1)))


def make_logits_processors(repetition_penalty: float = 1.0, context_size: int | None = None) -> list[LogitsProcessor]:
    """Build the logits processors for a request; an empty list when none is active.

    repetition_penalty is the CTRL penalty as in transformers' `RepetitionPenaltyLogitsProcessor`: for each id in
    the context (prompt + generated, or only the last `context_size` of them), a positive logit is divided by the
    penalty and a negative one multiplied, so > 1 discourages repeats whatever the logit's sign.
    """
    validate_sampling(repetition_penalty=repetition_penalty)
    if context_size is not None and not (isinstance(context_size, int) and context_size > 0):
        raise RequestError(f"repetition context_size must be an integer > 0 or None (all ids); got {context_size!r}")
    if repetition_penalty == 1.0:
        return []
    penalty = float(repetition_penalty)

    def repetition(tokens: Sequence[int] | torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        ids = torch.as_tensor(tokens, dtype=torch.long, device=logits.device).reshape(-1)  # [T]
        if context_size is not None:
            ids = ids[-context_size:]
        if ids.numel() == 0:
            return logits
        score = logits.gather(-1, ids)  # [T]; repeated ids gather the same value, so the scatter is consistent
        score = torch.where(score < 0, score * penalty, score / penalty)
        return logits.scatter(-1, ids, score)

    return [repetition]


def apply_logits_processors(
    processors: Sequence[LogitsProcessor], tokens: Sequence[int] | torch.Tensor, logits: torch.Tensor
) -> torch.Tensor:
    """Run `processors` in order over `logits [V]` given the ids so far."""
    for process in processors:
        logits = process(tokens, logits)
    return logits
