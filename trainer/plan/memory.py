"""A memory plan before launch: what one device will hold, and whether it fits.

    python -m trainer.plan --config configs/debug_model.toml --ngpu 8 [--nnodes 2] [--gpu h100]
        [--mfu 0.4] [--host-gib 2048] [--section.key value ...]

Everything is computed from the config and the model's shapes (built on the meta device), for
the rank holding the biggest shard (rank 0: FSDP2 gives it ceil(rows / shard) rows of every
tensor and pads the other ranks' storage to the same size). Bytes are per device.

The device's peak is the largest of five moments of a step; each is the resident state
(sharded fp32 parameters, AdamW states, buffers and inputs) plus what is live then:
- the loss: every saved activation and the loss region at its widest (eager: the fp32
  log-probabilities and their gradients; chunked: one chunk, dh and the fp32 dW; see
  `loss_region`), with the head's params kept unsharded from forward;
- the output head's backward: activations, the loss's gradients for it, the head's unsharded
  params, grads and reduce-scatter buffer, and the prefetched last block;
- the top block's backward: saved activations, one block recomputed under AC, one block's
  FSDP buffers;
- the end of backward (the embedding): the sharded gradients, the embedding's FSDP buffers;
- the optimizer step: every sharded gradient and the optimizer's temporaries.
Sharded gradients are None from `zero_grad(set_to_none=True)` until each group's backward, so they
are counted only from the end of backward on; with accumulation and gradient sync every microbatch,
the earlier microbatches' are held through every moment of the later ones. The formulas assume the
eager model in trainer/models/common/decoder.py with a flash/memory-efficient SDPA or, for
block_causal, compiled FlexAttention (no [seq, seq] score matrix; `attn_implementation = "sdpa"`
adds one [batch, 1, seq, seq] mask per microbatch, see trainer.models.common.attention.memory_bytes)
and the loss of trainer/models/common/loss.py; compiled blocks usually save less (Inductor fuses the
elementwise ops), so for `[compile] enable` the plan is an upper bound in practice. Each formula's
assumptions are in its function's docstring; tests/test_plan.py checks them against tensors measured
on CPU ranks.

With `parallelism.tensor_parallel_degree = tp > 1` (Megatron layout with sequence parallel,
trainer/parallel/): every matmul weight, the embedding and the head are split over tp and
each tp part is FSDP-sharded over dp_shard (1/(tp x dp_shard) per rank; RMSNorm weights,
replicated over tp, 1/dp_shard); the residual stream and the norms hold 1/tp of the sequence,
attention and the FFN 1/tp of the heads and width, and the loss 1/tp of the vocab
(trainer/plan/activations.py). What TP and FSDP send per step is trainer/plan/comm.py.

With `parallelism.fsdp_offload = "cpu"` the sharded state moves to host memory, which the
plan checks too (trainer/plan/host.py): per rank, times the ranks of a node. The printed
report and the command line are trainer/plan/report.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from trainer.config.job import JobConfig
from trainer.errors import ConfigError
from trainer.models import registry
from trainer.models.args import ModelArgs
from trainer.models.build import build_model
from trainer.models.common.attention import memory_bytes as attention_bytes
from trainer.models.flops import flops_per_token
from trainer.optim.muon import BUCKET_BYTES as muon_bucket_bytes
from trainer.optim.muon import takes_muon
from trainer.optim.optimizer import implementation
from trainer.plan.activations import (
    block_split,  # noqa: F401
    blocks_activations,
    cp_attention_bytes,
    cp_saved_layers,
    head_activations,
    loss_region,
    split_bytes,
)
from trainer.plan.host import CPU_PROCESS_GIB, host_memory, offload_staging
from trainer.plan.moe import (
    gathered,
    group_key,
    moe_layers,
    per_block,
    saved_dispatch_bytes,
    tp_splits,
)
from trainer.plan.pipeline import in_flight, rank_groups
from trainer.plan.planned import plan_args, resolve_vocab  # noqa: F401 (imported from here)

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "auto": 2}  # the plan is for GPUs: auto = bfloat16 there
FP32, INT64 = 4, 8


@dataclass(frozen=True)
class Gpu:
    name: (
        str  # as torch.cuda.get_device_name() reports it: looked up in trainer.models.flops' table
    )
    memory_gib: float  # total memory as nvidia-smi reports it (approximate; --gpu-mem-gib)


GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", 81559 / 1024),
    "h100-pcie": Gpu("NVIDIA H100 PCIe", 81559 / 1024),
    "h200": Gpu("NVIDIA H200", 143771 / 1024),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", 81920 / 1024),
    "a100-40gb": Gpu("NVIDIA A100-SXM4-40GB", 40960 / 1024),
    "l40s": Gpu("NVIDIA L40S", 46068 / 1024),
    "b200": Gpu("NVIDIA B200", 179.0),
}
CONTEXT_GIB = 1.5  # CUDA context, cuBLAS and NCCL workspaces: outside the caching allocator
FRAGMENTATION = 0.07  # caching-allocator rounding and fragmentation, as a share of the plan


# --------------------------------------------------------------------------- shapes


# resolve_vocab and plan_args live in trainer/plan/planned.py (pipeline.py reads them too)


# tp splits dim 0 (MLA: the up projections; its down projections are replicated)
COLWISE = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings", "wq_b", "wkv_b")
ROWWISE = ("wo", "w2")  # tp splits dim 1 (the matmul's input features)


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """One tp rank's part of parameter `name` (Megatron layout): wq/wk/wv/w1/w3 colwise and the
    output head colwise (rows split), wo/w2 rowwise (columns split), the embedding rowwise
    (vocab rows split); RMSNorm weights are replicated over tp (sequence parallel)."""
    module = name.split(".")[-2] if "." in name else name
    if tp == 1 or module not in COLWISE + ROWWISE:
        return shape
    dim = 0 if module in COLWISE else 1
    return tuple(n // tp if i == dim else n for i, n in enumerate(shape))


@functools.lru_cache(maxsize=16)
def muon_matrix(key: str, shape) -> bool:
    """Whether a parameter of FSDP group `key` takes Muon: a block's matrix, or an MTP
    module's (its group holds the projection and the norms)."""
    return takes_muon(key + ".w", shape) or (key.startswith("mtp.") and len(shape) >= 2)


