"""The step's seam: how one optimizer step's microbatches run forward and backward.

`train_step` (trainer/step.py) fetches the step's microbatches and counts its tokens, then
hands them to a `ForwardBackward`, owned by the parallelism, and gets back this rank's summed
loss; the clipping, the guard and the optimizer step after it are the same for every layout.

`MicrobatchLoop`: each microbatch's forward and backward in turn with FSDP2's gradient sync set
per `training.gradient_accumulation_sync`, each split by its split strategy: `WholeSequences`,
or with context parallelism `ContextSplit` (context_parallel.py: each sequence split over the
cp ranks). `PipelineLoop` (pipeline.py): the step's microbatches through a pipeline schedule.
The loop does not change.
"""

from __future__ import annotations

import torch

from trainer.data.documents import MicrobatchDocuments
from trainer.distributed import log0, to_device
from trainer.health import faults, heartbeat
from trainer.models.common.loss import Loss
from trainer.models.common.moe import set_aux_scale, take_aux_loss
from trainer.models.common.mtp import future_labels
from trainer.parallel.context_parallel import ContextSplit
from trainer.parallel.fsdp import set_gradient_sync
from trainer.parallel.pipeline import PipelineLoop
from trainer.parallel.seam import ForwardBackward, Losses  # noqa: F401  (step.py imports them here)
from trainer.parallel.tp import sum_partial_grads


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

    Returns `Losses` (seam.py): this rank's loss sum / the global tokens, its z-loss term, the
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


def build_forward_backward(
    model: torch.nn.Module, loss_fn: Loss, cfg, *, parallel_dims, device: torch.device, loader=None
) -> ForwardBackward:
    """The seam for `cfg`'s parallelism: a pipeline schedule with pp > 1 (trainer/parallel/
    pipeline.py), context parallelism's loop with cp > 1 (context_parallel.py), else the
    microbatch loop."""
    common = dict(
        sync_mode=cfg.training.gradient_accumulation_sync,
        dp_size=parallel_dims.dp_size,
        device=device,
        documents=microbatch_documents(model, loader),
    )
    if parallel_dims.pp_enabled:
        return PipelineLoop(
            model,
            loss_fn,
            cfg,
            dp_size=parallel_dims.dp_size,
            device=device,
            documents=common["documents"],
            cp_mesh=parallel_dims.cp_mesh if parallel_dims.cp_enabled else None,
        )
    if parallel_dims.cp_enabled:
        split = ContextSplit(parallel_dims.cp_mesh, cfg.training.seq_len, device, cfg.model)
        log0(split.describe())
        return MicrobatchLoop(model, loss_fn, split=split, **common)
    return MicrobatchLoop(model, loss_fn, **common)


def microbatch_documents(model: torch.nn.Module, loader) -> MicrobatchDocuments | None:
    """Which document ids a training microbatch needs (None: none): the model's when it keeps
    documents apart (`uses_documents`); the window's for the MTP targets when documents apply
    to them (trainer/models/common/mtp.py): the model keeps documents apart, or the data masks the
    targets that start one (data.predict_document_start = false)."""
    if loader is None:
        return None
    keeps_apart = getattr(model, "uses_documents", False)
    mtp = model.args.mtp_layers > 0 and (
        keeps_apart or not getattr(loader, "predict_document_start", True)
    )
    if not (keeps_apart or mtp):
        return None
    return MicrobatchDocuments(
        loader.document_ids, getattr(loader, "delimiters", None), model=keeps_apart, mtp=mtp
    )


def forward_only_split(cfg, *, parallel_dims, device: torch.device):
    """Context parallelism's split for forward-only passes (validation and evals: each cp
    rank scores its share of every sequence, trainer/evals/; a pipeline's stages attend
    through it too), or None without cp."""
    if not parallel_dims.cp_enabled:
        return None
    return ContextSplit(parallel_dims.cp_mesh, cfg.training.seq_len, device, cfg.model)
