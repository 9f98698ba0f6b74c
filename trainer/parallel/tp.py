"""Tensor parallelism with sequence parallelism (Megatron-LM's layout, as torchtitan applies it)
over the `tp` dimension of the world mesh.

Per block:
- attention: `wq`, `wk`, `wv` colwise (each tp rank computes n_heads / tp query heads and
  n_kv_heads / tp key/value heads, whole heads), `wo` rowwise;
- feed-forward: `w1`, `w3` colwise (hidden_dim / tp each), `w2` rowwise;
- a MoE feed-forward: data parallel over tp, each rank routing its own sequence shard
  (`_moe_style`; its router's and shared experts' gradients summed over tp once a step by
  `sum_partial_grads`, and its experts', unless ep splits them over ep x tp);
- `attention_norm`, `ffn_norm`: sequence parallel. Between the matmul regions the residual
  stream is sharded on the sequence ([b, s / tp, dim] per rank): the norms and residual adds
  run on 1/tp of the tokens, and instead of an all-reduce after `wo` and `w2` there is a
  reduce-scatter to the sequence shards, and an all-gather of the normed activations before
  `wq`/`wk`/`wv` and `w1`/`w3` (the same bytes as the one all-reduce, with 1/tp of the
  activation memory).
Around the blocks: the token embedding rowwise (vocab-sharded rows; its partial output is
reduce-scattered to sequence shards), the final norm sequence parallel, the output head colwise
(vocab-sharded, trainer/parallel/loss_parallel.py computes the loss from sharded logits). A
tied embedding serves as the head in the same (vocab-row) layout.

Float8 (tensorwise) uses torchao's float8 TP styles for the block linears, so the all-gathered
activations travel in float8. Async TP (`enable_async_tensor_parallel`, CUDA with compile)
turns on Inductor's micro-pipelining of the all-gather/reduce-scatter with the matmuls over
symmetric memory.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from trainer.health import heartbeat
from trainer.models import registry
from trainer.models.common.decoder import Transformer


def apply_tp(
    model: Transformer, tp_mesh, *, float8_tensorwise: bool = False, async_tp: bool = False
) -> None:
    """Shard `model` (on meta, before AC, compile and FSDP) over the 1-D `tp_mesh`."""
    # A pipeline stage's pruned model (trainer/parallel/pipeline.py) may lack either end.
    ends = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
    }
    parallelize_module(
        model, tp_mesh, {k: v for k, v in ends.items() if getattr(model, k) is not None}
    )
    # The embedding's output is its sequence shard as a view (DTensor.to_local). FSDP hooks
    # its backward on that output; a compiled first block replays the view, which drops the
    # hook (the embedding's gradient came out wrong under compile). A copy, [b, s/tp, dim],
    # is the block's own input. Registered before fully_shard, it runs before FSDP's hook.
    if model.tok_embeddings is not None:
        model.tok_embeddings.register_forward_hook(lambda module, args, out: out.clone())
    # A full gather of an FSDP x TP parameter (HF export, the weights digest) takes two
    # all-gathers, and torch warns on every rank for every parameter: one-off, not a step's.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    model.sequence_multiple = tp_mesh.size()  # sequence parallel: even sequence shards
    if model.output is not None:
        _shard_head(model.output, tp_mesh)
    colwise, rowwise, prepare_input = _styles(float8_tensorwise)
    for module in (model.mtp or {}).values():  # MTP: its input norms and projection
        _shard_mtp(module, tp_mesh)
    for block in model.blocks():
        ffn = (
            {"feed_forward": _moe_style(block.feed_forward, tp_mesh, model)}
            if hasattr(block.feed_forward, "router")
            else {
                "feed_forward": prepare_input(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": colwise(),
                "feed_forward.w2": rowwise(output_layouts=Shard(1)),
                "feed_forward.w3": colwise(),
            }
        )
        own = registry.hooks(model.args).tp_mixer_styles(
            block, tp_mesh, model, colwise, prepare_input
        )
        mixer, attention = own or (
            "attention",
            {
                # (x, cos, sin, mask): only x is sharded; the RoPE tables and mask are per rank
                "attention": prepare_input(
                    input_layouts=(Shard(1), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                "attention.wq": colwise(),
                "attention.wk": colwise(),
                "attention.wv": colwise(),
                **_qk_norm_styles(block),
            },
        )
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                **attention,
                f"{mixer}.wo": rowwise(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                **ffn,
            },
        )
    if async_tp:
        _enable_async_tp(tp_mesh)


class _SumGradOver(torch.autograd.Function):
    """Identity forward; the backward all-reduces the gradient over `group` (Megatron's
    copy-to-tensor-parallel-region)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


def sum_grad_over(x: torch.Tensor, group) -> torch.Tensor:
    return _SumGradOver.apply(x, group)


