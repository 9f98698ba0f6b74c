"""A blend of token stores in one global order, with stages that change the blend on resume.

Sample i of the blend (i counts every sample of the run, as for one store):
- its source is `Blend.index_of(i)` for the weights of the stage that holds i
  (trainer/data/blend.py: a low-discrepancy assignment, a pure function of seed, weights, i);
- it is the k-th sample that source receives, k = base_s + (samples of s in [stage start, i));
- which is window `permute(k mod n_s)` of the source's epoch k // n_s, in the source's own
  seeded order (trainer/data/order.py; the seed is derived from job.seed and the name).

A stage is (start sample, weights, base: each source's count at the start). A run starts in
stage 0 at sample 0 with every base 0. Resuming with other weights, or with a source added or
removed, starts a new stage at the resumed sample: every source continues at the k it had
reached, so no window of a source is seen twice within its epoch, whatever the stages. The
checkpoint records each source's consumption (and store fingerprint) and the stages so far;
a source left out of the config keeps its count in the checkpoint, to continue if it returns.

The state is identical on every rank and holds only global counts, so a blend resumes exactly
on any dp size or FSDP/HSDP layout, like a single store.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from trainer.data.blend import Blend
from trainer.data.documents import describe_documents
from trainer.data.loader import GlobalOrderLoader, StoreLoader
from trainer.data.order import permute_many, window_of_sample
from trainer.data.store import read_rows
from trainer.errors import DataError

MIX_HINT = "see docs/data.md, Blending sources"


def source_seed(seed: int, name: str) -> int:
    """The seed of one source's window order: a function of job.seed and its name alone."""
    return int(hashlib.sha256(f"{seed}:{name}".encode()).hexdigest()[:16], 16)


