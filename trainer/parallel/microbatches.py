"""The step's seam: how one optimizer step's microbatches run forward and backward.

`train_step` (trainer/step.py) fetches the step's microbatches and counts its tokens, then
hands them to a `ForwardBackward`, owned by the parallelism, and gets back this rank's summed
loss; the clipping, the guard and the optimizer step after it are the same for every layout.

`MicrobatchLoop`: each microbatch's forward and backward in turn with FSDP2's gradient sync set
per `training.gradient_accumulation_sync`. `ContextParallelLoop` (context_parallel.py): the
same with each sequence split over the cp ranks. `PipelineLoop` (pipeline.py): the step's
microbatches through a pipeline schedule. The loop does not change.
"""

from __future__ import annotations

from typing import Callable

import torch

from trainer.distributed import to_device
from trainer.health import faults, heartbeat
from trainer.models.loss import Loss
from trainer.models.moe import set_aux_scale, take_aux_loss
from trainer.parallel.context_parallel import ContextParallelLoop, ContextSplit
from trainer.parallel.fsdp import set_gradient_sync
from trainer.parallel.pipeline import PipelineLoop
from trainer.parallel.seam import ForwardBackward, Losses  # noqa: F401  (step.py imports them here)
from trainer.parallel.tp import sum_partial_grads


class MicrobatchLoop:
    """Forward and backward of each microbatch in turn (gradient accumulation).

    Each microbatch's loss is its summed token loss divided by the GLOBAL token count of the
    step. FSDP averages gradients over the dp ranks (dividing by the dp size: a custom divide
    factor needs PREMUL_SUM, which gloo lacks), so the backward loss is scaled by the dp size to
    make the reduced gradient a plain sum: the result equals one large batch on any world size
    and any number of microbatches.
    """

    def __init__(self, model: torch.nn.Module, loss_fn: Loss, *, sync_mode: str, dp_size: int,
                 device: torch.device, document_ids: Callable | None = None):
        self.model, self.loss_fn, self.sync_mode = model, loss_fn, sync_mode
        self.dp_size, self.device = dp_size, device
        self.document_ids = document_ids  # inputs -> document ids, with documents (else None)

    def __call__(self, batches, global_tokens: torch.Tensor, step: int) -> Losses:
        loss_sum, aux = torch.zeros((), device=self.device), None
        set_aux_scale(self.model, 1.0 / len(batches))
        for i, (inputs, labels) in enumerate(batches):
            set_gradient_sync(self.model, self.sync_mode, is_last=i == len(batches) - 1)
            inputs, labels = to_device(inputs, self.device), to_device(labels, self.device)
            heartbeat.phase("forward", step)
            # The model's head computes the summed token loss (trainer/models/loss.py): no
            # logits here. Document ids let the model mask and position per document.
            loss = self.model(inputs, labels=labels, loss_fn=self.loss_fn,
                              doc_ids=self.document_ids(inputs) if self.document_ids else None)
            loss = loss / global_tokens
            if i == 0:
                faults.armed().first_forward(step)  # a testing hook; nothing unless asked
            heartbeat.phase("backward")
            # MoE's aux losses are means: FSDP's average over dp and 1 / microbatches; they
            # back-propagate from their blocks' outputs (trainer/models/moe.py)
            extra = take_aux_loss(self.model)
            if extra is not None:
                aux = extra / len(batches) if aux is None else aux + extra / len(batches)
            (loss * self.dp_size).backward()
            loss_sum += loss.detach()
        sum_partial_grads(self.model)  # tp ranks' shares of the MoE gradients (tp.py)
        mtp = self.loss_fn.take_mtp_loss()
        return Losses(loss_sum, self.loss_fn.take_z_loss(), aux,
                      None if mtp is None else mtp / global_tokens)


def build_forward_backward(model: torch.nn.Module, loss_fn: Loss, cfg, *, parallel_dims,
                           device: torch.device, loader=None) -> ForwardBackward:
    """The seam for `cfg`'s parallelism: a pipeline schedule with pp > 1 (trainer/parallel/
    pipeline.py), context parallelism's loop with cp > 1 (context_parallel.py), else the
    microbatch loop."""
    documents = getattr(model, "uses_documents", False) and loader is not None
    common = dict(sync_mode=cfg.training.gradient_accumulation_sync,
                  dp_size=parallel_dims.dp_size, device=device,
                  document_ids=loader.document_ids if documents else None)
    if parallel_dims.pp_enabled:
        return PipelineLoop(model, loss_fn, cfg, dp_size=parallel_dims.dp_size, device=device,
                            document_ids=common["document_ids"],
                            cp_mesh=parallel_dims.cp_mesh if parallel_dims.cp_enabled else None)
    if parallel_dims.cp_enabled:
        return ContextParallelLoop(model, loss_fn, cp_mesh=parallel_dims.cp_mesh,
                                   seq_len=cfg.training.seq_len, model_cfg=cfg.model, **common)
    return MicrobatchLoop(model, loss_fn, **common)


def forward_only_split(cfg, *, parallel_dims, device: torch.device):
    """Context parallelism's split for forward-only passes (validation and evals: each cp
    rank scores its share of every sequence, trainer/evals/; a pipeline's stages attend
    through it too), or None without cp."""
    if not parallel_dims.cp_enabled:
        return None
    return ContextSplit(parallel_dims.cp_mesh, cfg.training.seq_len, device, cfg.model)
