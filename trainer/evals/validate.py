"""Validation: the loss on a fixed set of held-out samples, every `validation.freq` steps.

The set is the first N = `validation.steps` x `validation.global_batch_size` samples of the
validation split's global order (the store's held-out tail, or synthetic samples from a stream
training never draws from); `global_batch_size = -1` means `validation.local_batch_size`, so
N is fixed by the config alone. Each evaluation covers the same N samples, whatever the world
size or FSDP/HSDP layout, and a run resumed on another world size continues the same curve:

    pass p, dp rank r: samples [p*B*dp + r*B, p*B*dp + (r+1)*B)   (B = validation.local_batch_size)

for p in range(ceil(N / (B*dp))). Every rank runs the same number of forward passes (FSDP
all-gathers in each), so samples past N are padding: read (a real window) but masked out of
the loss. The value is the token-weighted mean over the N samples, summed in float64 and
all-reduced once over the dp ranks.

A blend (`data.mix`) evaluates N samples of each source's held-out tail, every source listed
(a weight-0 source too): `validation_metrics/<name>/loss` and `/perplexity` per source, and
`validation_metrics/loss` over all of them, weighted by tokens (every source has N samples of
seq_len tokens, so it is the mean of the sources' losses).

It reads its own loaders (never the training loader), samples no RNG and changes no
parameter, so a run with validation trains exactly as one without it.

Under context parallelism each cp rank scores its share of every sequence (the training
step's split and attention, also through a pipeline's stages) and the sums add over cp.

A streamed HF source (`data.val_split`, no store) has no global order: each rank reads its
own stream, so its set depends on the dp size; the batches are read once and kept in memory,
so every evaluation still sees the same samples.
"""

from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.distributed as dist

from trainer.errors import DataError

IGNORE_INDEX = -100


