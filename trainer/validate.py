"""Validation: the loss on a fixed set of held-out samples, every `validation.freq` steps.

The set is the first N = `validation.steps` x `validation.global_batch_size` samples of the
validation split's global order (the store's held-out tail, or synthetic samples from a stream
training never draws from). Each evaluation covers the same N samples, whatever the world size
or FSDP/HSDP layout:

    pass p, dp rank r: samples [p*B*dp + r*B, p*B*dp + (r+1)*B)   (B = validation.local_batch_size)

for p in range(ceil(N / (B*dp))). Every rank runs the same number of forward passes (FSDP
all-gathers in each), so samples past N are padding: read (a real window) but masked out of
the loss. The value is the token-weighted mean over the N samples, summed in float64 and
all-reduced once over the dp ranks.

It reads its own loader (never the training loader), samples no RNG and changes no parameter,
so a run with validation trains exactly as one without it.

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
import torch.nn.functional as F

from trainer.errors import DataError

IGNORE_INDEX = -100


class Validator:
    def __init__(self, cfg, *, train_loader, dp_rank: int, dp_size: int, dp_group,
                 device: torch.device, log=print):
        v = cfg.validation
        self.freq, self.dp_group, self.device, self.log = v.freq, dp_group, device, log
        self.batch, self.dp_rank, self.dp_size = v.local_batch_size, dp_rank, dp_size
        gbs = v.global_batch_size if v.global_batch_size != -1 else self.batch * dp_size
        self.n_samples = v.steps * gbs
        self.passes = -(-self.n_samples // (self.batch * dp_size))
        self.loader = validation_loader(cfg, train_loader, batch=self.batch, dp_rank=dp_rank,
                                        dp_size=dp_size)
        n_windows = getattr(self.loader, "n_windows", 0)
        if n_windows and self.n_samples > n_windows:
            raise DataError(
                f"the validation split holds {n_windows:,} windows of "
                f"{cfg.training.seq_len + 1} tokens, fewer than the {self.n_samples:,} samples "
                f"asked for (validation.steps {v.steps} x global_batch_size {gbs}); lower "
                "validation.steps or validation.global_batch_size, or raise data.val_fraction")
        self._cached = None
        if not hasattr(self.loader, "samples"):  # streamed: read once, reuse every time
            self._cached = [self.loader.next_microbatch() for _ in range(self.passes)]

    def describe(self) -> str:
        return (f"validation: {self.n_samples:,} held-out samples every {self.freq} steps and "
                f"at the last step ({self.passes} forward passes of {self.batch} per rank)")

    def due(self, step: int, last: bool) -> bool:
        return step % self.freq == 0 or last

    def _pass(self, p: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (inputs, labels) of pass p, labels masked past the N samples."""
        start = p * self.batch * self.dp_size + self.dp_rank * self.batch
        index = np.arange(start, start + self.batch, dtype=np.int64)
        valid = torch.from_numpy(index < self.n_samples)
        if self._cached is not None:
            inputs, labels = self._cached[p]
        else:
            inputs, labels = self.loader.samples(np.where(index < self.n_samples, index, 0))
        labels = labels.masked_fill(~valid[:, None], IGNORE_INDEX)
        return inputs, labels

    @torch.no_grad()
    def run(self, model) -> dict[str, float]:
        """Evaluate: {'validation_metrics/loss': ..., 'validation_metrics/perplexity': ...}."""
        t0 = time.monotonic()
        was_training = model.training
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # (loss, tokens)
        try:
            for p in range(self.passes):
                inputs, labels = self._pass(p)
                labels = labels.to(self.device)
                logits = model(inputs.to(self.device))
                token_loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                             ignore_index=IGNORE_INDEX, reduction="none")
                del logits
                sums[0] += token_loss.double().sum()
                sums[1] += (labels != IGNORE_INDEX).sum()
        finally:
            model.train(was_training)
        dist.all_reduce(sums, group=self.dp_group)
        loss = (sums[0] / sums[1]).item()
        ppl = math.exp(loss) if loss < 700 else math.inf
        self.seconds = time.monotonic() - t0
        return {"validation_metrics/loss": loss, "validation_metrics/perplexity": ppl}


def validation_loader(cfg, train_loader, *, batch: int, dp_rank: int, dp_size: int):
    """The held-out split's loader; a store already open for training is reused."""
    from trainer.data import build_dataloader
    from trainer.data.loader import StoreLoader

    kw = dict(seq_len=cfg.training.seq_len, local_batch_size=batch,
              global_batch_size=batch * dp_size, dp_rank=dp_rank, dp_size=dp_size,
              seed=cfg.job.seed)
    if isinstance(train_loader, StoreLoader):
        return StoreLoader(train_loader.store, split="validation",
                           val_fraction=cfg.data.val_fraction, shuffle=cfg.data.shuffle,
                           tokenizer_path=train_loader.tokenizer_path, **kw)
    return build_dataloader(cfg.data, split="validation", **kw)


def log_validation(step: int, values: dict[str, float], seconds: float, metrics, log) -> None:
    metrics.log_scalars(step, values)
    log(f"validation: step {step:>5}  loss {values['validation_metrics/loss']:8.4f}  "
        f"perplexity {values['validation_metrics/perplexity']:10.3f}  ({seconds:.2f}s)")
