"""Apply activation checkpointing, compile and data parallelism to a meta-device model, then
materialise and initialise it.

The order is fixed here, and it matters:
1. Activation checkpointing wraps each block's forward, so recomputation covers the whole block.
2. torch.compile compiles that (checkpointed) forward: the compiled graph includes the
   recompute policy, and FSDP's hooks stay outside the graph.
3. `fully_shard` bottom-up (each block, then the embedding, then the final norm + output head,
   then the root), so every group all-gathers and frees its own parameters around the
   compiled, checkpointed block.
4. `to_empty` on the device and the deterministic init. The optimizer is created afterwards,
   over the sharded (DTensor) parameters.
Both 1 and 2 replace the block's `forward` in place rather than wrapping the module, so
parameter names (and with them checkpoints and the seeded init) are the same in every mode.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy,
                                    OffloadPolicy, fully_shard)
from torch.utils.checkpoint import (CheckpointPolicy, checkpoint,
                                    create_selective_checkpoint_contexts)

from trainer.float8 import apply_float8
from trainer.model import Transformer

DTYPE = {"bfloat16": torch.bfloat16, "float32": torch.float32}


# Outputs worth keeping under op-level selective AC: the matmuls and attention, whose
# recomputation costs FLOPs; everything else (norms, activations, RoPE) is cheap to recompute.
# block_causal attention (trainer/attention.py) is one of these SDPA ops (with a mask), or
# FlexAttention's higher-order op on CUDA, which selective checkpointing sees as one op too.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)
if hasattr(torch.ops.higher_order, "flex_attention"):
    _SAVE_OPS.add(torch.ops.higher_order.flex_attention)


def _save_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _op_level_context():
    return create_selective_checkpoint_contexts(_save_matmuls)


def _checkpoint_forward(block: torch.nn.Module, context_fn=None) -> None:
    inner = block.forward
    kwargs = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(inner)
    def forward(*args):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    block.forward = forward


def apply_ac(model: Transformer, mode: str, option: str) -> None:
    """full: recompute every block; selective 'op': keep matmul/attention outputs only;
    selective k: recompute every k-th block in full (1 = every block)."""
    for i, block in enumerate(model.layers.values()):
        if mode == "full":
            _checkpoint_forward(block)
        elif option == "op":
            _checkpoint_forward(block, _op_level_context)
        elif i % int(option) == 0:
            _checkpoint_forward(block)


def apply_compile(model: Transformer) -> None:
    """Compile each block's forward (identical blocks share the compiled code)."""
    for block in model.layers.values():
        block.forward = torch.compile(block.forward)


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


def apply_fsdp(model: Transformer, mesh, *, param_dtype: str, reduce_dtype: str,
               reshard_after_forward: str, offload: OffloadPolicy | None = None) -> None:
    """FSDP over a 1-D `dp_shard` mesh, or HSDP over the 2-D `(dp_replicate, dp_shard)` mesh.
    `offload`: e.g. CPUOffloadPolicy (sharded params, grads and optimizer state in host
    memory; the parameters must then be materialised on the CPU)."""
    mp = MixedPrecisionPolicy(param_dtype=DTYPE[param_dtype], reduce_dtype=DTYPE[reduce_dtype])
    shard = functools.partial(fully_shard, mesh=mesh, mp_policy=mp,
                              offload_policy=offload or OffloadPolicy())
    blocks, head = reshard_policy(reshard_after_forward)
    for block in model.layers.values():
        shard(block, reshard_after_forward=blocks)
    if model.output is None:
        # Tied embeddings: the embedding is used first and last, so it stays in the root's
        # group, unsharded for the whole forward (a group of its own would be resharded).
        shard(model.norm, reshard_after_forward=head)
    else:
        shard(model.tok_embeddings, reshard_after_forward=blocks)
        shard([model.norm, model.output], reshard_after_forward=head)
    shard(model, reshard_after_forward=blocks)


def parallelize(model: Transformer, parallel_dims, cfg, *, device: torch.device,
                param_dtype: str) -> Transformer:
    """AC, compile and shard `model` (built on meta) per `cfg` (a JobConfig), then materialise
    and initialise it. `param_dtype` is the resolved compute dtype (trainer.device).

    With `fsdp_offload = "cpu"` the sharded parameters live on the CPU (FSDP2 requires them
    materialised there; it pins them at its lazy init) while the RoPE buffers, which no FSDP
    group manages, are moved to the compute device by hand. The init draws its random values
    on the mesh's device either way (trainer.model), so offload starts from the same weights.
    """
    offload = cfg.parallelism.fsdp_offload == "cpu"
    if cfg.float8.enable:  # before AC and compile wrap the blocks (trainer/float8.py)
        apply_float8(model, cfg.float8)
    if cfg.activation_checkpoint.mode != "none":
        apply_ac(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_ac_option)
    if cfg.compile.enable:
        apply_compile(model)
    apply_fsdp(model, parallel_dims.fsdp_mesh,
               param_dtype=param_dtype,
               reduce_dtype=cfg.training.mixed_precision_reduce,
               reshard_after_forward=cfg.parallelism.fsdp_reshard_after_forward,
               # Pinned host memory (fast, overlapped copies) exists only with CUDA; a CPU
               # run rejects offload (trainer.config), tests use it unpinned on CPU meshes.
               offload=CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else None)
    model.to_empty(device="cpu" if offload else device)
    if offload:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, buf.to(device))
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
