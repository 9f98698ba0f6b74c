"""Apply data parallelism to a meta-device model, then materialise and initialise it.

Order matters and is fixed here: `fully_shard` bottom-up (each transformer block, then the
embedding, then the final norm + output head, then the root), so that every group all-gathers
and frees its own parameters; then `to_empty` on the device and the deterministic init. The
optimizer is created afterwards, over the sharded (DTensor) parameters.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from trainer.model import Transformer

DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reshard_policy(policy: str) -> tuple[bool, bool]:
    """(blocks, head): whether each group frees its unsharded params after forward.

    `default` reshards the blocks and embedding (memory) but keeps the norm + output head
    unsharded: its backward runs right after the forward, so re-gathering it would be waste.
    """
    return {"default": (True, False), "always": (True, True), "never": (False, False)}[policy]


def apply_fsdp(model: Transformer, mesh, *, param_dtype: str, reduce_dtype: str,
               reshard_after_forward: str) -> None:
    """FSDP over a 1-D `dp_shard` mesh, or HSDP over the 2-D `(dp_replicate, dp_shard)` mesh."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPE[param_dtype], reduce_dtype=DTYPE[reduce_dtype])
    blocks, head = reshard_policy(reshard_after_forward)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=blocks)
    fully_shard(model.tok_embeddings, mesh=mesh, mp_policy=mp, reshard_after_forward=blocks)
    fully_shard([model.norm, model.output], mesh=mesh, mp_policy=mp, reshard_after_forward=head)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=blocks)


def parallelize(model: Transformer, parallel_dims, cfg, *, device: torch.device) -> Transformer:
    """Shard `model` (built on meta) per `cfg` (a JobConfig), then materialise and initialise it."""
    apply_fsdp(model, parallel_dims.fsdp_mesh,
               param_dtype=cfg.training.mixed_precision_param,
               reduce_dtype=cfg.training.mixed_precision_reduce,
               reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward)
    model.to_empty(device=device)
    model.init_weights(cfg.job.seed)
    return model


def set_gradient_sync(model: FSDPModule, mode: str, is_last: bool) -> None:
    """Configure the gradient communication of the next microbatch's backward.

    last: no reduce-scatter until the last microbatch (unsharded grads accumulate locally).
    every: reduce-scatter (and all-reduce across replicas) every microbatch.
    hsdp_reduce_scatter: reduce-scatter every microbatch, all-reduce across replicas only on
    the last; without replicas it is the same as `every`.
    """
    if mode == "last":
        model.set_requires_gradient_sync(is_last)
    elif mode == "every":
        model.set_requires_gradient_sync(True)
    else:
        model.set_requires_gradient_sync(True)
        model.set_requires_all_reduce(is_last)
