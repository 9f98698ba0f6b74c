"""Communication volume per step, per mesh dimension: what `python -m trainer.plan` prints under
"communication per optimizer step".

Figures are bytes **one rank sends** in one optimizer step (with bandwidth-optimal ring or tree
algorithms it receives as much). For a collective over n ranks whose full (gathered or reduced)
tensor has S bytes:

    all-gather, reduce-scatter:  (n - 1) / n * S        all-reduce:  2 * (n - 1) / n * S

so a dimension of size 1 moves nothing. With m microbatches per step (gradient accumulation),
L blocks, X = p * local_batch * seq_len * dim bytes (one [batch, seq, dim] activation in the
compute dtype p) and f = (tp - 1) / tp:

- **tp** (sequence parallel, per microbatch, counted m times): every block all-gathers X before
  attention and before the FFN and reduce-scatters X after wo and after w2 in forward; backward
  does the reverse (4 more); blocks recomputed under activation checkpointing replay their
  forward collectives (full AC and the checkpointed blocks of selective-k: 4; op-level SAC: 3,
  everything up to w2's output). The embedding reduce-scatters its output and the head
  all-gathers its input (2 forward, 2 backward):

      tp = m * f * X * (8 L + 4 + recomputed collectives) + loss + norms

  `loss`: loss parallel all-reduces three fp32 values per token (max, sum of exponentials,
  target logit): m * 3 * 2f * 4 * tokens; with `disable_loss_parallel` the head's weight is
  all-gathered over tp in forward and its gradient reduce-scattered in backward instead:
  m * 2 * f * p * vocab * dim. `norms`: the RMSNorm weights are replicated over tp and their
  gradients all-reduced over it, m * 2f * p * (2 L + 1) * dim (small).
- **cp** (context parallelism, per microbatch): every block all-gathers the whole sequence's K
  and V, KV = 2 * p * local_batch * seq_len * (n_kv_heads / tp) * head_dim bytes, in forward
  and reduce-scatters their gradients in fp32 in backward (4 / p x KV); recomputed blocks
  gather again (full AC: every block; selective k: every k-th; op SAC saves the gathered K/V):
  m * (cp - 1) / cp * KV * (L (1 + 4 / p) + recomputed).
  MLA gathers its latents instead, KV = p * local_batch * seq_len * (kv_lora_rank + rope).
  Under CP the tp and dp terms count 1/cp of the sequence per rank, and FSDP's group is
  dp_shard x cp.
- **dp_shard** (FSDP2, each rank's tp part of the parameters, `trainer.plan.memory.fsdp_groups`;
  with g = (dp_shard - 1) / dp_shard and G_p, G_r the padded unsharded bytes of all groups in the
  param and reduce dtypes): forward all-gathers every group, g * G_p per microbatch; backward
  re-gathers the groups resharded after forward ('default': the blocks and the embedding, the
  head stays gathered; 'always': all; 'never': none; an integer N: the blocks and the
  embedding over groups of N ranks, (N - 1) / N instead of g); reduce-scatter of the
  gradients, g * G_r, every microbatch, or once per step under `gradient_accumulation_sync =
  'last'`. With TP each rank gathers 1/tp of the model.
- **dp_replicate** (HSDP): an all-reduce of the reduce-scattered gradient shard (r bytes per
  element), 2 (R - 1) / R * shard bytes, every microbatch under 'every', once per step under
  'last' and 'hsdp_reduce_scatter'.

- **ep** (expert parallelism, trainer/plan/moe.py): the routed tokens' all-to-all there and
  back in forward and backward (and in the recompute under full AC), over ep ranks (ep_dp
  dp_shard ranks x tp); the experts' FSDP traffic in dp_shard is 1/ep of their bytes over
  efsdp = dp_shard / ep_dp ranks.
Not counted: the loss's scalar all-reduce over dp, gradient-norm clipping (a few scalars),
checkpoints, and the data loader. Whether this traffic stays inside a node is a matter of the
mesh: tp is innermost, so with tp <= GPUs per node it is NVLink traffic.
"""

from __future__ import annotations

import math

