"""The step's seam: how one optimizer step's microbatches run forward and backward.

`train_step` (trainer/step.py) fetches the step's microbatches and counts its tokens, then
hands them to a `ForwardBackward`, owned by the parallelism, and gets back this rank's summed
loss; the clipping, the guard and the optimizer step after it are the same for every layout.

`MicrobatchLoop`: each microbatch's forward and backward in turn with FSDP2's gradient sync set
per `training.gradient_accumulation_sync`, each split by its split strategy: `WholeSequences`,
or with context parallelism `ContextSplit` (context_parallel.py: each sequence split over the
cp ranks). `PipelineLoop` (pipeline.py): the step's microbatches through a pipeline schedule.
The loop does not change. Both return `Losses`, defined here with the `ForwardBackward`
protocol they follow; forward_backward.py picks one for a run's layout.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from trainer.data.documents import MicrobatchDocuments
from trainer.distributed import to_device
from trainer.health import faults, heartbeat
from trainer.models.common.loss import Loss
from trainer.models.common.moe import set_aux_scale, take_aux_loss
from trainer.models.common.mtp import future_labels
from trainer.parallel.fsdp import set_gradient_sync
from trainer.parallel.tp import sum_partial_grads


class Losses(NamedTuple):
    loss_sum: torch.Tensor  # this rank's summed token loss / the step's global token count
    z_loss: torch.Tensor | None  # the z-loss term summed over this rank's tokens, or None
    aux: torch.Tensor | None = None  # MoE aux + router z terms, mean over microbatches, or None
    # the MTP heads' summed token loss (every depth) / the global token count, or None
    mtp: torch.Tensor | None = None


class ForwardBackward(Protocol):
    def __call__(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        global_tokens: torch.Tensor,
        step: int,
    ) -> Losses:
        """Run forward and backward over this rank's microbatches `(inputs, labels)` of one step;
        gradients accumulate in the model's parameters, ready for the optimizer."""


class WholeSequences:
    """The microbatch loop's split without context parallelism: each microbatch's whole
    sequences on this rank. ContextSplit (context_parallel.py) is the other: this rank's share
    of every sequence. Both give the loop the same three things."""

    share = 1  # the backward's extra scale (ContextSplit: cp)

    def forward(self, model, inputs, labels, loss_fn, doc_ids, window) -> torch.Tensor:
        """This rank's summed token loss of the microbatch. The model's head computes it
        (trainer/models/common/loss.py): no logits here. Document ids let the model mask and
        position per document, and keep the MTP targets in their documents."""
        depth = model.args.mtp_layers
        future = None if window is None else future_labels(labels, depth, window)
        return model(inputs, labels=labels, loss_fn=loss_fn, doc_ids=doc_ids, future=future)

    def after(self, loss_sum, z_loss, mtp):
        """The step's losses as every rank of the dp rank reports them (here: as they are)."""
        return loss_sum, z_loss, mtp


class MicrobatchLoop:
    """Forward and backward of each microbatch in turn (gradient accumulation), each
    microbatch split by `split` (WholeSequences, or context parallelism's ContextSplit).

    Each microbatch's loss is its summed token loss divided by the GLOBAL token count of the
    step. FSDP averages gradients over the dp ranks (dividing by the dp size: a custom divide
    factor needs PREMUL_SUM, which gloo lacks), so the backward loss is scaled by the dp size
    (and the split's share) to make the reduced gradient a plain sum: the result equals one
    large batch on any world size and any number of microbatches.

    Returns `Losses` (above): this rank's loss sum / the global tokens, its z-loss term, the
    MoE aux losses' mean over the microbatches, and the MTP loss sum / the global tokens.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        loss_fn: Loss,
        *,
        sync_mode: str,
        dp_size: int,
        device: torch.device,
        documents: MicrobatchDocuments | None = None,
        split=None,
    ):
        self.model, self.loss_fn, self.sync_mode = model, loss_fn, sync_mode
        self.dp_size, self.device = dp_size, device
        self.documents = documents  # (inputs, labels) -> document ids, with documents
        self.split = split or WholeSequences()

    def __call__(self, batches, global_tokens: torch.Tensor, step: int) -> Losses:
        loss_sum, aux = torch.zeros((), device=self.device), None
        set_aux_scale(self.model, 1.0 / len(batches))
        for i, (inputs, labels) in enumerate(batches):
            set_gradient_sync(self.model, self.sync_mode, is_last=i == len(batches) - 1)
            inputs, labels = to_device(inputs, self.device), to_device(labels, self.device)
            doc_ids, window = self.documents(inputs, labels) if self.documents else (None, None)
            heartbeat.phase("forward", step)
            loss = self.split.forward(self.model, inputs, labels, self.loss_fn, doc_ids, window)
            loss = loss / global_tokens
            if i == 0:
                faults.armed().first_forward(step)  # a testing hook; nothing unless asked
            heartbeat.phase("backward")
            # MoE's aux losses are means: FSDP's average over dp and 1 / microbatches; they
            # back-propagate from their blocks' outputs (trainer/models/common/moe.py). Under CP
            # they are the same on every cp rank (summed statistics).
            extra = take_aux_loss(self.model)
            if extra is not None:
                aux = extra / len(batches) if aux is None else aux + extra / len(batches)
            (loss * self.dp_size * self.split.share).backward()
            loss_sum += loss.detach()
        sum_partial_grads(self.model)  # tp ranks' shares of the MoE gradients (tp.py)
        loss_sum, z_loss, mtp = self.split.after(
            loss_sum, self.loss_fn.take_z_loss(), self.loss_fn.take_mtp_loss()
        )
        return Losses(loss_sum, z_loss, aux, None if mtp is None else mtp / global_tokens)
