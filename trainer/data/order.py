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


def window_of_sample(samples: np.ndarray, n_windows: int, seed: int,
                     shuffle: bool = True) -> np.ndarray:
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