def _shard_mtp(module, tp_mesh) -> None:
    """An MTP module's norms and projection run on the sequence shards, as the blocks' norms:
    replicated weights whose gradients are summed over tp; its output norm hands the head a
    sequence-sharded DTensor, as the final norm does."""
    local = SequenceParallel(use_local_output=True)
    rows = SequenceParallel(sequence_dim=0, use_local_output=True)  # proj sees [b * s, 2 dim]
    parallelize_module(
        module,
        tp_mesh,
        {"embed_norm": local, "hidden_norm": local, "proj": rows, "norm": SequenceParallel()},
    )


def _qk_norm_styles(block) -> dict:
    """Qwen3's per-head q/k norms: a tp rank holds n_heads / tp heads of q and k, so each norm's
    input is sharded on the heads dim (2 of [b, s, heads, head_dim]). As DTensors replicated
    over tp their weight gradients are summed over every head (each rank alone would see its
    own heads' share and the replicas would drift apart), as torchtitan's Qwen3 plan does."""
    if block.attention.q_norm is None:
        return {}
    style = SequenceParallel(sequence_dim=2, use_local_output=True)
    return {"attention.q_norm": style, "attention.k_norm": style}


def _moe_style(moe, tp_mesh, model):
    """A MoE feed-forward (trainer/models/common/moe.py) is data parallel over tp: each tp rank
    routes its own sequence shard and runs the experts (or, under ep, dispatches its tokens
    to them) on plain tensors; no rank repeats another's routing, expert GEMMs, all-to-all or
    saved activations. Its router and shared experts (and without ep its experts) are
    replicated over tp, each rank's gradient holds its own tokens' part, and
    `sum_partial_grads` adds them up once per step; under ep the experts are split over the
    ep group, which takes in the tp ranks (1/ep of them per rank). The aux losses sum
    their statistics over the tp ranks first, so they are the whole microbatch's."""
    moe.token_group, moe.aux_shards = tp_mesh.get_group(), tp_mesh.size()
    partial = model.__dict__.setdefault("_tp_partial", [tp_mesh.get_group(), []])
    # The modules: FSDP replaces their parameters afterwards. Under ep the experts are split
    # over ep x tp (trainer/parallel/dims.py), not replicated over tp: the all-to-all's
    # backward already brings them every tp rank's tokens' share, nothing to sum.
    partial[1].extend(
        [moe]
        if moe.dispatcher is None
        else [m for m in (moe.router, moe.shared_experts) if m is not None]
    )
    return PrepareModuleInput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_output=True
    )


BUCKET_BYTES = 64 * 2**20  # the flat buffer of one all-reduce of small gradients


def sum_partial_grads(model) -> None:
    """After a step's backward: the gradients of parameters that tp ranks computed from their
    own sequence shards (the MoE feed-forwards) summed over tp. Gradient shards of at least
    BUCKET_BYTES are all-reduced in place; smaller ones in flat buckets of at most that size
    (one buffer of every gradient would be a temporary as large as all of them: 13.5 GiB at
    Qwen3-30B-A3B's shape, seen by the traced dry run)."""
    group, modules = model.__dict__.get("_tp_partial", (None, []))
    if modules:
        heartbeat.phase("tp_grads")
    bucket: list[torch.Tensor] = []
    for g in (
        p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        for m in modules
        for p in m.parameters()
        if p.grad is not None
    ):
        nbytes = g.numel() * g.element_size()
        if nbytes >= BUCKET_BYTES and g.is_contiguous():
            torch.distributed.all_reduce(g, group=group)
            continue
        if bucket and (
            bucket[0].dtype != g.dtype
            or sum(b.numel() * b.element_size() for b in bucket) + nbytes > BUCKET_BYTES
        ):
            _all_reduce_flat(bucket, group)
            bucket = []
        bucket.append(g)
    if bucket:
        _all_reduce_flat(bucket, group)


def _all_reduce_flat(grads: list[torch.Tensor], group) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    torch.distributed.all_reduce(flat, group=group)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def _shard_head(head: nn.Linear, tp_mesh) -> None:
    """The head's weight as a vocab-sharded (rows, Shard(0)) DTensor; its forward
    (trainer.models.common.decoder.project) handles the sequence-sharded input and the loss."""

    def partition(name, module, mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(
                distribute_tensor(param, mesh, [Shard(0)]), requires_grad=param.requires_grad
            )
            module.register_parameter(pname, sharded)

    distribute_module(head, tp_mesh, partition)


def _styles(float8_tensorwise: bool):
    """(colwise, rowwise, prepare-input) styles: torchao's float8 ones for tensorwise float8."""
    if not float8_tensorwise:
        return ColwiseParallel, RowwiseParallel, PrepareModuleInput
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def _enable_async_tp(tp_mesh) -> None:
    """Inductor's micro-pipelined TP (CUDA and compile only: checked in the config). The
    group's symmetric memory is enabled by hand where torch still asks for it
    (`enable_symm_mem_for_group`, torch <= 2.13); later versions enable it on first use."""
    import torch.distributed._symmetric_memory as symm_mem

    torch._inductor.config._micro_pipeline_tp = True
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(tp_mesh.get_group().group_name)
