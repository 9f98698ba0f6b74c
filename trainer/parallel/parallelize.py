"""Apply tensor parallelism, activation checkpointing, compile and data parallelism to a
meta-device model, then materialise and initialise it.

The order is fixed here, and it matters:
0. Pipeline parallelism prunes the model to this rank's stages (trainer/parallel/pipeline.py).
   Float8 swaps the blocks' linears, then tensor parallelism (trainer/parallel/tp.py) turns
   the parameters into DTensors on the `tp` mesh and installs its input/output redistributions
   as module hooks, which stay outside AC's and compile's wrapped forwards.
1. Activation checkpointing wraps each block's forward, so recomputation covers the whole block.
2. torch.compile compiles that (checkpointed) forward: the compiled graph includes the
   recompute policy, and FSDP's hooks stay outside the graph.
3. `fully_shard` (trainer/parallel/fsdp.py) bottom-up (each block, then the embedding, then the
   final norm + output head, then the root), so every group all-gathers and frees its own parameters
   around the compiled, checkpointed block.
4. `to_empty` on the device and the deterministic init. The optimizer is created afterwards,
   over the sharded (DTensor) parameters.
Both 1 and 2 replace the block's `forward` in place rather than wrapping the module, so
parameter names (and with them checkpoints and the seeded init) are the same in every mode.
"""

from __future__ import annotations

import functools

import torch
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from trainer.models.common.decoder import Transformer
from trainer.models.common.moe import moe_layers
from trainer.parallel import recompute
from trainer.parallel.expert_parallel import apply_ep
from trainer.parallel.float8 import apply_float8
from trainer.parallel.float8_moe import apply_float8_experts
from trainer.parallel.fsdp import DTYPE, apply_fsdp, set_gradient_sync  # noqa: F401  (re-exported)
from trainer.parallel.pipeline import split_model
from trainer.parallel.recompute import HostMemo
from trainer.parallel.tp import apply_tp

# Outputs worth keeping under op-level selective AC: the matmuls (float8's `_scaled_mm` too)
# and attention, whose recomputation costs FLOPs, and TP's reduce-scatters, whose
# recomputation would repeat a collective; everything else (norms, activations, RoPE) is cheap
# to recompute. block_causal attention (trainer/models/common/attention.py) is one of these SDPA ops
# (with a mask), or FlexAttention's higher-order op on CUDA, which selective checkpointing
# sees as one op too.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten._scaled_mm.default,
    torch.ops.aten.max.default,  # float8's amax: a scalar, and a reduction over a whole tensor
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
if hasattr(torch.ops.aten, "_grouped_mm"):  # MoE experts (trainer/models/common/moe.py)
    _SAVE_OPS.add(torch.ops.aten._grouped_mm.default)
# Expert parallelism's all-to-alls: recomputing them would repeat a collective.
for _ns in ("_c10d_functional", "_c10d_functional_autograd"):
    if hasattr(getattr(torch.ops, _ns), "all_to_all_single"):
        _SAVE_OPS.add(getattr(torch.ops, _ns).all_to_all_single.default)
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _SAVE_OPS.add(torch.ops.aten._scaled_dot_product_cudnn_attention.default)
if hasattr(torch.ops.higher_order, "flex_attention"):
    _SAVE_OPS.add(torch.ops.higher_order.flex_attention)
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default


# Profiler ranges are not computation. Under expert parallelism a block's experts are an FSDP
# group of their own inside the checkpointed block, and their hooks open a different number of
# ranges in the forward and in the recompute, which selective checkpointing's op count would
# take for a changed computation; it ignores them, as it does detach.
_IGNORED = [
    torch.ops.profiler._record_function_enter_new.default,
    torch.ops.profiler._record_function_exit._RecordFunction,
    torch.ops.profiler._record_function_exit.default,
]
if hasattr(torch.utils.checkpoint, "SAC_IGNORED_OPS"):
    torch.utils.checkpoint.SAC_IGNORED_OPS.update(_IGNORED)


def _op_level_context(every_other_matmul: bool):
    """A fresh policy per checkpointed block call: save the `_SAVE_OPS` outputs, with
    `every_other_matmul` only the odd-numbered `aten.mm` of the block (wq, wv, w1, w2:
    torchtitan's policy), counted apart in forward and in the recompute so both agree."""
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, op, *args, **kwargs):
        if op is torch.ops.aten.mm.default and every_other_matmul:
            mode = "recompute" if ctx.is_recompute else "forward"
            counts[mode] += 1
            keep = counts[mode] % 2 == 1
        elif op is _ALL_GATHER:  # context parallelism's K/V: saved (recompute.py)
            keep = args[2] in recompute.SAVED_GATHER_GROUPS
        else:
            keep = op in _SAVE_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def _checkpoint_forward(block: torch.nn.Module, context_fn=None) -> None:
    inner = block.forward
    kwargs = {"context_fn": context_fn} if context_fn else {}

    @functools.wraps(inner)
    def forward(*args):
        memo = HostMemo()  # the recompute replays what the forward exchanged (recompute.py)

        def run(*inputs):
            with memo.run():
                return inner(*inputs)

        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)

    block.forward = forward