from trainer.config.job import JobConfig
from trainer.models import registry
from trainer.plan.memory import (
    BYTES,
    FP32,
    fsdp_groups,
    gathered_numel,
    plan_args,
    resolve_vocab,
    shard_numel,
)
from trainer.plan.moe import all_to_all_volume, gathered, moe_layers
from trainer.plan.muon import muon_volume, ns_loads
from trainer.plan.pipeline import p2p_bytes, rank_groups


def _stages_defer() -> bool:
    from torch.distributed.pipelining.stage import _PipelineStageBase

    return hasattr(_PipelineStageBase, "perform_reduce_grad")


def ring(n: int) -> float:
    """Share of a full tensor each rank sends in a ring all-gather or reduce-scatter over n."""
    return (n - 1) / n


def tp_collectives(cfg: JobConfig, n_layers: int, moe_ids=()) -> int:
    """[batch, seq, dim] all-gathers + reduce-scatters per microbatch over tp (forward,
    backward and the forward collectives replayed by activation checkpointing). A MoE block
    (its id in `moe_ids`) has those of its attention only: its feed-forward runs on the
    sequence shard (trainer/parallel/tp.py), half the block's in each pass and replay."""
    ac = cfg.activation_checkpoint
    ids = range(n_layers)
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        ids = range(0, n_layers, int(ac.selective_ac_option))  # the checkpointed blocks
    per = {"full": 4, "selective": 2 if ac.selective_ac_option == "op" else 4}.get(ac.mode, 0)
    # op-level SAC replays the all-gathers; the reduce-scatters' outputs are kept
    replayed = sum(per // 2 if i in moe_ids else per for i in ids)
    return sum(4 if i in moe_ids else 8 for i in range(n_layers)) + 4 + replayed


def tp_volume(cfg: JobConfig, a, pd, accum: int) -> float:
    """Bytes per rank per step over tp (see the module docstring)."""
    if pd.tp == 1:
        return 0.0
    p, f = BYTES[cfg.training.mixed_precision_param], ring(pd.tp)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len // pd.cp
    # a MoE feed-forward runs on the sequence shard (trainer/parallel/tp.py): no gather or
    # reduce-scatter around it (2 forward, 2 backward per MoE block), and its gradients, each
    # tp rank's tokens' share, are all-reduced over tp once per step (fp32, 1/dp_shard each):
    # under ep only the router's and shared experts' (the experts are split over ep x tp)
    n_moe = moe_layers(a)
    moe_ids = {i for i in range(a.n_layers) if a.is_moe_layer(i)} if n_moe else set()
    collectives = tp_collectives(cfg, a.n_layers, moe_ids)
    activations = f * p * tokens * a.dim * collectives
    if pd.loss_parallel:
        loss = 3 * 2 * f * FP32 * tokens
    else:
        loss = 2 * f * p * a.vocab_size * a.dim
    norms = 2 * f * p * (2 * a.n_layers + 1) * a.dim
    summed = 0
    if n_moe:
        m = a.moe
        summed = (
            a.dim * m.n_experts + 3 * a.dim * m.hidden_dim * m.n_shared_experts
            if pd.ep > 1
            else m.total_ffn(a.dim)
        )
    moe_grads = 2 * f * FP32 * n_moe * summed / pd.dp_shard
    return accum * (activations + loss + norms) + moe_grads


def dp_shard_volume(cfg: JobConfig, groups, pd, accum: int) -> float:
    """Bytes per rank per step over dp_shard: FSDP all-gathers and reduce-scatters."""
    n = pd.dp_shard * pd.cp
    p, r = BYTES[cfg.training.mixed_precision_param], BYTES[cfg.training.mixed_precision_reduce]
    # experts (under ep): a tp rank's part (`fsdp_groups`), 1/ep_dp of it gathered over
    # efsdp (x cp) = n / ep_dp ranks
    e = pd.ep_dp
    g = {
        k: gathered(k, gathered_numel(v, n), e)
        * (ring(n // e) / ring(n) if e > 1 and k.endswith(".experts") else 1.0)
        for k, v in groups.items()
    }
    total, head = sum(g.values()), g.get("head", 0)  # a pipeline stage may lack the head
    policy = str(cfg.parallelism.fsdp_reshard_after_forward)
    if pd.pp_enabled and policy == "default":  # trainer/parallel/parallelize.py
        policy = "never"
    regather = {"default": ring(n) * (total - head), "always": ring(n) * total, "never": 0.0}.get(
        policy
    )
    if regather is None:  # an integer N: backward gathers over groups of N ranks
        regather = ring(int(policy)) * (total - head)
    gathers = accum * p * (ring(n) * total + regather)
    # a pipeline schedule's stages reduce at the step's last schedule step (a torch without
    # the stages' perform_reduce_grad: at the end of each; trainer/parallel/pipeline.py)
    syncs = (
        1
        if cfg.training.gradient_accumulation_sync == "last"
        and (not pd.pp_enabled or _stages_defer())
        else accum
    )
    return gathers + syncs * r * ring(n) * total


def dp_replicate_volume(cfg: JobConfig, groups, pd, accum: int) -> float:
    """Bytes per rank per step over dp_replicate: HSDP's all-reduce of the gradient shards."""
    r = BYTES[cfg.training.mixed_precision_reduce]
    shard = sum(shard_numel(s, pd.dp_shard * pd.cp) for v in groups.values() for s in v)
    syncs = accum if cfg.training.gradient_accumulation_sync == "every" else 1
    return syncs * 2 * ring(pd.dp_replicate) * r * shard


def cp_volume(cfg: JobConfig, a, pd, accum: int) -> float:
    """Bytes per rank per step over cp (see the module docstring)."""
    if pd.cp == 1:
        return 0.0
    p, t = BYTES[cfg.training.mixed_precision_param], cfg.training
    per_token = registry.hooks(a).plan_cp_gathered(a)  # a family's own, else K and V
    if per_token is None:
        per_token = 2 * max(a.n_kv_heads // pd.tp, 1) * a.head_dim
    kv = p * t.local_batch_size * t.seq_len * per_token
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        replayed = a.n_layers
    elif ac.mode == "selective" and ac.selective_ac_option != "op":  # op SAC saves the gather
        replayed = -(-a.n_layers // int(ac.selective_ac_option))
    else:
        replayed = 0
    grads = a.n_layers * 4 / p  # the gradients reduce-scattered in fp32
    return accum * ring(pd.cp) * kv * (a.n_layers + grads + replayed)


def comm_volume(cfg: JobConfig, world_size: int) -> dict[str, float]:
    """{`comm_tp`, `comm_cp`, `comm_dp_shard`, `comm_dp_replicate`}: bytes each rank sends per
    optimizer step over that mesh dimension, and `comm_microbatches` (m)."""
    pd, accum = cfg.resolve(world_size)
    a = plan_args(cfg, resolve_vocab(cfg)[0])
    groups, full = fsdp_groups(a, pd.tp, pd.ep, pd.dp_shard * pd.cp), fsdp_groups(a, 1)
    pp_sends = 0.0
    if pd.pp_enabled:  # the busiest pp rank: its stages' parameters, its p2p sends
        p = BYTES[cfg.training.mixed_precision_param]
        ranks = range(pd.pp)
        pp_sends = max(p2p_bytes(cfg, p, rank, accum) for rank in ranks)
        busiest = max(
            ranks,
            key=lambda rank: sum(
                math.prod(s) for v in rank_groups(groups, cfg, rank).values() for s in v
            ),
        )
        groups, full = rank_groups(groups, cfg, busiest), rank_groups(full, cfg, busiest)
    muon = {}
    if cfg.optimizer.name == "Muon":  # the optimizer's own owners (trainer/plan/muon.py)
        loads = ns_loads(cfg, pd, a)
        muon = {
            "comm_optimizer": max(muon_volume(cfg, pd, a, r) for r in range(pd.pp)),
            "muon_ns_flops": max(loads),
            "muon_ns_flops_mean": sum(loads) / len(loads),
        }
    # tp and cp: a pp rank runs ~1/pp of the layers on the same tokens
    return {
        "comm_tp": tp_volume(cfg, a, pd, accum) / pd.pp,
        "comm_cp": cp_volume(cfg, a, pd, accum) / pd.pp,
        "comm_dp_shard": dp_shard_volume(cfg, groups, pd, accum),
        "comm_dp_replicate": dp_replicate_volume(cfg, groups, pd, accum),
        "comm_pp": pp_sends,
        "comm_ep": all_to_all_volume(cfg, a, pd, accum),
        **muon,
        "comm_microbatches": accum,
    }
