"""FSDP2 (`fully_shard`) over the dp dimensions of the mesh: 1-D `dp_shard` for FSDP, 2-D
`(dp_replicate, dp_shard)` for HSDP. Under tensor parallelism the parameters are already
DTensors on the `tp` dimension; FSDP shards each tp shard further over dp (2-D parameters).
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def reshard_policy(policy: str) -> tuple[bool | int, bool]:
    """(blocks, head): what each group does with its unsharded params after forward.

    `default` reshards the blocks and embedding (memory) but keeps the norm + output head
    unsharded: its backward runs right after the forward, so re-gathering it would be waste.
    An integer N (ZeRO++ hpZ) reshards the blocks and embedding to groups of N ranks: each
    rank keeps 1/N of the params in the compute dtype until backward, whose all-gather then
    spans only N ranks (e.g. within a node); the head is kept as under `default`.
    """
    fixed = {"default": (True, False), "always": (True, True), "never": (False, False)}
    return fixed[policy] if policy in fixed else (int(policy), False)


def apply_fsdp(
    model: torch.nn.Module,
    mesh,
    *,
    param_dtype: str,
    reduce_dtype: str,
    reshard_after_forward: str,
    offload: OffloadPolicy | None = None,
    experts=None,
) -> None:
    """FSDP over a 1-D `dp_shard` mesh, or HSDP over the 2-D `(dp_replicate, dp_shard)` mesh,
    of a Transformer or a pipeline stage (the same attribute names, either end None).
    `offload`: e.g. CPUOffloadPolicy (sharded params, grads and optimizer state in host
    memory; the parameters must then be materialised on the CPU). `experts`: under expert
    parallelism, (the experts' mesh, the divisor): each block's experts are a group of their
    own over `efsdp` (x cp) whose gradients are divided by the whole dp size x cp (they hold
    the sum over every ep rank's tokens, the tp ranks' among them: ParallelDims.
    expert_grad_divisor), all-gathered with their block (explicit forward prefetch)."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPE[param_dtype], reduce_dtype=DTYPE[reduce_dtype])
    shard = functools.partial(
        fully_shard, mesh=mesh, mp_policy=mp, offload_policy=offload or OffloadPolicy()
    )
    blocks, head = reshard_policy(reshard_after_forward)
    mtp = list((getattr(model, "mtp", None) or {}).values())  # multi-token prediction
    for block in [*model.layers.values(), *(m.block for m in mtp)]:
        grouped = getattr(block.feed_forward, "experts", None)
        if experts is not None and grouped is not None:
            # The innermost dim's size (efsdp, or efsdp x cp); size(-1) fails on torch 2.11.
            efsdp = experts[0].size(experts[0].ndim - 1)
            shard(
                grouped,
                mesh=experts[0],
                reshard_after_forward=bool(blocks),
                shard_placement_fn=functools.partial(expert_placement, shards=efsdp),
            )
            grouped.set_gradient_divide_factor(float(experts[1]))
            if experts[0].device_type == "cpu" and efsdp > 1:
                # gloo has no PREMUL_SUM: sum, then divide. (Not with one efsdp rank: FSDP
                # then skips the reduce-scatter and, forced to sum, the division too.)
                grouped.set_force_sum_reduction_for_comms(True)
        shard(block, reshard_after_forward=blocks)
        if experts is not None and grouped is not None:
            # The experts' all-gather goes out with the block's, in its pre-forward: in their
            # own pre-forward it would wait for the dispatch's host sync (the split sizes).
            block.set_modules_to_forward_prefetch([grouped])
    for m in mtp:  # the rest of each MTP module: norms and projection, one group
        shard([m.embed_norm, m.hidden_norm, m.proj, m.norm], reshard_after_forward=head)
    if model.output is None and model.norm is not None:
        # Tied embeddings: the embedding is used first and last, so it stays in the root's
        # group, unsharded for the whole forward (a group of its own would be resharded).
        shard(model.norm, reshard_after_forward=head)
    else:  # a pipeline stage (trainer/parallel/pipeline.py) may lack either end
        if model.tok_embeddings is not None:
            shard(model.tok_embeddings, reshard_after_forward=blocks)
        if model.norm is not None and mtp:
            # MTP calls the head once per depth more than the norm: a group of both would
            # never see its last module finish on torch 2.11 (and stay sharded next forward).
            shard(model.norm, reshard_after_forward=head)
            shard(model.output, reshard_after_forward=head)
        elif model.norm is not None:
            shard([model.norm, model.output], reshard_after_forward=head)
    shard(model, reshard_after_forward=blocks)


def expert_placement(param: torch.nn.Parameter, shards: int):
    """FSDP's dim for a stacked [E/ep, ...] expert weight over `shards` efsdp ranks: the experts
    (dim 0) when they divide evenly, else the next dim. With fewer local experts than efsdp
    ranks, dim 0 would be padded in every all-gather and reduce-scatter (Qwen3-30B-A3B on 512
    GPUs at ep 8: 16 experts gathered as 64 rows, 4x the bytes); the width (768 there) divides."""
    from torch.distributed.tensor import Shard

    local = param.to_local() if hasattr(param, "to_local") else param
    if local.shape[0] % shards == 0 or local.dim() < 2 or local.shape[1] % shards:
        return Shard(0)
    return Shard(1)


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


def fsdp_param_groups(state) -> list:
    """An FSDP state's parameter groups: a list on torch 2.13+, one optional group before
    (torch 2.11's `_fsdp_param_group`)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [state._fsdp_param_group] if state._fsdp_param_group is not None else []
