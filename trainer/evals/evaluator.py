"""The in-loop evaluator: downstream multiple-choice tasks every `eval.freq` steps.

Like the Validator (trainer/evals/validate.py), the result does not depend on the world size or
the FSDP/HSDP layout. Each task's requests (one per example and choice) are sorted by
length, longest first, and cut into blocks of B = `eval.local_batch_size`: block k holds the
same requests on any world size, and

    pass p, dp rank r: block p * dp + r          for p in range(ceil(n_blocks / dp))

so every rank runs the same number of forward passes (FSDP all-gathers in each); a rank
without a block in the last pass runs a one-token dummy batch whose result is dropped. Each
rank writes its requests' log-likelihoods into a float64 vector of every request of every
task (zeros elsewhere), and one all-reduce (SUM) gives every rank all of them; acc and
acc_norm follow on every rank alike. No RNG is drawn and no parameter changes, so a run
with evals trains exactly as one without.
"""

from __future__ import annotations

import time

import numpy as np
import torch
import torch.distributed as dist

from trainer.errors import ConfigError
from trainer.evals.scoring import build_requests, choice_metrics, padding_pass, score_batch
from trainer.evals.tasks import load_tasks


class Evaluator:
    def __init__(
        self,
        cfg,
        *,
        tokenizer_path: str,
        dp_rank: int,
        dp_size: int,
        dp_group,
        device: torch.device,
        loss_fn,
        context=None,
    ):
        """`loss_fn`: the chunked head's loss (trainer.models.common.loss.scoring_loss); `context`:
        context parallelism's split: each cp rank scores its share of every request."""
        from trainer.data.tokenizer import load_tokenizer

        e = cfg.eval
        if not tokenizer_path:
            raise ConfigError(
                f"eval.enable needs a tokenizer to encode the tasks, and "
                f"data.dataset = {cfg.data.dataset!r} has none"
            )
        self.freq, self.batch, self.device, self.loss_fn = (
            e.freq,
            e.local_batch_size,
            device,
            loss_fn,
        )
        self.dp_rank, self.dp_size, self.dp_group = dp_rank, dp_size, dp_group
        self.context = context
        self.tasks = load_tasks(e)
        tokenizer = load_tokenizer(tokenizer_path)
        self.pad_id = max(tokenizer.pad_id, 0)
        self.requests = [
            build_requests(t, tokenizer, cfg.training.seq_len, cfg.data.add_bos) for t in self.tasks
        ]
        self.offsets = np.cumsum([0] + [len(r) for r in self.requests])
        self.blocks = [_blocks(reqs, self.batch) for reqs in self.requests]
        self.seconds = 0.0

    def describe(self) -> str:
        tasks = ", ".join(
            f"{t.name} ({len(t.examples)} examples, {len(r)} sequences)"
            for t, r in zip(self.tasks, self.requests, strict=True)
        )
        passes = sum(-(-len(b) // self.dp_size) for b in self.blocks)
        split = "; each cp rank scores its share of every request" if self.context else ""
        return (
            f"eval: {tasks} every {self.freq} steps and at the last step ({passes} forward "
            f"passes of <= {self.batch} per rank{split})"
        )

    def due(self, step: int, last: bool) -> bool:
        return step % self.freq == 0 or last

    @torch.no_grad()
    def run(self, model) -> dict[str, float]:
        """{'eval/<task>/acc': ..., 'eval/<task>/acc_norm': ...} for every task."""
        t0 = time.monotonic()
        was_training = model.training
        model.eval()
        lls = torch.zeros(int(self.offsets[-1]), dtype=torch.float64, device=self.device)
        try:
            for t, blocks in enumerate(self.blocks):
                self._score_task(model, t, blocks, lls)
        finally:
            model.train(was_training)
        dist.all_reduce(lls, group=self.dp_group)
        lls_np = lls.cpu().numpy()
        out = {}
        for t, task in enumerate(self.tasks):
            m = choice_metrics(lls_np[self.offsets[t] : self.offsets[t + 1]], task.examples)
            out.update({f"eval/{task.name}/{k}": v for k, v in m.items()})
        self.seconds = time.monotonic() - t0
        return out

    def _score_task(self, model, t: int, blocks: list[np.ndarray], lls: torch.Tensor) -> None:
        reqs, base = self.requests[t], int(self.offsets[t])
        for p in range(-(-len(blocks) // self.dp_size)):
            k = p * self.dp_size + self.dp_rank
            if k >= len(blocks):  # padding: the same forward count on every rank
                padding_pass(
                    model, self.device, self.loss_fn, self.pad_id, self.batch, self.context
                )
                continue
            idx = blocks[k]
            scores = score_batch(
                model,
                [reqs[i] for i in idx],
                self.device,
                self.loss_fn,
                self.pad_id,
                self.batch,
                self.context,
            )
            lls[torch.from_numpy(idx + base).to(self.device)] = scores


def _blocks(requests, batch: int) -> list[np.ndarray]:
    """Request indices sorted by length (longest first, then by index), in blocks of batch."""
    order = sorted(range(len(requests)), key=lambda i: (-len(requests[i].tokens), i))
    order = np.array(order, dtype=np.int64)
    return [order[s : s + batch] for s in range(0, len(order), batch)]


def log_evals(step: int, values: dict[str, float], seconds: float, metrics, log) -> None:
    """TensorBoard/W&B scalars and one console line."""
    metrics.log_scalars(step, values)
    names = dict.fromkeys(tag.split("/")[1] for tag in values)
    parts = [
        f"{n} acc {values[f'eval/{n}/acc']:.4f} acc_norm {values[f'eval/{n}/acc_norm']:.4f}"
        for n in names
    ]
    log(f"eval: step {step:>5}  {'  '.join(parts)}  ({seconds:.2f}s)")