class MixLoader(GlobalOrderLoader):
    kind = "mix"

    def __init__(
        self, sources: dict[str, StoreLoader], weights: dict[str, float], tokenizer_path: str, **kw
    ):
        super().__init__(**kw)
        self.sources, self.tokenizer_path = sources, tokenizer_path
        self.vocab_size = next(iter(sources.values())).vocab_size
        self.delimiters, self.no_documents = _blend_delimiters(sources)
        self.weights = {n: float(w) for n, w in weights.items()}
        self.blend = Blend({n: w for n, w in self.weights.items() if w > 0}, self.seed)
        blended = [sources[n] for n in self.blend.names]  # tables by blend position
        self._n = np.array([s.n_windows for s in blended], dtype=np.int64)
        self._lo = np.array([s.lo for s in blended], dtype=np.int64)
        self._seeds = [s.seed for s in blended]
        self._stores = [s.store for s in blended]
        self._shuffle = blended[0].shuffle
        self.stage = {
            "start": 0,
            "weights": dict(self.blend.fractions),
            "base": {n: 0 for n in sources},
        }
        self.history: list[dict] = []  # earlier stages: {"start", "weights"}
        self.retired: dict[str, dict] = {}  # checkpointed sources not in this config
        self._events: list[str] = []
        self._reset_counts()

    # -- the order ---------------------------------------------------------------------
    def _stage_counts(self, i: int) -> np.ndarray:
        """Samples of each blended source in [stage start, i), by blend position: the closed
        form (a few exact integer sums); the loop keeps `_at_consumed` instead."""
        start = self.stage["start"]
        return np.array(
            [self.blend.count(n, i) - self.blend.count(n, start) for n in self.blend.names],
            dtype=np.int64,
        )

    def _reset_counts(self) -> None:
        self._plan = None  # planned locations belong to the stage they were computed in
        self._base = np.array([self.stage["base"][n] for n in self.blend.names], dtype=np.int64)
        self._at_consumed = self._stage_counts(self.consumed)

    def _counts_at(self, i: int) -> np.ndarray:
        """Stage counts at global index i; cheap for i inside the current step."""
        if self.consumed <= i <= self.consumed + self.global_batch_size:
            between = self.blend.index_of(np.arange(self.consumed, i, dtype=np.int64))
            return self._at_consumed + np.bincount(between, minlength=len(self._n))
        return self._stage_counts(i)

    def consumed_by_source(self, total: int | None = None) -> dict[str, int]:
        """Samples each configured source has delivered once `total` global samples (default:
        those consumed so far) are taken."""
        counts = self._base + self._counts_at(self.consumed if total is None else total)
        out = {n: self.stage["base"][n] for n in self.sources}
        out.update(zip(self.blend.names, counts.tolist(), strict=True))
        return out

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source position in blend.names, k within that source) of sorted global indices."""
        indices = np.asarray(indices, dtype=np.int64)
        if len(indices) == 0:
            return indices.copy(), indices.copy()
        if indices[0] < self.stage["start"] or np.any(np.diff(indices) <= 0):
            raise ValueError(
                f"indices must be increasing and in this stage (start "
                f"{self.stage['start']}): {indices[:8]}..."
            )
        lo, hi = int(indices[0]), int(indices[-1]) + 1
        if hi - lo > 1 << 22:  # scattered indices: the closed form, index by index
            which = self.blend.index_of(indices)
            k = np.array(
                [
                    self._base[w] + self._counts_at(i)[w]
                    for w, i in zip(which.tolist(), indices.tolist(), strict=True)
                ],
                dtype=np.int64,
            )
            return which, k
        which_all = self.blend.index_of(np.arange(lo, hi, dtype=np.int64))
        offsets = indices - lo
        which = which_all[offsets]
        first = self._base + self._counts_at(lo)
        k = np.empty(len(indices), dtype=np.int64)
        for s in np.unique(which).tolist():  # k = samples of s before the index, + first
            before = np.cumsum(which_all == s) - (which_all == s)
            sel = which == s
            k[sel] = first[s] + before[offsets[sel]]
        return which, k

    def _locations(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source position, token offset of the window in its store): one vectorised
        permutation for every source."""
        which, k = self._locate(indices)
        epoch, pos = np.divmod(k, self._n[which])
        window = (
            permute_many(pos, which, epoch, self._n.tolist(), self._seeds) if self._shuffle else pos
        )
        return which, self._lo[which] + window * (self.seq_len + 1)

    def _read(self, which: np.ndarray, starts: np.ndarray) -> np.ndarray:
        return read_rows(self._stores, which, starts, self.seq_len + 1)

    def _windows(self, indices: np.ndarray) -> np.ndarray:
        unique, inverse = np.unique(np.asarray(indices, dtype=np.int64), return_inverse=True)
        return self._read(*self._locations(unique))[inverse]  # _locate wants them increasing

    def sample_ids(self, indices) -> list[str]:
        """'name/epoch/window' of each global sample."""
        which, k = self._locate(np.asarray(indices, dtype=np.int64))
        ids = []
        for s, kk in zip(which.tolist(), k.tolist(), strict=True):
            src = self.sources[self.blend.names[s]]
            window = int(window_of_sample(np.array([kk]), src.n_windows, src.seed, src.shuffle)[0])
            ids.append(f"{self.blend.names[s]}/{kk // src.n_windows}/{window}")
        return ids

    # -- progress: epochs, metrics -----------------------------------------------------
    def _step_done(self, before: int, after: int) -> None:
        if before != self.consumed:  # not called by next_microbatch: recompute
            self._at_consumed = self._stage_counts(before)
        was = self._base + self._at_consumed
        step = self.blend.index_of(np.arange(before, after, dtype=np.int64))
        self._at_consumed = self._at_consumed + np.bincount(step, minlength=len(self._n))
        now = self._base + self._at_consumed
        for s, n in enumerate(self._n.tolist()):  # the source's k in [was, now) came this step
            name = self.blend.names[s]
            for epoch in range(max(1, -(-int(was[s]) // n)), (int(now[s]) - 1) // n + 1):
                self._events.append(
                    f"source {name!r} starts epoch {epoch} (all {n:,} of its "
                    f"windows seen {epoch} time{'s' if epoch > 1 else ''}; a new "
                    "permutation)"
                )

    def pop_events(self) -> list[str]:
        events, self._events = self._events, []
        return events

    def metrics(self) -> dict[str, float]:
        out = {}
        for name, k in self.consumed_by_source().items():
            out[f"data_metrics/tokens/{name}"] = float(k * self.seq_len)
            # the epoch of the source's latest sample (0 before its first)
            out[f"data_metrics/epoch/{name}"] = float(max(0, k - 1) // self.sources[name].n_windows)
        return out

    def describe(self) -> str:
        lines = [
            f"blend of {len(self.sources)} token stores, windows of {self.seq_len + 1} "
            f"tokens; tokenizer {self.tokenizer_path} (vocab {self.vocab_size}); dp rank "
            f"{self.dp_rank}/{self.dp_size}" + describe_documents(self)
        ]
        width = max(len(n) for n in self.sources)
        for name, src in self.sources.items():
            share = self.blend.fractions.get(name, 0.0)
            note = "" if share else "  (weight 0: not trained on, still validated)"
            lines.append(
                f"  {name:<{width}}  {share:6.1%}  {src.store.path}: "
                f"{src.store.total_tokens:,} tokens, {src.n_windows:,} train windows"
                f"{note}"
            )
        return "\n".join(lines)

    # -- checkpoint ----------------------------------------------------------------------
    def state_dict(self) -> dict:
        if self.micro != 0:
            raise RuntimeError(
                f"loader state taken mid-step ({self.micro} of "
                f"{self.accum_steps} microbatches delivered)"
            )
        counts = self.consumed_by_source()
        sources = dict(self.retired)
        for name, src in self.sources.items():
            sources[name] = {
                "fingerprint": src.fingerprint,
                "windows_per_epoch": src.n_windows,
                "samples": counts[name],
                "epoch": counts[name] // src.n_windows,
            }
        mix = {
            "stage": self.stage,
            "stages": [
                *self.history,
                {"start": self.stage["start"], "weights": self.stage["weights"]},
            ],
            "sources": sources,
        }
        # One JSON string: DCP loads a leaf whatever its content, while nested keys would only
        # load where the current config has them (a removed source would be lost).
        return {
            "kind": self.kind,
            "samples_consumed": self.consumed,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "mix": json.dumps(mix, sort_keys=True),
        }

    def _where(self) -> str:
        return "this blend"

    def load_state_dict(self, sd: dict) -> None:
        consumed = self._checked_consumed(
            sd,
            (("seq_len", self.seq_len), ("seed", self.seed)),
            "data.mix is a blend; a run started on one store cannot continue as a blend "
            "(start blends as a data.mix of one source, then add sources)",
            "resume with the same seq_len and job.seed",
        )
        saved = json.loads(sd["mix"])
        self._check_sources(saved["sources"])
        self.retired = {n: e for n, e in saved["sources"].items() if n not in self.sources}
        self.consumed, self.micro = consumed, 0
        old = saved["stage"]
        if _same_weights(old["weights"], self.blend.fractions):
            samples = {n: e["samples"] for n, e in saved["sources"].items()}
            self.stage = {
                "start": old["start"],
                "weights": dict(self.blend.fractions),
                "base": {n: old["base"].get(n, samples.get(n, 0)) for n in self.sources},
            }
            self.history = saved["stages"][:-1]
            self._reset_counts()
            return
        base = {n: saved["sources"].get(n, {}).get("samples", 0) for n in self.sources}
        self.stage = {"start": self.consumed, "weights": dict(self.blend.fractions), "base": base}
        self.history = saved["stages"]
        self._reset_counts()
        self._events.append(
            f"stage {len(self.history)} starts at sample {self.consumed:,}: "
            f"{_change(old['weights'], self.blend.fractions, self.retired)}; "
            "every source continues where it stopped"
        )

    def _check_sources(self, saved: dict) -> None:
        for name, entry in saved.items():
            src = self.sources.get(name)
            if src is None:
                continue
            saved_fp = str(entry.get("fingerprint"))
            if (
                saved_fp != src.fingerprint
                and saved_fp.split(":")[0] == src.fingerprint.split(":")[0]
            ):
                raise DataError(
                    f"data.mix source {name!r}: the checkpoint walked its windows "
                    f"with {saved_fp.split(':')[-1]}, this run with "
                    f"{src.fingerprint.split(':')[-1]}; resume with the "
                    "data.shuffle it was saved with"
                )
            if saved_fp != src.fingerprint:
                raise DataError(
                    f"data.mix source {name!r} reads {src.store.path}, which is not the store "
                    f"this checkpoint trained it on; a source's store cannot change under the "
                    f"same name: give the new store another name ({MIX_HINT})"
                )
            if entry.get("windows_per_epoch") != src.n_windows:
                raise DataError(
                    f"data.mix source {name!r}: its train split has {src.n_windows:,} windows "
                    f"here but {entry.get('windows_per_epoch')!r} in the checkpoint; resume with "
                    "the data.val_fraction and data.shuffle it was saved with"
                )


def _same_weights(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(abs(a[n] - b[n]) <= 1e-9 for n in a)


def _change(old: dict, new: dict, retired: dict) -> str:
    """'web 75.0% -> 25.0%, code 25.0% -> 75.0%, math new 10.0%, books dropped'."""
    parts = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a is None:
            parts.append(f"{name} new {b:.1%}" if b else f"{name} new (weight 0)")
        elif b is None:
            parts.append(f"{name} {a:.1%} -> {'removed' if name in retired else '0%'}")
        elif abs(a - b) > 1e-9:
            parts.append(f"{name} {a:.1%} -> {b:.1%}")
        else:
            parts.append(f"{name} {a:.1%}")
    return ", ".join(parts)


def _blend_delimiters(sources: dict[str, StoreLoader]):
    """(delimiters of a blend: those of every source together, why there are none): a source
    without any makes the whole blend document-less (its windows could not be split)."""
    found = None
    for name, src in sources.items():
        if src.delimiters is None:
            return None, f"data.mix source {name!r}: {src.no_documents}"
        found = src.delimiters if found is None else found.union(src.delimiters)
    return found, ""