class Validator:
    def __init__(
        self,
        cfg,
        *,
        train_loader,
        dp_rank: int,
        dp_size: int,
        dp_group,
        device: torch.device,
        loss_fn,
        log=print,
        context=None,
    ):
        """`loss_fn`: the chunked head's loss (trainer.models.common.loss.scoring_loss); `context`:
        context parallelism's split (trainer/parallel/context_parallel.py `ContextSplit`):
        each cp rank scores its share of every sequence, and the sums add over cp too."""
        v = cfg.validation
        self.loss_fn, self.context = loss_fn, context
        self.freq, self.dp_group, self.device, self.log = v.freq, dp_group, device, log
        self.batch, self.dp_rank, self.dp_size = v.local_batch_size, dp_rank, dp_size
        gbs = v.global_batch_size if v.global_batch_size != -1 else self.batch
        self.n_samples = v.steps * gbs
        self.passes = -(-self.n_samples // (self.batch * dp_size))
        # One set of N samples per source: {'': loader} for one source, {name: loader} for a
        # blend (each source's held-out tail; logged apart and token-weighted together).
        self.sets = validation_loaders(
            cfg, train_loader, batch=self.batch, dp_rank=dp_rank, dp_size=dp_size
        )
        for name, loader in self.sets.items():
            n_windows = getattr(loader, "n_windows", 0)
            if n_windows and self.n_samples > n_windows:
                where = f"data.mix source {name!r}: " if name else ""
                raise DataError(
                    f"{where}the validation split holds {n_windows:,} windows of "
                    f"{cfg.training.seq_len + 1} tokens, fewer than the {self.n_samples:,} "
                    f"samples asked for (validation.steps {v.steps} x global_batch_size {gbs}); "
                    "lower validation.steps or validation.global_batch_size, or raise "
                    "data.val_fraction"
                )
        self._cached = {}
        for name, loader in self.sets.items():
            if not hasattr(loader, "samples"):  # streamed: read once, reuse every time
                self._cached[name] = [loader.next_microbatch() for _ in range(self.passes)]

    def describe(self) -> str:
        what = f"{self.n_samples:,} held-out samples"
        if len(self.sets) > 1 or "" not in self.sets:
            what += f" of each source ({', '.join(self.sets)})"
        split = "; each cp rank scores its share of every sequence" if self.context else ""
        return (
            f"validation: {what} every {self.freq} steps and at the last step "
            f"({self.passes} forward passes of {self.batch} per rank"
            f"{' per source' if len(self.sets) > 1 else ''}{split})"
        )

    def due(self, step: int, last: bool) -> bool:
        return step % self.freq == 0 or last

    def _pass(self, name: str, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels) of pass p of a set, labels masked past the N samples."""
        start = p * self.batch * self.dp_size + self.dp_rank * self.batch
        index = np.arange(start, start + self.batch, dtype=np.int64)
        valid = torch.from_numpy(index < self.n_samples)
        if name in self._cached:
            inputs, labels = self._cached[name][p]
        else:
            inputs, labels = self.sets[name].samples(np.where(index < self.n_samples, index, 0))
        labels = labels.masked_fill(~valid[:, None], IGNORE_INDEX)
        return inputs, labels

    @torch.no_grad()
    def run(self, model) -> dict[str, float]:
        """Evaluate: {'validation_metrics/loss': ..., 'validation_metrics/perplexity': ...},
        and for a blend the same two per source (validation_metrics/<name>/loss, ...)."""
        t0 = time.monotonic()
        was_training = model.training
        model.eval()
        sums = torch.zeros(len(self.sets), 2, dtype=torch.float64, device=self.device)
        try:
            for i, name in enumerate(self.sets):
                for p in range(self.passes):
                    inputs, labels = self._pass(name, p)
                    labels, inputs = labels.to(self.device), inputs.to(self.device)
                    # as in training: the document ids drive block_causal masks and positions
                    doc_ids = self.sets[name].document_ids(inputs) if model.uses_documents else None
                    # the summed loss through the chunked head: no [tokens, vocab] logits
                    loss_sum, labels = self._score(model, inputs, labels, doc_ids)
                    sums[i, 0] += loss_sum.double()
                    sums[i, 1] += (labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
        dist.all_reduce(sums, group=self.dp_group)
        if self.context is not None:  # each cp rank scored its share of the sequences
            dist.all_reduce(sums, group=self.context.group)
        self.seconds = time.monotonic() - t0
        out = _loss_and_perplexity("validation_metrics", sums.sum(0))
        if "" not in self.sets:
            for i, name in enumerate(self.sets):
                out.update(_loss_and_perplexity(f"validation_metrics/{name}", sums[i]))
        return out

    def _score(self, model, inputs, labels, doc_ids) -> tuple[torch.Tensor, torch.Tensor]:
        """(the summed loss of the pass's tokens on this rank, their labels)."""
        if self.context is None:
            return model(inputs, labels, self.loss_fn, doc_ids=doc_ids), labels
        return self.context.run(model, inputs, labels, self.loss_fn, doc_ids)


def _loss_and_perplexity(prefix: str, sums: torch.Tensor) -> dict[str, float]:
    loss = (sums[0] / sums[1]).item()
    return {
        f"{prefix}/loss": loss,
        f"{prefix}/perplexity": math.exp(loss) if loss < 700 else math.inf,
    }


def validation_loaders(cfg, train_loader, *, batch: int, dp_rank: int, dp_size: int) -> dict:
    """{name: loader} of the held-out split(s); stores already open for training are reused."""
    from trainer.data import build_dataloader
    from trainer.data.build import mix_sources
    from trainer.data.loader import StoreLoader
    from trainer.data.mix_loader import MixLoader

    kw = dict(
        seq_len=cfg.training.seq_len,
        local_batch_size=batch,
        global_batch_size=batch * dp_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=cfg.job.seed,
    )
    docs = {"predict_document_start": cfg.data.predict_document_start}  # labels as in training
    if isinstance(train_loader, MixLoader):
        stores = {name: src.store for name, src in train_loader.sources.items()}
        return mix_sources(cfg.data, stores, split="validation", **kw, **docs)
    if isinstance(train_loader, StoreLoader):
        return {
            "": StoreLoader(
                train_loader.store,
                split="validation",
                val_fraction=cfg.data.val_fraction,
                shuffle=cfg.data.shuffle,
                tokenizer_path=train_loader.tokenizer_path,
                **kw,
                **docs,
            )
        }
    return {"": build_dataloader(cfg.data, split="validation", **kw)}


def log_validation(step: int, values: dict[str, float], seconds: float, metrics, log) -> None:
    metrics.log_scalars(step, values)
    per_source = [
        f"{tag.split('/')[1]} {value:.4f}"
        for tag, value in values.items()
        if tag.count("/") == 2 and tag.endswith("/loss")
    ]
    log(
        f"validation: step {step:>5}  loss {values['validation_metrics/loss']:8.4f}  "
        f"perplexity {values['validation_metrics/perplexity']:10.3f}  ({seconds:.2f}s)"
        + (f"  per source: {', '.join(per_source)}" if per_source else "")
    )
