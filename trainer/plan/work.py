"""Each rank's work against its ideal share, counted in the traced dry run.

Parity tests on a few CPU ranks show that every layout computes the right losses; they cannot
show a rank repeating work another rank already did (a MoE layer run whole on every tp rank,
context parallelism silently off under PP, padded expert shards). The trace runs one rank's
real step, so it can count that rank's matmul and attention FLOPs (torch's FlopCounterMode on
the fake tensors, with formulas for the ops it lacks: the CPU flash-attention kernel and
`_grouped_mm`) and set them against the rank's ideal share:

    ideal = model FLOPs per token (trainer/models/flops.py) x the tokens of the traced
            microbatches x dp / world

i.e. the model's work of a dp rank's microbatches split evenly over the ranks that share them
(tp, cp, pp, and ep's borrowed ranks). Recomputation under activation checkpointing is real
extra work, expected: full AC recomputes each block's forward (4/3 of the block FLOPs),
selective every-k-th one k-th of that, op-level SAC nothing that counts (its recomputed ops
are elementwise). A rank above its expected ratio by more than 10% is named in a warning.
Pipeline stages differ by design (the embedding and head sit at the ends): rank 0 holds the
first stage only, so under PP the ratio is stage 0's.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_REGISTERED = False


def _register_formulas() -> None:
    """FLOP formulas FlopCounterMode (torch 2.11-2.13) lacks: the CPU's flash attention and
    the experts' grouped GEMM (whose backward is grouped GEMMs too)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.utils.flop_counter import (register_flop_formula, sdpa_backward_flop_count,
                                          sdpa_flop_count)

    aten = torch.ops.aten
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):
        @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
        def _cpu_flash(query, key, value, *args, out_shape=None, **kwargs) -> int:
            return sdpa_flop_count(query, _heads_of(query, key), _heads_of(query, value))

        @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
        def _cpu_flash_backward(grad_out, query, key, value, *args, out_shape=None,
                                **kwargs) -> int:
            return sdpa_backward_flop_count(grad_out, query, _heads_of(query, key),
                                            _heads_of(query, value))

    if hasattr(aten, "_grouped_mm"):
        @register_flop_formula(aten._grouped_mm)
        def _grouped(a, b, *args, out_shape=None, **kwargs) -> int:
            if len(out_shape) == 3:  # a weight gradient: [K, N] x [N, M] cut into groups
                return 2 * a[0] * a[1] * b[-1]
            return 2 * a[0] * a[-1] * b[-1]  # rows of [N, K], each by its group's [K, M]

    _REGISTERED = True


def _heads_of(query, kv):
    """A key/value shape [b, h_kv, s, d] with the query's heads: GQA's kernels broadcast each
    KV head over its query heads (torch 2.11's formula refuses h_kv != h_q; 2.13 does this)."""
    return torch.Size([kv[0], query[1], *kv[2:]])


def _local(x):
    """A DTensor's local shard (what this rank computes on), else `x`."""
    return x._local_tensor if hasattr(x, "_local_tensor") else x


class _Counter(TorchDispatchMode):
    """FLOPs of the ops dispatched inside, by torch's formulas on THIS rank's shapes: an op on
    DTensors (tensor parallelism) reaches a mode with the global shapes, and its local
    computation below it is not seen again, so its formula gets the local shards' shapes
    (the colwise matmul's 1/tp of the outputs, the rowwise one's 1/tp of the inner dim)."""

    def __init__(self):
        super().__init__()
        self.total = 0

    def get_total_flops(self) -> int:
        return self.total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            a, k, o = tree_map(_local, (args, kwargs, out))
            self.total += formula(*a, **k, out_val=o)
        return out


@contextlib.contextmanager
def counting():
    """Count the FLOPs of what runs inside; yields the counter (`.get_total_flops()`)."""
    _register_formulas()
    counter = _Counter()
    with counter:
        yield counter


def expected_ratio(cfg) -> float:
    """What activation checkpointing adds to a rank's model FLOPs (see the module docstring)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return 4 / 3
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        return 1 + 1 / (3 * int(ac.selective_ac_option))
    return 1.0


def ideal_flops(cfg, args, world: int, dp: int, tokens: float | None,
                microbatches: int = 1) -> float:
    """A rank's even share of the model FLOPs of `tokens` of its dp rank (None: those of
    `microbatches` microbatches)."""
    from trainer.models.flops import flops_per_token

    t = cfg.training
    if tokens is None:
        tokens = t.local_batch_size * t.seq_len * microbatches
    return flops_per_token(args, t.seq_len) * tokens * dp / world


def work_lines(cfg, ranks: list[tuple[int, float, float]], pp: int) -> list[str]:
    """The trace's work line (`ranks`: (pp rank, its FLOPs, its ideal share) of each traced
    rank), and a warning where the busiest does more than its share."""
    expected = expected_ratio(cfg)
    ratios = [(k, flops / max(ideal, 1.0), flops, ideal) for k, flops, ideal in ranks]
    k, ratio, flops, ideal = max(ratios, key=lambda x: x[1])
    who = f"pp rank {k}'s first rank" if pp > 1 else "rank 0"
    lines = [f"  work: {who} computes {flops / 1e12:.3f} TFLOP (matmuls and attention) "
             f"against an even share of {ideal / 1e12:.3f}: {ratio:.2f}x (activation "
             f"checkpointing's recompute: {expected:.2f}x expected)"]
    if pp > 1:
        lines.append("    per traced pp rank: " + ", ".join(f"rank {r} {x:.2f}x"
                                                          for r, x, _, _ in ratios))
    if ratio > 1.10 * expected:
        why = ("its stages hold more of the model than an even split (the embedding, the head "
               "and the loss sit on the ends: parallelism.pipeline_parallel_split_points "
               "can give the end stages fewer layers)" if pp > 1 else
               "some of it is repeated on other ranks")
        lines.append(f"  warning: {who} does {ratio / expected:.2f}x its share of the model's "
                     f"work: {why} (trainer/plan/work.py)")
    return lines
