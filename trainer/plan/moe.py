"""Mixture of experts in the plan (`python -m trainer.plan`): the experts' parameters, the
routed tokens' activations and expert parallelism's all-to-all.

- **Parameters.** Each MoE layer's experts are an FSDP group of their own,
  `layers.<i>.experts` in `trainer.plan.memory.fsdp_groups`. Under ep they are split over
  the ep ranks, ep_dp = ep / tp of dp_shard's and the tp ranks (trainer/parallel/dims.py), and
  sharded over efsdp = dp_shard / ep_dp, so a rank holds E / (ep x efsdp) = E / (dp_shard x tp)
  of them; a gather brings E / ep experts, not E. The plan books a tp rank's E / tp of them
  (as it books a tp rank's part of a TP matmul) and gathers 1/ep_dp of that (`gathered`).
  Without ep, tensor parallelism does not split a MoE block's parameters (trainer/parallel/
  tp.py): they are whole on every tp rank, as the router and shared experts always are.
- **Activations.** A MoE block saves, per token of the microbatch (the whole sequence: under
  TP each tp rank routes the gathered sequence), in place of the dense FFN's: the router's fp32
  logits and probabilities (2 x 4 x E), and for each of the top_k routed copies of the token
  its gathered input, the w1 and w3 outputs, the SiLU output and the product (4 x hidden), the
  w2 output and the weighted output (p bytes each); under ep the two all-to-all outputs (one
  copy each way); the shared experts as a dense FFN of n_shared x hidden. Dropless routing
  at perfect balance: a skewed router puts more tokens on some ranks (their imbalance factor
  multiplies this term).
- **All-to-all** (ep, per microbatch): each rank routes its own tokens (1 / (tp x cp) of the
  microbatch), and each routed copy leaves its rank with probability (ep - 1) / ep (the ep
  group takes in the tp ranks) and comes back: 2 x top_k x tokens x dim x p x (ep - 1) / ep bytes
  per MoE layer in forward, the same in backward, and the dispatch's half again for each forward
  recomputed by AC (`recompute_share`: the combine is not recomputed; a kept dispatch is not
  sent again).
"""

from __future__ import annotations

from trainer.models.args import ModelArgs

FP32 = 4


def group_key(name: str, args: ModelArgs) -> str:
    """The FSDP group of parameter `name` (trainer/parallel/fsdp.py): a block, its experts,
    the embedding or the head."""
    i = block_id(name, args)
    if i is None:
        if name.startswith("mtp."):  # an MTP module's norms and projection: a group
            return ".".join(name.split(".")[:2])
        return "embedding" if name.startswith("tok_embeddings") else "head"
    return f"layers.{i}.experts" if ".experts." in name else f"layers.{i}"


def block_id(name: str, args: ModelArgs) -> int | None:
    """The block parameter `name` is in (an MTP module's block: n_layers + its depth), or
    None outside the blocks."""
    parts = name.split(".")
    if parts[0] == "layers":
        return int(parts[1])
    if parts[0] == "mtp" and parts[2] == "block":
        return args.n_layers + int(parts[1])
    return None


def tp_splits(name: str, args: ModelArgs) -> bool:
    """Whether tp splits parameter `name`: not in a MoE block's feed-forward."""
    if ".feed_forward." not in name:
        return True
    return not args.is_moe_layer(block_id(name, args))


def gathered(key: str, numel: int, ep: int) -> int:
    """Elements a gather of group `key` brings: 1/ep of the experts' (tp-local) elements under
    expert parallelism (`ep`: the ep ranks borrowed from dp_shard, ParallelDims.ep_dp)."""
    return numel // ep if key.endswith(".experts") else numel


def per_block(g: dict[str, int]) -> dict[str, int]:
    """Gathered elements per group with each block's experts added to their block (FSDP
    gathers the experts inside the block's forward and backward: both are up at once)."""
    out: dict[str, int] = {}
    for key, n in g.items():
        base = key[: -len(".experts")] if key.endswith(".experts") else key
        out[base] = out.get(base, 0) + n
    return out


