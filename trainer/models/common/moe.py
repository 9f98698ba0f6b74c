"""Mixture of experts: a router and E experts in place of a block's FFN (`MoEArgs` in
trainer/models/args.py says which layers and how).

- **Router.** A linear layer to E scores per token, softmax (Qwen3-MoE, Mixtral) or sigmoid
  (DeepSeek-V3). The top-k experts are chosen on the scores plus `expert_bias`, the
  aux-loss-free balancing bias (a buffer, in the checkpoint); the token's weights are the
  chosen experts' scores without the bias, optionally renormalised to sum to 1, times
  `route_scale`.
- **Experts.** Stacked `[E, ...]` SwiGLU weights, run as grouped GEMMs (`torch._grouped_mm`)
  over the tokens sorted by expert, or one matmul per expert where the build lacks it. A shared
  expert (DeepSeek) sees every token. Under expert parallelism a `dispatcher` sends the
  routed rows to the ranks that hold their experts and brings the outputs back.
- **Dropless** by default: every routed (token, expert) pair is computed. With a capacity
  factor c > 0 an expert takes at most ceil(c x tokens x k / E) pairs, in token order, and the
  rest are dropped (their weight is lost, as in Megatron's token dropping) and counted.
- **Statistics** for balancing and metrics (`take_stats`): the tokens each expert received
  over the step, the dropped pairs, and the aux loss and router z-loss terms when weighted.
- **Aux losses** (each off at weight 0; their weighted sum is logged as `moe/aux_loss`): the
  global load-balancing loss (`aux_loss_weight`: Switch / Megatron, E x sum_i f_i P_i over a
  microbatch's tokens, raw scores), DeepSeek-V3's complementary sequence-wise balance loss
  (`seq_aux_loss_weight`, `sequence_balance_loss`: scores normalised over the experts, per
  sequence) and the router z-loss. Each is exact on every layout: where cp or tp ranks hold
  parts of the sequences, their sums are all-reduced over those ranks first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.args import MoEArgs
from trainer.parallel import recompute

GROUPED_MM = hasattr(torch, "_grouped_mm")


def expert_counts(slots: torch.Tensor, n_experts: int) -> torch.Tensor:
    """[E] int64: the (token, choice) pairs routed to each expert. A scatter-add into E
    zeros, not `torch.bincount`: bincount's output length depends on the data, so on CUDA it
    reads the largest index back to the host (a sync per MoE layer) and fake tensors (the
    traced dry run) cannot run it. Integer adds: exact and deterministic on every device."""
    return torch.zeros(n_experts, dtype=torch.int64, device=slots.device).index_add_(
        0, slots, torch.ones_like(slots)
    )


class Router(nn.Module):
    def __init__(self, dim: int, moe: MoEArgs):
        super().__init__()
        self.moe = moe
        self.gate = nn.Linear(dim, moe.n_experts, bias=False)
        # Aux-loss-free balancing (DeepSeek-V3): added to the scores for the choice only.
        self.register_buffer("expert_bias", torch.zeros(moe.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        """x [T, dim] -> (weights [T, k] fp32, experts [T, k] int64, probabilities [T, E] fp32,
        logits [T, E] fp32)."""
        # in fp32, as the releases' own code computes them (DeepSeek-V3's gate): logits
        # rounded to bf16 tie or swap near-equal experts (~2% of tokens route elsewhere)
        logits = F.linear(x.float(), self.gate.weight.float())
        probs = logits.softmax(-1) if self.moe.score_func == "softmax" else logits.sigmoid()
        with torch.no_grad():
            chosen = choose(probs + self.expert_bias, self.moe)
        weights = probs.gather(-1, chosen)
        if self.moe.norm_topk_prob:  # as Qwen3-MoE: top_k = 1 gets weight 1
            weights = weights / weights.sum(-1, keepdim=True).clamp_min(1e-20)
        return weights * self.moe.route_scale, chosen, probs, logits


def choose(scores: torch.Tensor, moe: MoEArgs) -> torch.Tensor:
    """[T, k] experts of each token by its biased scores [T, E]: the top k, or with groups
    (DeepSeek-V3's group-limited routing) the top k within the topk_group groups whose two
    best scores sum highest."""
    if moe.n_group == 1:
        return scores.topk(moe.top_k, dim=-1).indices
    grouped = scores.unflatten(-1, (moe.n_group, -1))
    best = grouped.topk(2, dim=-1).values.sum(-1).topk(moe.topk_group, dim=-1).indices
    keep = torch.zeros(grouped.shape[:-1], dtype=torch.bool, device=scores.device)
    keep.scatter_(-1, best, True)
    masked = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).flatten(-2)
    return masked.topk(moe.top_k, dim=-1).indices


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: w1, w3 [E, hidden, dim], w2 [E, dim, hidden]."""

    def __init__(self, dim: int, hidden: int, n_experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.grouped = GROUPED_MM

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x [N, dim], rows sorted by expert, `counts` [E] rows per expert -> [N, dim]."""
        w1, w2, w3 = self.w1, self.w2, self.w3
        if hasattr(w1, "to_local"):  # expert parallel: this rank's experts
            w1, w2, w3 = w1.to_local(), w2.to_local(), w3.to_local()
        if self.grouped:
            offs = counts.cumsum(0).to(torch.int32)
            h = F.silu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)) * torch._grouped_mm(
                x, w3.transpose(-2, -1), offs=offs
            )
            return torch._grouped_mm(h, w2.transpose(-2, -1), offs=offs)
        return expert_loop(x, counts, w1, w2, w3)


def expert_loop(x, counts, w1, w2, w3) -> torch.Tensor:
    """The per-expert fallback (one host sync for the split sizes). The weights are unbound
    once: indexing `w1[e]` per expert would make autograd build a zero gradient of the whole
    [E, ...] stack for every expert (E x 3 full-size buffers: minutes per step at 128 experts)."""
    outs, sizes = [], counts.tolist()
    counted = sum(sizes)
    for xe, a, b, c in zip(
        x[:counted].split(sizes), w1.unbind(0), w2.unbind(0), w3.unbind(0), strict=True
    ):
        outs.append((F.silu(xe @ a.t()) * (xe @ c.t())) @ b.t())
    if x.shape[0] > counted:  # rows past the counted ones (capacity's padding): zeros
        outs.append(x.new_zeros(x.shape[0] - counted, w2.shape[1]))
    return torch.cat(outs) if outs else x[:0]


class FeedForward(nn.Module):
    """SwiGLU: a dense block's FFN (trainer/models/common/decoder.py) and the shared experts."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """The MoE feed-forward of one block (see the module docstring)."""

    def __init__(self, dim: int, moe: MoEArgs, layer_id: int = 0):
        super().__init__()
        self.moe, self.layer_id = moe, layer_id  # its block's (an MTP block's: n_layers + k)
        self.router = Router(dim, moe)
        self.experts = GroupedExperts(dim, moe.hidden_dim, moe.n_experts)
        self.shared_experts = (
            FeedForward(dim, moe.hidden_dim * moe.n_shared_experts)
            if moe.n_shared_experts
            else None
        )
        self.register_buffer("tokens_per_expert", torch.zeros(moe.n_experts), persistent=False)
        self.register_buffer("dropped", torch.zeros(()), persistent=False)
        self.register_buffer("routed", torch.zeros(()), persistent=False)
        self.aux_terms: list[torch.Tensor] = []  # weighted aux + z terms (values, to log)
        self.aux_scale = 1.0  # d(objective) / d(aux term): set per step by the microbatch loop
        # (tokens, weights, chosen, keep, experts, side=shared experts) -> (the routed experts'
        # weighted sum per token, the shared experts' output): set by trainer/parallel/
        # expert_parallel.py, where the experts live on other ranks.
        self.dispatcher = None
        # Under tensor and context parallelism each rank routes its own sequence shard
        # (trainer/parallel/tp.py, parallelize.py): the group whose shards make up the
        # microbatch, for the aux losses' sums; and the ranks among them whose router
        # gradients are summed rather than averaged (tp: `sum_partial_grads`; cp ranks are
        # averaged by FSDP like dp ranks, under a backward loss scaled by cp).
        self.token_group = None
        self.aux_shards = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen, probs, logits = self.router(flat)
        slots = chosen.reshape(-1)  # (token, choice) pairs, token-major
        counts = loads = expert_counts(slots, self.moe.n_experts)
        keep = None  # [pairs] bool under a capacity: the pairs kept
        if self.moe.capacity_factor > 0:
            cap = capacity(self.moe, flat.shape[0])
            keep, counts = capacity_mask(slots, loads, cap)
        if self.training:  # the step's statistics (validation and evals do not count)
            with torch.no_grad():
                self.tokens_per_expert += loads.to(self.tokens_per_expert.dtype)
                self.routed += slots.numel()
                if keep is not None:
                    self.dropped += (~keep).sum()
        aux = None
        if self.training and torch.is_grad_enabled():  # before any exchange: see below
            aux = self._aux(probs, logits, chosen, shape[0] if len(shape) == 3 else 1)
        if self.dispatcher is not None:  # expert parallel (trainer/parallel/ep_dispatch.py)
            # Weighted and summed by token where the experts live; the shared experts run
            # while the dispatch is in flight. Every saved-for-backward tensor of this layer
            # precedes the combine, so activation checkpointing's recompute (which stops at
            # the last one) never repeats it.
            y, shared = self.dispatcher(
                flat, weights, chosen, keep, self.experts, side=self.shared_experts
            )
            y = y if shared is None else y + shared
        else:
            y = self._local(flat, weights, slots, counts, keep)
            if self.shared_experts is not None:
                y = y + self.shared_experts(flat)
        if aux is not None:  # under TP every tp rank holds the same aux: 1/tp of it each
            y = _AttachAux.apply(y, aux, self.aux_scale / self.aux_shards)
        return y.reshape(shape)

    def _local(self, flat, weights, slots, counts, keep) -> torch.Tensor:
        """The routed experts on this rank: rows sorted by expert, weighted, summed by token."""
        e, k = self.moe.n_experts, self.moe.top_k
        valid = None
        if keep is None:
            order = slots.argsort(stable=True)
        else:
            cap = capacity(self.moe, flat.shape[0])
            order, valid = kept_first(slots, keep, counts, min(slots.numel(), e * cap))
        token = order // k
        routed = flat[token] if valid is None else flat[token].masked_fill(~valid, 0)
        out = self.experts(routed, counts)
        if valid is not None:  # rows past the kept ones: no expert wrote them
            out = out.masked_fill(~valid, 0)
        out = out * weights.reshape(-1)[order, None].to(flat.dtype)
        return torch.zeros_like(flat).index_add_(0, token, out)

    def _aux(self, probs, logits, chosen, batch: int) -> torch.Tensor | None:
        """The weighted aux terms of this microbatch: the global load-balancing loss (Switch /
        Megatron `aux_loss`: E x sum_i f_i P_i over the microbatch's tokens, f_i the fraction
        of the token-choices that went to expert i, P_i its mean raw score), DeepSeek-V3's
        sequence-wise balance loss over its `batch` sequences, and the router z-loss (mean
        logsumexp^2)."""
        m, terms, group = self.moe, [], self.token_group
        tokens = probs.shape[0] * (1 if group is None else group.size())  # equal shards
        if m.aux_loss_weight:
            counts = expert_counts(chosen.reshape(-1), m.n_experts).float()
            frac = _summed(counts.detach(), group) / (tokens * m.top_k)
            terms.append(
                m.aux_loss_weight
                * m.n_experts
                * (frac * _summed(probs.sum(0), group) / tokens).sum()
            )
        if m.seq_aux_loss_weight:
            # f_i counts each token's plain top K of its scores (the report's eq. 18, and
            # Megatron's), not the experts it was routed to (biased, group-limited)
            plain = probs.detach().topk(m.top_k, dim=-1).indices
            terms.append(
                m.seq_aux_loss_weight
                * sequence_balance_loss(probs, plain, batch, m.n_experts, group)
            )
        if m.router_z_loss_weight:
            z = _summed(logits.logsumexp(-1).square().sum(), group)
            terms.append(m.router_z_loss_weight * z / tokens)
        if not terms:
            return None
        total = sum(terms)
        memo = recompute.current()
        if memo is None or not memo.replaying:  # logged once: not again by AC's recompute
            self.aux_terms.append(total.detach())
        return total

    def take_stats(self) -> dict[str, torch.Tensor]:
        """This step's loads, drops and routed pairs since the last take (then zeroed)."""
        stats = {
            "tokens_per_expert": self.tokens_per_expert.clone(),
            "dropped": self.dropped.clone(),
            "routed": self.routed.clone(),
        }
        for buf in (self.tokens_per_expert, self.dropped, self.routed):
            buf.zero_()
        return stats


def sequence_balance_loss(
    scores: torch.Tensor, chosen: torch.Tensor, batch: int, n_experts: int, group=None
) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss without its alpha (report, eq.
    17-20): per sequence of T tokens, s'_{i,t} = s_{i,t} / sum_j s_{j,t}, P_i = mean_t
    s'_{i,t}, f_i = E / (K T) x the tokens whose top K holds i; sum_i f_i P_i, averaged over
    the `batch` sequences. `scores` [batch x t, E] and `chosen` [batch x t, K] are this rank's
    tokens, sequence-major (t = T / group size: under cp and tp each rank holds part of every
    sequence, and the per-sequence sums are all-reduced over `group`). The gradient reaches
    the scores through P only."""
    rows, k = chosen.shape
    per_rank = rows // batch
    seq_len = per_rank * (1 if group is None else group.size())
    normed = scores / scores.sum(-1, keepdim=True)
    p = _summed(normed.view(batch, per_rank, n_experts).sum(1), group) / seq_len  # [b, E]
    seq = torch.arange(rows, device=chosen.device).div(per_rank, rounding_mode="floor")
    slots = (seq[:, None] * n_experts + chosen).reshape(-1)
    counts = expert_counts(slots, batch * n_experts).view(batch, n_experts).to(scores.dtype)
    f = _summed(counts, group) * (n_experts / (k * seq_len))
    return (f * p).sum(-1).mean()


def _summed(t: torch.Tensor, group) -> torch.Tensor:
    """`t` summed over `group` (autograd-aware: the backward sums the gradients), or `t`."""
    if group is None:
        return t
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(t, group=group)


def capacity(moe: MoEArgs, tokens: int) -> int:
    return math.ceil(moe.capacity_factor * tokens * moe.top_k / moe.n_experts)


def capacity_mask(slots: torch.Tensor, counts: torch.Tensor, cap: int):
    """(keep [pairs] bool: the first `cap` pairs of each expert in token order, kept counts)."""
    order = slots.argsort(stable=True)
    starts = counts.cumsum(0) - counts
    rank_in_expert = torch.empty_like(slots)
    rank_in_expert[order] = torch.arange(slots.numel(), device=slots.device) - starts[slots[order]]
    keep = rank_in_expert < cap
    return keep, counts.clamp(max=cap)


def kept_first(slots: torch.Tensor, keep: torch.Tensor, counts: torch.Tensor, rows: int):
    """(order [rows]: the kept pairs sorted by expert in token order, then dropped ones to fill
    `rows`; valid [rows, 1] bool: the row is a kept pair). `rows` is a static bound on the kept
    pairs (min(pairs, E x capacity)), so no shape depends on the data: a boolean index here
    would read the kept count back to the host (a sync per MoE layer on a GPU). The experts
    compute `counts`' rows only; the rows past them are masked in and out."""
    order = (slots + keep.logical_not() * counts.numel()).argsort(stable=True)[:rows]
    valid = torch.arange(rows, device=slots.device) < counts.sum()
    return order, valid[:, None]


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """{layer id: its MoE} of `model` (cached on it; empty for a dense model)."""
    found = model.__dict__.get("_moe_layers")
    if found is None:
        found = {m.layer_id: m for m in model.modules() if isinstance(m, MoE)}
        model.__dict__["_moe_layers"] = found
    return found


class _AttachAux(torch.autograd.Function):
    """y unchanged; in backward, the aux term gets `scale` as its gradient. The aux losses
    thus back-propagate from the block's output (as in DeepSeek's `AddAuxiliaryLoss`), after
    FSDP has re-gathered the block's parameters for its backward and inside activation
    checkpointing's recompute, not from a separate loss term that reaches the router first."""

    @staticmethod
    def forward(ctx, y, aux, scale):
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, device=grad.device), None


def set_aux_scale(model: nn.Module, scale: float) -> None:
    """The weight of every MoE layer's aux terms in the backward (1 / microbatches: the aux
    losses are means over each microbatch)."""
    for layer in moe_layers(model).values():
        layer.aux_scale = scale


def take_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The weighted aux and router z-loss values of the forwards since the last take (summed
    over layers, detached: they back-propagate through `_AttachAux`), or None."""
    terms = []
    for layer in moe_layers(model).values():
        terms += layer.aux_terms
        layer.aux_terms = []
    return torch.stack(terms).sum() if terms else None


@torch.no_grad()
def balance_experts(
    model: nn.Module,
    n_layers: int,
    coeff: float,
    device,
    moe_ids: list[int] | None = None,
    stepped: bool | torch.Tensor = True,
) -> dict[str, torch.Tensor]:
    """After an optimizer step: every rank's expert loads of the step summed (one all-reduce
    over the world of a [layers, experts + 2] tensor: a pipeline stage fills only its rows),
    the balancing bias updated (coeff > 0) if the optimizer stepped (`stepped`, a bool or a
    device flag: a skipped step leaves the bias as it leaves the weights), and the metrics as
    0-d device tensors (read on the host only at logging steps: no sync here): per MoE layer
    the max / mean load and the dropped fraction. `moe_ids`: every MoE layer of the whole
    model, this stage's or not (default: this model's). Empty for a dense model."""
    import torch.distributed as dist

    layers = moe_layers(model)
    id_list = sorted(layers) if moe_ids is None else list(moe_ids)
    if not id_list:  # a dense model (decided for the whole model: every rank returns here)
        return {}
    # A pipeline stage may hold no MoE layer; it still joins the all-reduce below.
    n_experts = model.args.moe.n_experts  # the args: a stage without MoE layers knows too
    table = torch.zeros(n_layers, n_experts + 2, device=device)
    for i, layer in layers.items():
        stats = layer.take_stats()
        table[i, :n_experts] = stats["tokens_per_expert"].to(device)
        table[i, n_experts] = stats["dropped"].to(device)
        table[i, n_experts + 1] = stats["routed"].to(device)
    if dist.is_initialized():
        dist.all_reduce(table)
    if coeff and stepped is not False:
        update_expert_bias(
            list(layers.values()), [table[i, :n_experts] for i in layers], coeff, stepped
        )
    rows = table[_row_index(tuple(id_list), device)]
    loads, routed = rows[:, :n_experts], rows[:, n_experts + 1].clamp_min(1)
    mean = loads.mean(1)
    imbalance = torch.where(mean > 0, loads.amax(1) / mean.clamp_min(1e-30), 0.0)
    dropped = rows[:, n_experts] / routed
    out = {}
    for j, i in enumerate(id_list):
        out[f"moe/layer_{i}/load_imbalance"] = imbalance[j]
        out[f"moe/layer_{i}/dropped_fraction"] = dropped[j]
    return out


_ROWS: dict = {}


def _row_index(ids: tuple[int, ...], device) -> torch.Tensor:
    """The MoE layers' rows of the loads table, made on the device once (a new host-to-device
    copy from a pageable list each step would synchronise the stream)."""
    key = (ids, str(device))
    if key not in _ROWS:
        _ROWS[key] = torch.tensor(ids, device=device)
    return _ROWS[key]


@torch.no_grad()
def update_expert_bias(
    moes: list[MoE], loads: list[torch.Tensor], coeff: float, stepped: bool | torch.Tensor = True
) -> None:
    """Aux-loss-free balancing after an optimizer step: each expert's bias moves by coeff
    toward balance, sign(mean load - load), from the step's loads summed over every rank.
    `stepped` as a device flag: no move where it is false (decided on the device, no sync)."""
    for moe, load in zip(moes, loads, strict=True):
        move = torch.sign(load.mean() - load)
        if isinstance(stepped, torch.Tensor):
            move = move * stepped.to(move.device, move.dtype)
        moe.router.expert_bias += coeff * move.to(moe.router.expert_bias.dtype)