def fsdp_groups(
    args: ModelArgs, tp: int = 1, ep: int = 1, shard: int = 1
) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes per FSDP group, as trainer.parallel.parallelize.apply_fsdp forms the groups:
    one per block, the embedding, and the final norm + output head. Built on meta: free.
    With tp > 1 each shape is one tp rank's part (`tp_local_shape`): FSDP shards that part
    over dp_shard (FSDP2's strided sharding of a colwise weight gives rank 0
    ceil(rows / tp / dp_shard) rows, as `shard_numel` counts on the tp-local shape). `shard`:
    the FSDP ranks (dp_shard x cp); under ep (ep_dp dp_shard ranks x tp, trainer/parallel/
    dims.py) the experts are a tp rank's 1/tp of them, sharded over shard / ep_dp ranks (efsdp x
    cp): a gather then brings 1/ep_dp of the tp-local shape (`gathered`)."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    ep_dp = ep // tp if ep > 1 else 1
    for name, p in build_model(args).named_parameters():
        shape = tuple(p.shape)
        key = group_key(name, args)
        if key.endswith(".experts") and ep > 1:
            shape = expert_shape((shape[0] // tp, *shape[1:]), ep_dp, shard // ep_dp)
        groups.setdefault(key, []).append(
            tp_local_shape(name, shape, tp) if tp_splits(name, args) else shape
        )
    return groups


def expert_shape(shape: tuple[int, ...], ep: int, efsdp: int) -> tuple[int, ...]:
    """A stacked [E, a, b] expert weight as FSDP shards it under ep (trainer/parallel/fsdp.py
    `expert_placement`): by experts when E / ep divides over efsdp, else by its second dim,
    which the plan counts as one [E * a, b] matrix (no padded rows either way)."""
    if len(shape) < 3 or (shape[0] // ep) % efsdp == 0 or shape[1] % efsdp:
        return shape
    return (shape[0] * shape[1], *shape[2:])


def shard_numel(shape: tuple[int, ...], shard: int) -> int:
    """Elements of rank 0's shard: FSDP2 splits dim 0 like torch.chunk, ceil(rows / shard)."""
    return math.ceil(shape[0] / shard) * math.prod(shape[1:])


def gathered_numel(shapes, shard: int) -> int:
    """Elements of a group's all-gather output: every tensor padded to shard * ceil(rows/shard)."""
    return sum(shard * shard_numel(s, shard) for s in shapes)


# --------------------------------------------------------------------------- the plan


def memory_plan(cfg: JobConfig, world_size: int, pp_rank: int | None = None) -> dict[str, int]:
    """Bytes per device by category, for rank 0 (the largest shard), and the peak `total`.
    Under pipeline parallelism: for pp rank `pp_rank` (its stages' parameters, the
    activations of the pipeline microbatches it holds at once: trainer/plan/pipeline.py), or
    with None the pp rank of the largest total, with every rank's in `pp_rank_totals`.

    Resident: `parameters`, `gradients` (fp32, sharded over dp_shard; replicated over dp_replicate
    under HSDP; with tp > 1 each rank holds the dp_shard shard of its tp part, see `fsdp_groups`:
    the matmul weights are 1/(tp x dp_shard), the norms 1/dp_shard), `optimizer_state` (AdamW's
    exp_avg and exp_avg_sq like the parameters, plus one fp32 step scalar per tensor),
    `buffers_and_inputs` (the fp32 RoPE tables and the int64 inputs, labels and, for block_causal,
    document ids). Per microbatch: `activations` (the configured AC mode; `activations_no_ac` and
    `activations_full_ac` for comparison; all include the final norm and head input, and
    `attention_inputs`: the block-causal mask and document RoPE tables,
    trainer.models.common.attention.memory_bytes), `ac_recompute` (one block's full activations
    while it is recomputed), `logits_loss`. Transient: `fsdp_*` (see `fsdp_buffers`), `tp_buffers`
    (with TP, two whole-sequence [tokens, dim] tensors around a block's backward collectives),
    `grad_accumulation` (unsharded grads kept between microbatches when sync is 'last' with
    accumulation: FSDP2 keeps them in the reduce dtype), `optimizer_step_temp` (foreach AdamW
    computes sqrt(exp_avg_sq) for all tensors at once: one fp32 copy of the shard; for-loop: two of
    the largest tensor; fused: none). `peak_*`: the device total at each moment in the module
    docstring; `total` the max.
    """
    pd, accum = cfg.resolve(world_size)
    if pd.pp_enabled and pp_rank is None:
        plans = [memory_plan(cfg, world_size, rank) for rank in range(pd.pp)]
        worst = max(plans, key=lambda plan: plan["total"])
        return {**worst, "pp_rank_totals": [plan["total"] for plan in plans]}
    vocab, _ = resolve_vocab(cfg)
    a = plan_args(cfg, vocab)
    # Under CP, FSDP shards over dp_shard x cp and a rank holds 1/cp of each sequence.
    groups, shard, tp, cp = (
        fsdp_groups(a, pd.tp, pd.ep, pd.dp_shard * pd.cp),
        pd.dp_shard * pd.cp,
        pd.tp,
        pd.cp,
    )
    p, r = BYTES[cfg.training.mixed_precision_param], BYTES[cfg.training.mixed_precision_reduce]
    batch, seq = cfg.training.local_batch_size, cfg.training.seq_len
    held, blocks_a, head = 1.0, a, True
    if pd.pp_enabled:  # this rank's stages; activations per pipeline microbatch, held ones
        groups = rank_groups(groups, cfg, pp_rank)
        held, head = in_flight(cfg, pp_rank), "head" in groups
        blocks_a = dataclasses.replace(a, n_layers=sum(k.startswith("layers.") for k in groups))
        batch = cfg.parallelism.pipeline_parallel_microbatch_size
    tokens = batch * seq // cp
    shapes = [s for g in groups.values() for s in g]
    b = {"parameters": FP32 * sum(shard_numel(s, shard) for s in shapes)}
    b["gradients"] = b["parameters"]
    b["optimizer_state"] = optimizer_state_bytes(cfg, groups, shard)
    documents = a.attn_mask_type != "causal" or a.positions != "sequence"
    b["buffers_and_inputs"] = (
        2 * FP32 * a.max_seq_len * (a.head_dim // 2)  # + document ids
        + (2 + documents) * INT64 * cfg.training.local_batch_size * seq
    )

    head_act = head_activations(a, p, tokens, tp) if head else 0
    # the block-causal mask and per-document RoPE tables, once per microbatch (all layers)
    # (under CP: its own mask over [seq / cp, seq], and each layer's gathered K/V, `cp_kv`)
    b["attention_inputs"], kv = (
        (attention_bytes(a, batch, seq, p), 0)
        if cp == 1
        else cp_attention_bytes(a, cfg, p, batch, seq, cp, tp)
    )
    b["cp_kv"] = kv * cp_saved_layers(cfg, a.n_layers)
    b["attention_inputs"] = int(held * b["attention_inputs"])
    act = head_act + b["attention_inputs"]
    b["activations_no_ac"] = (
        int(held * blocks_activations(cfg, blocks_a, p, tokens, "none", tp, pd.ep))
        + act
        + kv * a.n_layers
    )
    b["activations_full_ac"] = (
        int(held * blocks_activations(cfg, blocks_a, p, tokens, "full", tp, pd.ep)) + act
    )
    b["activations"] = (
        int(held * blocks_activations(cfg, blocks_a, p, tokens, tp=tp, ep=pd.ep)) + act + b["cp_kv"]
    )
    # under AC, the dispatched rows the recompute reuses where ep spans nodes (plan/moe.py)
    b["activations"] += int(held * saved_dispatch_bytes(cfg, blocks_a, pd, p, tokens // tp))
    recompute = cfg.activation_checkpoint.mode != "none" and blocks_a.n_layers > 0
    one = registry.hooks(a).plan_largest_block(  # a family's own blocks
        a, p, tokens, tp, pd.ep, a.attn_mask_type == "block_causal", min(seq, tokens)
    )
    if one is None:
        one = split_bytes(block_split(a, p, tp, moe=moe_layers(a) > 0, ep=pd.ep), tokens, tp)
    b["ac_recompute"] = one + kv if recompute else 0
    # TP in a block's backward: the whole-sequence gradient of a colwise matmul's input and a
    # rowwise matmul's partial sum, [tokens, dim] each, live around their collectives.
    b["tp_buffers"] = 2 * p * tokens * a.dim if tp > 1 else 0
    loss = (
        loss_region(cfg, a, p, tokens, tp, pd.loss_parallel)
        if head
        else dict.fromkeys(("at_loss", "after", "at_head"), 0)
    )
    b["logits_loss"], held_logits = loss["at_loss"], loss["after"]
    b.update(fsdp_buffers(cfg, groups, shard, p, r, pipeline=pd.pp_enabled, ep=pd.ep_dp))
    # A pipeline schedule reduces the gradients at its last microbatch (sync 'last' within it)
    sync_last = cfg.training.gradient_accumulation_sync == "last" or pd.pp_enabled
    several = accum > 1 or (pd.pp_enabled and cfg.training.local_batch_size > batch)
    b["grad_accumulation"] = (
        r * sum(gathered(k, gathered_numel(v, shard), pd.ep_dp) for k, v in groups.items())
        if several and sync_last
        else 0
    )
    impl = implementation(cfg.optimizer.implementation)
    largest = max(FP32 * shard_numel(s, shard) for s in shapes)
    b["optimizer_step_temp"] = {"foreach": b["parameters"], "for-loop": 2 * largest}.get(impl, 0)
    if cfg.optimizer.name == "Muon":  # ~6 x a rank's share of a bucket (trainer/optim/
        # muon.py): bucket k + 1's updates, send and receive buffers in flight; bucket k's
        # whole fp32 matrices, their Newton-Schulz and the results on their way back
        b["optimizer_step_temp"] += 6 * min(
            muon_bucket_bytes,
            FP32
            * sum(shard_numel(s, shard) for k, g in groups.items() for s in g if muon_matrix(k, s)),
        )
    # With fsdp_offload the sharded state (params, grads, optimizer) is in host memory
    # (trainer/plan/host.py); the device holds the staging copies of `offload_staging`.
    on_device = 0 if cfg.parallelism.fsdp_offload == "cpu" else 1
    b["offload_staging"] = (1 - on_device) * offload_staging(
        {k: sum(shard_numel(s, shard) for s in g) for k, g in groups.items()}, p, r
    )

    resident = (
        on_device * (b["parameters"] + b["optimizer_state"])
        + b["buffers_and_inputs"]
        + b["offload_staging"]
    )
    # With sync every microbatch, the sharded gradients of the earlier microbatches are held
    # through the later ones (FSDP adds to them): from the second microbatch on, all of them.
    grads_held = on_device * b["gradients"] if accum > 1 and not sync_last else 0
    in_backward = resident + b["grad_accumulation"] + grads_held
    blocks_act = b["activations"] - head_act
    b["peak_loss"] = in_backward + b["activations"] + b["logits_loss"] + b["fsdp_loss"]
    b["peak_head_backward"] = (
        in_backward + b["activations"] + loss["at_head"] + b["fsdp_head"] + b["tp_buffers"] // 2
    )
    b["peak_block_backward"] = (
        in_backward
        + blocks_act
        + b["ac_recompute"]
        + held_logits
        + b["fsdp_block"]
        + b["tp_buffers"]
    )
    emb_grad = FP32 * sum(shard_numel(s, shard) for s in groups.get("embedding", []))
    b["peak_end_of_backward"] = (
        in_backward
        + (0 if grads_held else on_device) * (b["gradients"] - emb_grad)
        + held_logits
        + b["fsdp_embedding"]
    )
    b["peak_optimizer_step"] = resident + on_device * (b["gradients"] + b["optimizer_step_temp"])
    b["total"] = max(v for k, v in b.items() if k.startswith("peak_"))
    b.update(host_memory(cfg, b, [FP32 * shard_numel(s, shard) for s in shapes]))
    return b


def fsdp_buffers(
    cfg: JobConfig, groups, shard: int, p: int, r: int, pipeline: bool = False, ep: int = 1
) -> dict[str, int]:
    """Unsharded parameters, gradients and reduce-scatter buffers live in each backward phase.

    A group being backpropagated holds its all-gathered params (p bytes, padded), its unsharded
    grads (p) and the flat reduce-scatter input (r: FSDP2 copies the grads into a buffer of the
    reduce dtype even when it equals p); the next group's params are prefetched (p), and on
    CUDA the previous group's reduce-scatter may still be in flight (r). The head is kept
    unsharded after forward under 'default' and 'never' and re-gathered under 'always': in its
    backward it is there in every policy. Under 'never' every group stays unsharded from its
    forward to its backward (counted until the embedding's backward, when the blocks have
    been resharded after theirs). An integer N keeps 1/N of those params per rank over the
    same span (FSDP2's post-forward shards over groups of N ranks). The embedding's backward also
    materialises its weight gradient in fp32 when computing in bf16 (CPU kernels accumulate in fp32;
    counted to stay safe).
    """
    g = per_block({k: gathered(k, gathered_numel(v, shard), ep) for k, v in groups.items()})
    block = max((n for k, n in g.items() if k.startswith("layers.")), default=0)
    head, emb = g.get("head", 0), g.get("embedding", 0)  # a pipeline stage may lack either
    policy, kept = cfg.parallelism.fsdp_reshard_after_forward, 0
    if pipeline and policy == "default":  # trainer/parallel/parallelize.py
        policy = "never"
    if policy == "never":
        kept = p * (sum(n for k, n in g.items() if k.startswith("layers.")) + emb)
    elif policy.isdigit():  # hpZ: each rank keeps 1/N of every block and the embedding
        kept = p * (sum(n for k, n in g.items() if k.startswith("layers.")) + emb) // int(policy)
    head_kept = p * head if policy != "always" else 0
    emb_temp = FP32 * emb if p < FP32 else 0
    return {
        "fsdp_loss": head_kept + kept,
        "fsdp_head": (2 * p + r) * head + p * block + kept,
        "fsdp_block": (3 * p + 2 * r) * block + kept,
        "fsdp_embedding": (2 * p + r) * emb + emb_temp + r * block,
    }


def accumulation_sync_note(cfg: JobConfig, world_size: int, mem_gib: float) -> str | None:
    """One line when `gradient_accumulation_sync = "last"` holds more than the GPU has and
    "every" would fit: with several microbatches, "last" keeps the unsharded gradients (in the
    reduce dtype) from the first microbatch to the last; "every" reduce-scatters each one."""
    pd, accum = cfg.resolve(world_size)
    if accum == 1 or cfg.training.gradient_accumulation_sync != "last":
        return None
    last = memory_plan(cfg, world_size)
    every = memory_plan(
        dataclasses.replace(
            cfg, training=dataclasses.replace(cfg.training, gradient_accumulation_sync="every")
        ),
        world_size,
    )
    have = mem_gib * GIB
    if device_need(last["total"]) <= have or device_need(every["total"]) > have:
        return None
    return (
        f"warning: training.gradient_accumulation_sync = 'last' holds "
        f"{last['grad_accumulation'] / GIB:.1f} GiB of unsharded gradients across "
        f"{accum} microbatches: the plan needs {device_need(last['total']) / GIB:.1f} GiB of "
        f"the GPU's {mem_gib:.1f} GiB; 'every' needs {device_need(every['total']) / GIB:.1f} "
        f"GiB (python -m trainer.plan shows both)"
    )


def optimizer_state_bytes(cfg: JobConfig, groups, shard: int) -> int:
    """AdamW: two fp32 moments per parameter and a step scalar per tensor; Muon: one fp32
    momentum buffer for each block matrix (trainer/optim/muon.py), AdamW's for the rest."""
    out = 0
    for key, shapes in groups.items():
        for s in shapes:
            muon = cfg.optimizer.name == "Muon" and muon_matrix(key, s)
            out += (1 if muon else 2) * FP32 * shard_numel(s, shard) + (0 if muon else FP32)
    return out


def device_need(total: int) -> int:
    """Bytes of device memory a plan peak needs: + the CUDA context and fragmentation."""
    return int(total + CONTEXT_GIB * GIB + FRAGMENTATION * total)


def cpu_need(total: int, ranks_per_node: int) -> int:
    """Host bytes a node of CPU ranks needs: each rank's plan peak, which lives in host
    memory on a CPU, plus its process (CPU_PROCESS_GIB)."""
    return ranks_per_node * int(total + CPU_PROCESS_GIB * GIB)


def check_cpu_ram(cfg: JobConfig, world_size: int, ranks_per_node: int, ram_gib: float) -> None:
    """Refuse, before launch, a CPU run whose memory plan cannot fit the node's RAM (it would
    allocate until the OS kills it), naming the largest local batch that fits."""
    need = cpu_need(memory_plan(cfg, world_size)["total"], ranks_per_node)
    if need <= ram_gib * GIB:
        return
    best = largest_local_batch(
        cfg, world_size, ram_gib, need=lambda total: cpu_need(total, ranks_per_node)
    )
    fits = (
        f"at most training.local_batch_size = {best} could fit"
        if best
        else "no training.local_batch_size fits; use a smaller model.flavor or seq_len"
    )
    raise ConfigError(
        f"training.local_batch_size = {cfg.training.local_batch_size} cannot fit this machine's "
        f"memory: the plan needs {need / GIB:.1f} GiB for {ranks_per_node} CPU ranks, the "
        f"machine has {ram_gib:.1f} GiB; {fits} (python -m trainer.plan shows the plan)"
    )


def largest_local_batch(
    cfg: JobConfig, world_size: int, mem_gib: float, limit: int = 1024, need=device_need
) -> int:
    """The largest `training.local_batch_size` whose plan fits `mem_gib` (0 if none does),
    with `need(plan total)` the bytes it takes (default: a GPU's, device_need). With a fixed
    `global_batch_size`, only local batches that divide it are candidates."""

    def fits(batch: int) -> bool | None:  # None: not a valid local batch for this config
        trial = dataclasses.replace(
            cfg, training=dataclasses.replace(cfg.training, local_batch_size=batch)
        )
        try:
            return need(memory_plan(trial, world_size)["total"]) <= mem_gib * GIB
        except ConfigError:
            return None

    lo, hi = 0, 1  # the plan grows with the batch: double, then bisect
    while hi <= limit and fits(hi) is not False:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is not False else (lo, mid)
    return next((b for b in range(lo, 0, -1) if fits(b)), 0)


def throughput(cfg: JobConfig, peak_tflops: float, mfu: float) -> tuple[float, float]:
    """(model FLOPs per token, tokens/s per device) at the assumed MFU of the bf16 peak. Per
    device also under TP: a dp rank's tp devices together run tp x this (trainer.models.flops)."""
    vocab, _ = resolve_vocab(cfg)
    a = plan_args(cfg, vocab)
    fpt = flops_per_token(a, cfg.training.seq_len)
    return fpt, mfu * peak_tflops * 1e12 / fpt
