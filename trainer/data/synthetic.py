"""A deterministic, learnable token stream for tests and smoke runs (no tokenizer, no files).

Sample i is drawn from its own generator seeded with (seed, i), so the global order is a pure
function of the sample index. Each sample is a short pattern, walked on a fixed sparse Markov
chain over a small set of active tokens, repeated to fill the window. A tiny transformer sees
its loss fall quickly and in stages: from ln(vocab) to ln(#active) as it learns which tokens
occur, to ~ln(4) as it learns the chain's transitions, and towards 0 on repeats as it learns to
copy (induction heads).
"""

from __future__ import annotations

import numpy as np

from trainer.data.loader import GlobalOrderLoader

ACTIVE_TOKENS = 512  # tokens the chain visits (capped at the vocab)
SUCCESSORS = 4  # each token has this many possible next tokens
PERIOD = (8, 33)  # pattern length range [low, high)
_SALT = 0x5EED
_VALIDATION_STREAM = 0xE7A1


class SyntheticLoader(GlobalOrderLoader):
    kind = "synthetic"
    no_documents = (
        "data.dataset = 'synthetic' has no documents (each sample is one repeated "
        "pattern); use a token store, stdlib or a blend"
    )

    def __init__(self, *, vocab_size: int, split: str = "train", **kw):
        super().__init__(**kw)
        self.vocab_size = vocab_size
        self.fingerprint = f"synthetic-v1-vocab{vocab_size}"
        # Validation samples come from their own seed stream over the same Markov chain.
        self._stream = [] if split == "train" else [_VALIDATION_STREAM]
        rng = np.random.default_rng([_SALT, self.seed])
        n_active = min(ACTIVE_TOKENS, vocab_size)
        self.active = rng.permutation(vocab_size)[:n_active].astype(np.int64)
        self.successors = rng.integers(0, n_active, size=(n_active, SUCCESSORS))

    def _windows(self, indices: np.ndarray) -> np.ndarray:
        return np.stack([self._sample(int(i)) for i in indices])

    def _sample(self, index: int) -> np.ndarray:
        rng = np.random.default_rng([_SALT, self.seed, *self._stream, index])
        period = int(rng.integers(*PERIOD))
        choices = rng.integers(0, SUCCESSORS, size=period)
        state = int(rng.integers(0, len(self.active)))
        pattern = np.empty(period, dtype=np.int64)
        for k in range(period):
            pattern[k] = state
            state = int(self.successors[state, choices[k]])
        reps = -(-(self.seq_len + 1) // period)
        return self.active[np.tile(pattern, reps)[: self.seq_len + 1]]

    def describe(self) -> str:
        return (
            f"synthetic tokens: vocab {self.vocab_size}, {len(self.active)} active, "
            f"repeated Markov patterns; seq_len {self.seq_len}, dp rank "
            f"{self.dp_rank}/{self.dp_size}"
        )
