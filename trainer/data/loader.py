"""Loaders with a global sample order: rank slicing, microbatches and resumable state.

Global batch s is samples [s*G, (s+1)*G); dp rank r takes the contiguous slice of G/dp samples
starting at s*G + r*G/dp and delivers it as G/(dp*B) consecutive microbatches of B samples. The
state is the global count of samples consumed at the last step boundary, which is the same on
every rank, so a checkpoint resumes exactly on any dp size or FSDP/HSDP layout. Subclasses only
say how to turn global sample indices into token windows (`_windows`).
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from trainer.data.documents import (
    Delimiters,
    WindowsOfDocuments,
    describe_documents,
    store_delimiters,
)
from trainer.data.order import window_of_sample
from trainer.errors import DataError


class GlobalOrderLoader(WindowsOfDocuments):
    """Base class: subclasses set `kind`, `vocab_size`, `tokenizer_path`, `fingerprint`,
    `n_windows` (0 = unbounded) and implement `_windows(indices) -> int array [n, seq_len+1]`.
    Those with documents set `delimiters` (trainer/data/documents.py), else `no_documents`
    says why there are none."""

    kind = "abstract"
    vocab_size: int
    tokenizer_path: str = ""
    fingerprint: str = ""
    n_windows: int = 0
    delimiters: Delimiters | None = None
    no_documents: str = ""

    def __init__(
        self,
        *,
        seq_len: int,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        predict_document_start: bool = True,
    ):
        assert dp_size >= 1 and 0 <= dp_rank < dp_size, (dp_rank, dp_size)
        assert global_batch_size % (local_batch_size * dp_size) == 0, (
            global_batch_size,
            local_batch_size,
            dp_size,
        )
        self.seq_len, self.seed = seq_len, seed
        self.local_batch_size, self.global_batch_size = local_batch_size, global_batch_size
        self.target_global_batch_size = global_batch_size  # a ramp's steps take fewer
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.per_rank = global_batch_size // dp_size
        self.accum_steps = self.per_rank // local_batch_size
        self.consumed = 0  # global samples consumed at the last step boundary
        self.micro = 0  # microbatches this rank delivered within the current step
        self.predict_document_start = predict_document_start

    # -- the interface the training loop calls -------------------------------------------
    def next_microbatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The next B samples of this rank's slice: (inputs, labels), int64 [B, seq_len]."""
        start = self.consumed + self.dp_rank * self.per_rank + self.micro * self.local_batch_size
        indices = np.arange(start, start + self.local_batch_size, dtype=np.int64)
        windows = torch.from_numpy(np.ascontiguousarray(self._fetch(indices), dtype=np.int64))
        self.micro += 1
        if self.micro == self.accum_steps:
            self.micro = 0
            self._step_done(self.consumed, self.consumed + self.global_batch_size)
            self.consumed += self.global_batch_size
        return self._split(windows)

    def set_global_batch_size(self, global_batch_size: int) -> None:
        """The global batch of the next step (a batch-size ramp): at a step boundary, on every
        rank alike. Sample i stays sample i: only how many the step takes changes."""
        if self.micro != 0:
            raise RuntimeError("set_global_batch_size mid-step")
        per_pass = self.local_batch_size * self.dp_size
        assert global_batch_size >= per_pass and global_batch_size % per_pass == 0, (
            global_batch_size,
            per_pass,
        )
        self.global_batch_size = global_batch_size
        self.per_rank = global_batch_size // self.dp_size
        self.accum_steps = self.per_rank // self.local_batch_size

    def skip_global_batch(self) -> None:
        """Consume the next global batch without delivering it (every rank alike, at a step
        boundary): the samples of one optimizer step are passed over, e.g. after a rollback."""
        if self.micro != 0:
            raise RuntimeError("skip_global_batch mid-step")
        self._step_done(self.consumed, self.consumed + self.global_batch_size)
        self.consumed += self.global_batch_size

    def samples(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of arbitrary global sample indices; does not move the loader
        (validation reads its fixed set of samples this way)."""
        windows = self._windows(np.asarray(indices, dtype=np.int64))
        return self._split(torch.from_numpy(np.ascontiguousarray(windows, dtype=np.int64)))

    def sample_indices(self, step: int) -> list[int]:
        """Global sample indices this rank sees in optimizer step `step` counted from now
        (for tests and debugging; does not advance the loader)."""
        start = self.consumed + step * self.global_batch_size + self.dp_rank * self.per_rank
        return list(range(start, start + self.per_rank))

    def state_dict(self) -> dict:
        """Plain-python state; identical on every rank. Only valid at a step boundary."""
        if self.micro != 0:
            raise RuntimeError(
                f"loader state taken mid-step ({self.micro} of "
                f"{self.accum_steps} microbatches delivered)"
            )
        epoch = self.consumed // self.n_windows if self.n_windows else 0
        return {
            "kind": self.kind,
            "samples_consumed": self.consumed,
            "seed": self.seed,
            "epoch": epoch,
            "seq_len": self.seq_len,
            "windows_per_epoch": self.n_windows,
            "fingerprint": self.fingerprint,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Resume at the saved global sample count; refuse states from another data setup."""
        self.consumed = self._checked_consumed(
            sd,
            (
                ("fingerprint", self.fingerprint),
                ("seq_len", self.seq_len),
                ("seed", self.seed),
                ("windows_per_epoch", self.n_windows),
            ),
            f"{self._where()} is a {self.kind!r} loader; resume with the data config it was "
            "saved with",
            "resume with the same store, seq_len, seed and val_fraction",
        )
        self.micro, self._plan = 0, None

    def _checked_consumed(self, sd, checks, other_kind: str, hint: str) -> int:
        """The saved samples_consumed, once the state is of this kind and `checks` (key,
        this run's value) all match; a DataError naming the first mismatch otherwise."""
        if not isinstance(sd, dict) or sd.get("kind") != self.kind:
            got = sd.get("kind") if isinstance(sd, dict) else type(sd).__name__
            raise DataError(f"checkpoint data state is for a {got!r} loader but {other_kind}")
        for key, mine in checks:
            if sd.get(key) != mine:
                raise DataError(
                    f"checkpoint data state has {key}={sd.get(key)!r} but "
                    f"{self._where()} has {key}={mine!r}; the saved sample order "
                    f"cannot be continued ({hint})"
                )
        consumed = sd.get("samples_consumed")
        if not isinstance(consumed, numbers.Integral) or consumed < 0:
            raise DataError(f"checkpoint data state has a bad samples_consumed={consumed!r}")
        return int(consumed)

    def describe(self) -> str:
        raise NotImplementedError

    def sample_ids(self, indices) -> list[str]:
        """Where each global sample comes from, for debugging ('' where not known)."""
        return ["" for _ in indices]

    def metrics(self) -> dict[str, float]:
        """Scalars for TensorBoard at log steps (e.g. a blend's tokens per source)."""
        return {}

    def pop_events(self) -> list[str]:
        """Lines worth a log line since the last call (e.g. a source starting a new epoch)."""
        return []

    # -- planning ahead -------------------------------------------------------------------
    def _fetch(self, indices: np.ndarray) -> np.ndarray:
        """Windows of this rank's next samples. Where a subclass separates locating windows
        (`_locations`) from reading them (`_read`), the locations of the rank's samples of the
        next steps (~PLAN_AHEAD samples) are computed in one vectorised pass: the order's
        arithmetic costs about the same for 8 or 256 samples."""
        windows = self._located(indices)
        top = int(windows.max()) if windows.size else 0
        if top >= getattr(self, "vocab_size", top + 1):
            raise DataError(
                f"token id {top} in samples {int(indices[0])}-{int(indices[-1])} "
                f"of {self._where()} is beyond its vocabulary of {self.vocab_size}: "
                "a damaged shard (data.verify_store = 'sizes' reads none of them); "
                "check it with data.verify_store = 'checksums' or re-prepare it"
            )
        return windows

    def _located(self, indices: np.ndarray) -> np.ndarray:
        if self.PLAN_AHEAD <= 0 or not hasattr(self, "_locations"):
            return self._windows(indices)
        plan = self._plan
        pos = None
        if plan is not None and plan[0][0] <= indices[0] and indices[-1] <= plan[0][-1]:
            pos = np.searchsorted(plan[0], indices)
            if not np.array_equal(plan[0][pos], indices):
                pos = None
        if pos is None:
            plan = self._plan = self._plan_from(int(indices[0]))
            pos = np.searchsorted(plan[0], indices)
        return self._read(plan[1][pos], plan[2][pos])

    def _plan_from(self, first: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(indices, sources, token starts) of this rank's samples from `first` (in the
        current step) to the end of its slice of a later step."""
        steps = max(1, min(self.PLAN_AHEAD // self.per_rank, 65536 // self.global_batch_size))
        slices = [
            np.arange(max(first, s), s + self.per_rank, dtype=np.int64)
            for s in (
                self.consumed + j * self.global_batch_size + self.dp_rank * self.per_rank
                for j in range(steps)
            )
        ]
        indices = np.concatenate(slices)
        return (indices, *self._locations(indices))

    # -- for subclasses -------------------------------------------------------------------
    PLAN_AHEAD = 256  # samples of this rank located at once (0: locate each microbatch)
    _plan = None

    def _step_done(self, before: int, after: int) -> None:
        """Called once per optimizer step, on every rank, as `consumed` moves to `after`."""

    def _windows(self, indices: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _where(self) -> str:
        return self.tokenizer_path or self.kind


class StoreLoader(GlobalOrderLoader):
    """Windows of seq_len+1 tokens from a token store, visited in the global order.

    The store's token stream is split once, independent of seq_len: the train split is the
    first (1 - val_fraction) of the tokens, validation the tail, so no validation token is ever
    trained on. Each split is cut into non-overlapping windows; sample i of the split is window
    permute(i mod n_windows) of epoch i // n_windows (trainer/data/order.py)."""

    kind = "store"

    def __init__(
        self, store, *, split: str, val_fraction: float, shuffle: bool, tokenizer_path: str, **kw
    ):
        super().__init__(**kw)
        self.store, self.split, self.shuffle = store, split, shuffle
        self.vocab_size, self.tokenizer_path = store.vocab_size, tokenizer_path
        total = store.total_tokens
        held_out = int(total * val_fraction)
        self.lo, self.hi = (0, total - held_out) if split == "train" else (total - held_out, total)
        self.n_windows = (self.hi - self.lo) // (self.seq_len + 1)
        if self.n_windows == 0:
            raise DataError(
                f"seq_len {self.seq_len} is longer than the corpus can fill: the {split} split "
                f"of store {store.path} has {self.hi - self.lo:,} tokens (val_fraction "
                f"{val_fraction} of {total:,}), fewer than one window of {self.seq_len + 1}; "
                "use a shorter seq_len or a bigger corpus"
            )
        # The order depends on shuffle too: a resume with it toggled would repeat and skip windows.
        self.fingerprint = f"{store.fingerprint}:{split}:shuffle={shuffle}"
        self.delimiters, self.no_documents = store_delimiters(
            store.manifest, f"token store {store.path}"
        )

    def _locations(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source 0, the token offset of each sample's window in the store)."""
        windows = window_of_sample(indices, self.n_windows, self.seed, self.shuffle)
        return np.zeros(len(indices), dtype=np.int64), self.lo + windows * (self.seq_len + 1)

    def _read(self, sources: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return self.store.read(starts, self.seq_len + 1)

    def _windows(self, indices: np.ndarray) -> np.ndarray:
        return self._read(*self._locations(indices))

    def _where(self) -> str:
        return str(self.store.path)

    def metrics(self) -> dict[str, float]:
        """A store at a URL: what this rank fetched and what its block cache holds."""
        cache = getattr(self.store, "cache", None)
        if cache is None:
            return {}
        return {
            "data_metrics/store_fetched_mib": cache.stats["fetched_bytes"] / (1 << 20),
            "data_metrics/store_requests": float(cache.stats["requests"]),
            "data_metrics/cache_evictions": float(cache.stats["evictions"]),
            "data_metrics/cache_used_mib": cache.used_bytes() / (1 << 20),
        }

    def describe(self) -> str:
        return (
            f"{self.store.describe()}, {self.split} split: {self.n_windows:,} windows of "
            f"{self.seq_len + 1} tokens; tokenizer {self.tokenizer_path} (vocab "
            f"{self.vocab_size}); dp rank {self.dp_rank}/{self.dp_size}" + describe_documents(self)
        )