def apply_ac(model: Transformer, mode: str, option: str, op_matmuls: str = "all") -> None:
    """full: recompute every block; selective 'op': keep matmul/attention outputs only (every
    matmul, or every other one: `op_matmuls`); selective k: recompute every k-th block in full
    (1 = every block)."""
    every_other = op_matmuls == "every_other"
    for i, block in enumerate(model.blocks()):
        if mode == "full":
            _checkpoint_forward(block)
        elif option == "op":
            _checkpoint_forward(block, functools.partial(_op_level_context, every_other))
        elif i % int(option) == 0:
            _checkpoint_forward(block)


def apply_compile(model: Transformer, mode: str = "default") -> None:
    """Compile each block's forward (identical blocks share the compiled code). No mode with
    CUDA graphs: FSDP frees and re-allocates the unsharded parameters' memory every step, so a
    graph would read a freed address."""
    for block in model.blocks():
        block.forward = torch.compile(block.forward, mode=None if mode == "default" else mode)


def parallelize(
    model: Transformer, parallel_dims, cfg, *, device: torch.device, param_dtype: str
) -> Transformer:
    """AC, compile and shard `model` (built on meta) per `cfg` (a JobConfig), then materialise
    and initialise it. `param_dtype` is the resolved compute dtype (trainer.device)."""
    shard_model(model, parallel_dims, cfg, device=device, param_dtype=param_dtype)
    materialize(model, cfg, device)
    model.init_weights(cfg.job.seed)
    return model


def shard_model(
    model: Transformer, parallel_dims, cfg, *, device: torch.device, param_dtype: str
) -> Transformer:
    """float8, TP, AC, compile and FSDP on the meta device: nothing is allocated yet. The traced
    dry run (trainer/plan/trace.py) calls this outside its fake-tensor mode (the meshes' own
    bookkeeping needs real tensors), then `materialize` inside it."""
    if parallel_dims.pp_enabled:  # this rank's stages only, before anything else
        split_model(model, cfg, parallel_dims.pp_mesh)
        model.activation_dtype = DTYPE[param_dtype]
    if cfg.float8.enable:  # before AC and compile wrap the blocks (trainer/parallel/float8.py)
        apply_float8(model, cfg.float8)
    if cfg.float8.moe:  # the experts' grouped GEMMs in float8 (trainer/parallel/float8_moe.py)
        apply_float8_experts(model, emulate=cfg.float8.moe_emulate)
    if parallel_dims.ep_enabled:  # the experts split over ep, before FSDP wraps them
        apply_ep(model, parallel_dims.ep_mesh)
    if parallel_dims.tp_enabled:
        apply_tp(
            model,
            parallel_dims.tp_mesh,
            float8_tensorwise=cfg.float8.enable and cfg.float8.recipe == "tensorwise",
            async_tp=cfg.parallelism.enable_async_tensor_parallel,
        )
    if parallel_dims.cp_enabled:  # each cp rank routes its own sequence shard
        for moe in moe_layers(model).values():
            moe.token_group = parallel_dims.token_group  # the aux losses' statistics
    if cfg.activation_checkpoint.mode != "none":
        ac = cfg.activation_checkpoint
        apply_ac(model, ac.mode, ac.selective_ac_option, ac.selective_op_matmuls)
    if cfg.compile.enable:
        apply_compile(model, cfg.compile.mode)
    offload = cfg.parallelism.fsdp_offload == "cpu"
    reshard = cfg.parallelism.fsdp_reshard_after_forward
    if parallel_dims.pp_enabled and reshard == "default":
        # Each pipeline microbatch's forward would all-gather again; and the zero-bubble
        # schedules' weight-gradient pass needs the forward's unsharded parameters.
        reshard = "never"
    # Under pp each stage is an FSDP root: the schedule drives its gradient sync.
    for root in model.pipeline_stages if parallel_dims.pp_enabled else [model]:
        apply_fsdp(
            root,
            parallel_dims.fsdp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=cfg.training.mixed_precision_reduce,
            reshard_after_forward=reshard,
            # Pinned host memory (fast, overlapped copies) exists only with CUDA; a CPU
            # run rejects offload (trainer.config.job), tests use it unpinned on CPU.
            offload=(CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else None),
            experts=(
                (parallel_dims.expert_fsdp_mesh, parallel_dims.expert_grad_divisor)
                if parallel_dims.ep_enabled
                else None
            ),
        )
    return model


def materialize(model: Transformer, cfg, device: torch.device) -> None:
    """Allocate the sharded parameters and the buffers (no values: `init_weights` follows).

    With `fsdp_offload = "cpu"` the sharded parameters live on the CPU (FSDP2 requires them
    materialised there; it pins them at its lazy init) while the RoPE buffers, which no FSDP
    group manages, are moved to the compute device by hand. The init draws its random values
    on the mesh's device either way (trainer.models.common.decoder), so offload starts from the
    same weights.
    """
    offload = cfg.parallelism.fsdp_offload == "cpu"
    model.to_empty(device="cpu" if offload else device)
    if offload:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                setattr(module, name, buf.to(device))
