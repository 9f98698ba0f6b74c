"""Which source each sample of a blend comes from: a deterministic low-discrepancy assignment.

Sample i of the global order is given to a source by a Kronecker (golden-ratio) sequence in
32-bit fixed point, mapped through the cumulative weights:

    u_i = (A * i + D) mod 2^32        A = 0x9E3779B9 (2^32 / golden ratio), D from the seed
    source(i) = the s whose interval [T_{s-1}, T_s) holds u_i,   T_s = round(2^32 * W_s)

with W_s the cumulative normalised weight of the sources sorted by name (so the order of the
tables in the TOML does not matter). The points u_i are spread evenly: over any stretch of n
consecutive samples each source gets w_s * n samples up to a few (the error grows like
log n), from the first few hundred samples on, unlike independent random draws whose error
grows like sqrt(n).

How many of the samples [0, n) went to a source is a closed form: the count of u_j below a
threshold T is a sum of floors, computed exactly with integers in O(log 2^32) steps
(`_floor_sum`), so any rank can find the position of any sample in its source's own order
without replaying the stream: the order stays a pure function of (seed, weights, i).
"""

from __future__ import annotations

import numpy as np

MODULUS = 1 << 32
MULTIPLIER = 0x9E3779B9  # round(2^32 * (sqrt(5) - 1) / 2): odd, the golden-ratio step


def _floor_sum(n: int, m: int, a: int, b: int) -> int:
    """sum_{j=0}^{n-1} floor((a*j + b) / m) for n >= 0, m >= 1, a >= 0, b >= 0 (exact)."""
    total = 0
    while True:
        if a >= m:
            total += (n - 1) * n // 2 * (a // m)
            a %= m
        if b >= m:
            total += n * (b // m)
            b %= m
        y_max = a * n + b
        if y_max < m:
            return total
        n, b, m, a = y_max // m, y_max % m, a, m


def _offset(seed: int) -> int:
    """D: a 32-bit offset from the seed (splitmix64), so different seeds interleave differently."""
    x = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (x ^ (x >> 31)) & (MODULUS - 1)


class Blend:
    """The assignment of global sample indices to named sources for one set of weights.

    `weights`: {name: weight >= 0}, not necessarily normalised; zero-weight sources get no
    samples. `names` is sorted; `index_of(i)` returns positions in `names`."""

    def __init__(self, weights: dict[str, float], seed: int):
        total = float(sum(weights.values()))
        if not weights or total <= 0 or min(weights.values()) < 0:
            raise ValueError(f"a blend needs non-negative weights with a positive sum: {weights}")
        self.names = sorted(weights)
        self.fractions = {n: weights[n] / total for n in self.names}
        cumulative = np.cumsum([self.fractions[n] for n in self.names])
        upper = [min(MODULUS, int(round(c * MODULUS))) for c in cumulative]
        upper[-1] = MODULUS
        self.upper = upper  # source s owns u in [upper[s-1], upper[s])
        self.lower = [0] + upper[:-1]
        self.offset = _offset(seed)
        self._upper_np = np.array(upper, dtype=np.uint64)

    def index_of(self, samples: np.ndarray) -> np.ndarray:
        """Position in `names` of the source of each global sample index (vectorised)."""
        i = np.asarray(samples, dtype=np.uint64)
        # uint64 products wrap mod 2^64, a multiple of 2^32: the low 32 bits are exact.
        u = (i * np.uint64(MULTIPLIER) + np.uint64(self.offset)) & np.uint64(MODULUS - 1)
        return np.searchsorted(self._upper_np, u, side="right").astype(np.int64)

    def _below(self, n: int, threshold: int) -> int:
        """#{j in [0, n): u_j < threshold}, via
        (x mod M < T) = floor(x/M) - floor((x-T+M)/M) + 1."""
        if threshold <= 0 or n <= 0:
            return 0
        m, a, d = MODULUS, MULTIPLIER, self.offset
        return _floor_sum(n, m, a, d) - _floor_sum(n, m, a, d + m - threshold) + n

    def count(self, name: str, n: int) -> int:
        """How many of the global samples [0, n) the source `name` receives."""
        if name not in self.fractions:
            return 0
        s = self.names.index(name)
        return self._below(n, self.upper[s]) - self._below(n, self.lower[s])

    def counts(self, n: int) -> dict[str, int]:
        return {name: self.count(name, n) for name in self.names}

    def first_sample_reaching(self, name: str, k: int, start: int, base: int) -> int | None:
        """The smallest global index i >= start such that base + count(start, i + 1) >= k,
        i.e. the sample at which the source has consumed k samples; None if it gets none."""
        if self.fractions.get(name, 0.0) <= 0:
            return None
        if base >= k:
            return start
        before = self.count(name, start)
        need = k - base
        lo, hi = start, start + max(2, int(need / self.fractions[name]) * 2 + 64)
        while self.count(name, hi) - before < need:  # widen until reached
            hi = start + 2 * (hi - start)
        while lo < hi:  # smallest i with count(start, i+1) >= need
            mid = (lo + hi) // 2
            if self.count(name, mid + 1) - before >= need:
                hi = mid
            else:
                lo = mid + 1
        return lo
