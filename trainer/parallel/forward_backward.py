"""The step's seam for a run's layout: which `ForwardBackward` runs its microbatches (a
pipeline schedule, the microbatch loop with context parallelism's split, or the plain
microbatch loop), what document ids a microbatch needs, and the split forward-only passes use.
"""

from __future__ import annotations

import torch

from trainer.data.documents import MicrobatchDocuments
from trainer.distributed import log0
from trainer.models.common.loss import Loss
from trainer.parallel.context_parallel import ContextSplit
from trainer.parallel.microbatches import ForwardBackward, MicrobatchLoop
from trainer.parallel.pipeline import PipelineLoop


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
