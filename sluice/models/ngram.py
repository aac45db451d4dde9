"""The numbers of qwen4_exp's hashed n-gram embeddings (PLESpec), from config.json alone: each head's prime table
size and offset, and each PLE layer's hash multipliers. Pure integers (no torch): the config's validation and the
plan compute them before any weight is read.

The scheme (transformers' Qwen4ExpTextNGramEmbedding, whose numbers a checkpoint's table is laid out by):

    head h of PLE layer i (global head g = i * n_heads + h) has vocab_g = the (g+1)-th prime >= base
    the layer's table holds its heads side by side (offset_h = sum of the earlier heads' sizes), rows padded up to
    a multiple of `divisor`
    multiplier_j of layer i = 2 * (splitmix64(seed + 10007 i + GAMMA (j + 1)) mod half) + 1, j < ngram_size, with
    half = (2^63 - 1) // vocab // 2: odd, and small enough that multiplier * token id stays below 2^63

Then a token's n-gram of order k hashes to (t0 m0 ^ t1 m1 ^ ... ^ t(k-1) m(k-1)) mod vocab_h + offset_h for each of
the order's heads (models/layers/ple.py computes that).
"""

from __future__ import annotations

MASK64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)
MIX1, MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
LAYER_STRIDE = 10007  # a prime: each PLE layer's seed
MAX_LONG = (1 << 63) - 1


def splitmix64(value: int) -> int:
    """One step of the splitmix64 generator's output function (value advanced by GAMMA first)."""
    value = (value + GAMMA) & MASK64
    value = ((value ^ (value >> 30)) * MIX1) & MASK64
    value = ((value ^ (value >> 27)) * MIX2) & MASK64
    return (value ^ (value >> 31)) & MASK64


def multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The hash multipliers of PLE layer `ple_index` (one per position in an n-gram, the current token's first)."""
    half = max(1, MAX_LONG // max(vocab_size, 1) // 2)
    base = seed + LAYER_STRIDE * ple_index
    return [2 * (splitmix64((base + GAMMA * (j + 1)) & MASK64) % half) + 1 for j in range(ngram_size)]


# deterministic Miller-Rabin bases for every n < 3.3e24 (far beyond the config's 2^31 cap)
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Exact primality (deterministic Miller-Rabin): the table sizes of a real config sit near 2e7, where trial
    division would take ~2,000 divisions per candidate."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= `start`."""
    out, n = [], max(start, 2)
    while len(out) < count:
        if is_prime(n):
            out.append(n)
        n += 1
    return out


def head_sizes(base: int, n_heads: int, n_layers: int) -> list[list[int]]:
    """Per PLE layer, per head: its table part's size (consecutive primes >= base over all layers' heads)."""
    primes = primes_from(base, n_heads * n_layers)
    return [primes[i * n_heads : (i + 1) * n_heads] for i in range(n_layers)]


def offsets(sizes: list[int]) -> list[int]:
    """Where each head's part starts in its layer's table."""
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out


def padded_rows(sizes: list[int], divisor: int) -> int:
    """A layer's table rows: its heads' parts, padded up to a multiple of `divisor`."""
    total = sum(sizes)
    return -(-total // divisor) * divisor
