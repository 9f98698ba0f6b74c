"""The global sample order: which window of a corpus is sample i, as a pure function of
(seed, epoch, i).

A per-epoch permutation is computed without materialising it: a keyed Feistel network is a
bijection on [0, 2^k), and cycle-walking restricts it to [0, n). Memory stays O(batch) for a
store of billions of windows (a materialised int64 permutation of 5e8 windows would take 4 GB
on every rank), and any rank can jump to any sample in O(1) on resume.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_ROUNDS = 6


def _splitmix64(x: int) -> int:
    """Scalar 64-bit mixer used to derive round keys from (seed, epoch)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(v: np.ndarray, key: np.uint64) -> np.ndarray:
    """Vectorised splitmix-style finalizer of (v xor key); uint64 arithmetic wraps by design."""
    x = v ^ key
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _round_keys(seed: int, epoch: int) -> list[np.uint64]:
    base = _splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64))
    keys, k = [], base
    for _ in range(_ROUNDS):
        k = _splitmix64(k)
        keys.append(np.uint64(k))
    return keys


def _feistel(x: np.ndarray, half_bits: int, keys: list[np.uint64]) -> np.ndarray:
    """One encryption of values in [0, 2^(2*half_bits)); a bijection of that range."""
    mask = np.uint64((1 << half_bits) - 1)
    shift = np.uint64(half_bits)
    left, right = x >> shift, x & mask
    for key in keys:
        left, right = right, left ^ (_mix(right, key) & mask)
    return (left << shift) | right


def permute(j: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """Position j of the seeded permutation of range(n) for this epoch (vectorised)."""
    if n <= 0:
        raise ValueError("permute needs n >= 1")
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    keys = _round_keys(seed, epoch)
    out = _feistel(np.asarray(j, dtype=np.uint64), half_bits, keys)
    bad = out >= np.uint64(n)
    while bad.any():  # cycle-walking: re-encrypt values outside [0, n) until they land inside
        out[bad] = _feistel(out[bad], half_bits, keys)
        bad = out >= np.uint64(n)
    return out.astype(np.int64)


def window_of_sample(
    samples: np.ndarray, n_windows: int, seed: int, shuffle: bool = True
) -> np.ndarray:
    """Window index of each global sample index: epoch = i // n, then a per-epoch permutation."""
    samples = np.asarray(samples, dtype=np.int64)
    epochs, pos = np.divmod(samples, n_windows)
    if not shuffle:
        return pos
    out = np.empty_like(pos)
    for epoch in np.unique(epochs):  # a batch spans at most a couple of epochs
        sel = epochs == epoch
        out[sel] = permute(pos[sel], n_windows, seed, int(epoch))
    return out


def permute_many(
    pos: np.ndarray, group: np.ndarray, epoch: np.ndarray, n_of: list[int], seed_of: list[int]
) -> np.ndarray:
    """`permute` for elements of several orders at once: element e is position pos[e] of the
    permutation of range(n_of[g]) with seed seed_of[g] in epoch epoch[e], g = group[e].
    Equal to calling `permute` per element (same keys and rounds), in one vectorised pass:
    a blend reads its sources' windows at the cost of one permutation, not one per source."""
    pos = np.asarray(pos, dtype=np.uint64)
    if len(pos) == 0:
        return pos.astype(np.int64)
    key = np.asarray(group, dtype=np.int64) * (1 << 40) + np.asarray(epoch, dtype=np.int64)
    combos, inverse = np.unique(key, return_inverse=True)
    keys = np.empty((len(combos), _ROUNDS), dtype=np.uint64)
    bits = np.empty(len(combos), dtype=np.uint64)
    sizes = np.empty(len(combos), dtype=np.uint64)
    for c, combo in enumerate(combos.tolist()):
        g, ep = divmod(combo, 1 << 40)
        n = n_of[g]
        keys[c] = _round_keys(seed_of[g], ep)
        bits[c] = max(1, ((n - 1).bit_length() + 1) // 2)
        sizes[c] = n
    keys, bits, sizes = keys[inverse], bits[inverse], sizes[inverse]
    out = _feistel_rows(pos, bits, keys)
    bad = out >= sizes
    while bad.any():  # cycle-walking, as in permute
        out[bad] = _feistel_rows(out[bad], bits[bad], keys[bad])
        bad = out >= sizes
    return out.astype(np.int64)


def _feistel_rows(x: np.ndarray, half_bits: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """_feistel with a half width and round keys per element (keys: [len(x), rounds])."""
    mask = (np.uint64(1) << half_bits) - np.uint64(1)
    left, right = x >> half_bits, x & mask
    for r in range(keys.shape[1]):
        left, right = right, left ^ (_mix(right, keys[:, r]) & mask)
    return (left << half_bits) | right