def moe_ffn_bytes(a: ModelArgs, p: int, ep: int) -> int:
    """Bytes a MoE block's feed-forward saves per token (see the module docstring)."""
    m = a.moe
    routed = m.top_k * (
        p * a.dim + 4 * p * m.hidden_dim + 2 * p * a.dim + (2 * p * a.dim if ep > 1 else 0)
    )
    shared = 4 * p * m.hidden_dim * m.n_shared_experts + (p * a.dim if m.n_shared_experts else 0)
    return 2 * FP32 * m.n_experts + routed + shared


def moe_layers(a: ModelArgs) -> int:
    return sum(a.is_moe_layer(i) for i in range(a.n_layers)) if a.moe is not None else 0


def all_to_all_volume(cfg, a: ModelArgs, pd, accum: int) -> float:
    """Bytes per rank per step over ep (see the module docstring)."""
    if pd.ep == 1 or a.moe is None:
        return 0.0
    p, t = (
        FP32 if cfg.training.mixed_precision_param == "float32" else 2,
        cfg.training,
    )  # auto: bf16 on GPUs
    tokens = t.local_batch_size * t.seq_len // (pd.tp * pd.cp)  # this rank's sequence shard
    one_way = a.moe.top_k * tokens * a.dim * p * (pd.ep - 1) / pd.ep
    return accum * moe_layers(a) * 2 * one_way * (2 + recompute_share(cfg, a, pd)) / pd.pp


def recompute_share(cfg, a: ModelArgs, pd) -> float:
    """The all-to-all an AC recompute sends again, as a share of a forward's (dispatch and
    combine): the dispatch only, in the checkpointed layers (torch's checkpoint stops once the
    last saved tensor is recomputed, and nothing after the combine is saved); none where the
    node-limited dispatch keeps its received rows (`saved_dispatch_bytes`) or op-level SAC
    keeps the all-to-all outputs."""
    import math

    ac = cfg.activation_checkpoint
    if ac.mode == "none" or (ac.mode == "selective" and ac.selective_ac_option == "op"):
        return 0.0
    layers = moe_layers(a)
    checkpointed = layers if ac.mode == "full" else math.ceil(layers / int(ac.selective_ac_option))
    if saved_dispatch_bytes(cfg, a, pd, 2, 1):  # any rows kept: none sent again
        return 0.0
    return 0.5 * checkpointed / layers


def saved_dispatch_bytes(cfg, a: ModelArgs, pd, p: int, tokens: int) -> int:
    """Under full or block AC with `moe.save_dispatch`, where the ep group (`ep` ranks) spans
    several nodes (LOCAL_WORLD_SIZE: the plan's --ngpu): the rows the dispatch received, kept
    by each checkpointed MoE layer from its forward to its backward (trainer/parallel/
    ep_dispatch.py) for this rank's `tokens`: the node-limited dispatch's inter-node stage
    (topk_group rows per token, with top_k weight columns and int32 choices); the flat
    dispatch keeps none. Perfect balance."""
    import math
    import os

    from trainer.parallel.ep_dispatch import node_span

    m, ac, ep = a.moe, cfg.activation_checkpoint, pd.ep
    per = int(os.environ.get("LOCAL_WORLD_SIZE") or 0)
    ranks = pd.ep_group_ranks()  # strided over cp: the nodes the group really spans
    nodes, why = node_span(ranks, per, m.n_group) if per and m is not None else (1, "")
    if (
        m is None
        or ep == 1
        or nodes == 1
        or not m.save_dispatch
        or ac.mode == "none"
        or (ac.mode == "selective" and ac.selective_ac_option == "op")
    ):
        return 0
    layers = moe_layers(a)
    if ac.mode == "selective":  # every k-th block is checkpointed
        layers = math.ceil(layers / int(ac.selective_ac_option))
    node = m.dispatch == "node" or (m.dispatch == "auto" and not why and m.capacity_factor == 0)
    if not node:  # the flat dispatch sends its rows again (trainer/parallel/expert_parallel.py)
        return 0
    return layers * tokens * m.topk_group * ((a.dim + m.top_k) * p + 4 * m.top_k)
