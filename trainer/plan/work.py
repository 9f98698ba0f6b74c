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
(tp, cp, pp, and ep's borrowed ranks). What the kernels execute beyond model FLOPs is expected,
and measured, not assumed (`measure_factors`): the same counter runs one block of each kind
at the config's shapes on fake tensors, with and without its AC wrapping, and the model
without blocks (embedding, head, loss):

    kernel    = counted FLOPs without AC / model FLOPs (the attention backward recomputes the
                scores: 5 products for the forward's 2, ~1.02x a Llama 70B block)
    recompute = counted FLOPs with the config's AC / without (torch's checkpoint stops its
                recompute once the saved tensors are back: before the block's last matmul,
                ~1.25x a dense block under full AC, not 4/3; op-level SAC recomputes no matmul)

A rank above kernel x recompute by more than 10% is named in a warning. Pipeline stages
differ by their units (trainer/parallel/pp_layout.py balances them by model FLOPs; whole
layers cannot always split evenly): under PP each traced pp rank has its own ratio.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_REGISTERED = False


def _register_formulas() -> None:
    """FLOP formulas FlopCounterMode (torch 2.11-2.13) lacks: the CPU's flash attention, the
    in-place addmm (the chunked loss's fp32 head-gradient accumulator) and the experts'
    grouped GEMM (whose backward is grouped GEMMs too)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from torch.utils.flop_counter import (
        flop_registry,
        register_flop_formula,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    aten = torch.ops.aten
    if hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu"):

        @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
        def _cpu_flash(query, key, value, *args, out_shape=None, **kwargs) -> int:
            return sdpa_flop_count(query, _heads_of(query, key), _heads_of(query, value))

        @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
        def _cpu_flash_backward(
            grad_out, query, key, value, *args, out_shape=None, **kwargs
        ) -> int:
            return sdpa_backward_flop_count(
                grad_out, query, _heads_of(query, key), _heads_of(query, value)
            )

    if aten.addmm_ not in flop_registry:  # the chunked loss accumulates the head's gradient

        @register_flop_formula(aten.addmm_)
        def _addmm_inplace(self_shape, a, b, *args, out_shape=None, **kwargs) -> int:
            return 2 * a[0] * a[1] * b[1]

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


@dataclasses.dataclass(frozen=True)
class Factors:
    """What executing the model costs against its model FLOPs (see the module docstring)."""

    kernel: float  # counted without AC / model FLOPs
    recompute: float  # counted with the config's AC / without
    blocks: dict  # layer kind -> (counted without AC, with AC, model FLOPs) per token

    @property
    def expected(self) -> float:
        return self.kernel * self.recompute


_FACTORS: dict = {}


def measure_factors(cfg) -> Factors:
    """The kernel and recompute factors of `cfg`'s model, counted on fake tensors: one block
    of each kind (trainer/models/flops.py `layer_kind`) with and without the config's AC,
    and the model without blocks; summed over the model's blocks (selective every-k-th AC:
    the blocks it wraps). Cached per model, sequence, loss and AC."""
    from trainer.models.flops import layer_kind, unit_flops
    from trainer.plan.memory import plan_args, resolve_vocab

    args, ac, t = plan_args(cfg, resolve_vocab(cfg)[0]), cfg.activation_checkpoint, cfg.training
    key = repr((args, ac, t.seq_len, t.loss, t.loss_chunk_size, t.z_loss_weight))
    if key in _FACTORS:
        return _FACTORS[key]
    model = unit_flops(args, t.seq_len)
    first = {}
    for i in range(args.n_layers):
        first.setdefault(layer_kind(args, i), i)
    rest = count_block(cfg, args, None, "none")
    blocks = {
        kind: (
            count_block(cfg, args, i, "none") - rest,
            count_block(cfg, args, i, ac.mode) - rest if ac.mode != "none" else None,
            model[1 + i],
        )
        for kind, i in first.items()
    }
    plain = rest + sum(blocks[layer_kind(args, i)][0] for i in range(args.n_layers))
    wrapped = rest
    for i in range(args.n_layers):
        bare, ac_count, _ = blocks[layer_kind(args, i)]
        every = (
            int(ac.selective_ac_option)
            if ac.mode == "selective" and ac.selective_ac_option != "op"
            else 1
        )
        wrapped += bare if ac_count is None or i % every else ac_count
    head_model = model[0] + model[-1] - _mtp_flops(args, t.seq_len)
    out = Factors(plain / (head_model + sum(model[1:-1])), wrapped / plain, blocks)
    _FACTORS[key] = out
    return out


def _mtp_flops(args, seq_len: int) -> float:
    """The MTP modules' share of the head unit (the measurement runs the model without them)."""
    import dataclasses as dc

    from trainer.models.flops import unit_flops

    return unit_flops(args, seq_len)[-1] - unit_flops(dc.replace(args, mtp_layers=0), seq_len)[-1]


def count_block(cfg, args, layer: int | None, ac_mode: str) -> float:
    """Counted FLOPs per token of one forward and backward of the model keeping only block
    `layer` (None: no block), that block wrapped as `ac_mode` AC wraps it, on fake bf16
    tensors (FLOPs do not depend on the dtype) at one sequence of the config's length,
    through the config's loss."""
    import dataclasses as dc

    from torch._subclasses.fake_tensor import FakeTensorMode

    from trainer.models import registry
    from trainer.models.build import build_model
    from trainer.models.common.loss import build_loss
    from trainer.models.flops import layer_kind
    from trainer.parallel.parallelize import apply_ac

    t, ac = cfg.training, cfg.activation_checkpoint
    small = dc.replace(args, mtp_layers=0, n_layers=(layer or 0) + 1)
    if (
        registry.hooks(args).whole_model_for_a_layer
        or layer is not None
        and layer_kind(small, layer) != layer_kind(args, layer)
    ):
        small = dc.replace(args, mtp_layers=0)  # the layer's kind needs the whole model
    model = build_model(small)
    for key in [k for k in model.layers if int(k) != layer]:
        del model.layers[key]
    if ac_mode != "none":
        apply_ac(model, ac_mode, ac.selective_ac_option, ac.selective_op_matmuls)
    tokens = torch.randint(0, args.vocab_size, (1, t.seq_len))
    docs = (torch.arange(t.seq_len) * 4 // t.seq_len)[None] if model.uses_documents else None
    loss_fn = build_loss(t.loss, t.loss_chunk_size, z_loss_weight=t.z_loss_weight)
    model.to(torch.bfloat16)  # on meta; the grouped GEMM takes bf16 only
    with FakeTensorMode(allow_non_fake_inputs=True):
        model.to_empty(device="cpu")
        with counting() as flops:
            model(tokens, tokens, loss_fn, doc_ids=docs).backward()
    return flops.get_total_flops() / t.seq_len


def expected_ratio(cfg) -> float:
    """What executing `cfg`'s model costs against its model FLOPs: kernel x recompute."""
    return measure_factors(cfg).expected


def ideal_flops(
    cfg, args, world: int, dp: int, tokens: float | None, microbatches: int = 1
) -> float:
    """A rank's even share of the model FLOPs of `tokens` of its dp rank (None: those of
    `microbatches` microbatches)."""
    from trainer.models.flops import flops_per_token

    t = cfg.training
    if tokens is None:
        tokens = t.local_batch_size * t.seq_len * microbatches
    return flops_per_token(args, t.seq_len) * tokens * dp / world


def work_lines(cfg, ranks: list[tuple], pp: int, record: dict | None = None) -> list[str]:
    """The trace's work lines (`ranks`: (pp rank, its FLOPs, its ideal share[, the pp ranks of
    its shape]) of each traced rank) against kernel x recompute (`measure_factors`), and a
    warning where the busiest does more than that. `record`: filled for `--json`."""
    f = measure_factors(cfg)
    expected = f.expected
    ratios = [
        (k, flops / max(ideal, 1.0), flops, ideal, list(rest[0]) if rest else [k])
        for k, flops, ideal, *rest in ranks
    ]
    k, ratio, flops, ideal, _ = max(ratios, key=lambda x: x[1])
    who = f"pp rank {k}'s first rank" if pp > 1 else "rank 0"
    lines = [
        f"  work: {who} computes {flops / 1e12:.3f} TFLOP (matmuls and attention) "
        f"against an even share of {ideal / 1e12:.3f}: {ratio:.3f}x; expected "
        f"{expected:.3f}x, measured on the model's blocks (kernels {f.kernel:.3f}x: the "
        f"attention backward recomputes the scores; AC's recompute {f.recompute:.3f}x): "
        f"{ratio / expected:.3f}x of an even share of the work executed"
    ]
    if pp > 1:
        from trainer.plan.pipeline import rank_work

        split = rank_work(cfg)
        lines.append(
            "    per traced pp rank, x its share (the split's model FLOPs): "
            + ", ".join(f"{ranks_text(of)} {x:.3f}x ({split[r]:.3f})" for r, x, _, _, of in ratios)
        )
    if ratio > 1.10 * expected:
        why = (
            "its stages hold more of the model than an even split (whole layers: "
            "parallelism.pipeline_parallel_split_points can move them)"
            if pp > 1
            else "some of it is repeated on other ranks"
        )
        lines.append(
            f"  warning: {who} does {ratio / expected:.2f}x its share of the model's "
            f"work: {why} (trainer/plan/work.py)"
        )
    if record is not None:
        record.update(
            busiest_pp_rank=k,
            flops=flops,
            ideal_flops=ideal,
            ratio=ratio,
            expected=expected,
            kernel_factor=f.kernel,
            recompute_factor=f.recompute,
            vs_expected=ratio / expected,
            per_rank=[{"pp_rank": r, "ratio": x, "stands_for": of} for r, x, _, _, of in ratios],
        )
    return lines


def ranks_text(of: list[int]) -> str:
    """'rank 3', or 'ranks 1-6' for a run of ranks of one shape traced once."""
    if len(of) == 1:
        return f"rank {of[0]}"
    run = of == list(range(of[0], of[-1] + 1))
    return f"ranks {of[0]}-{of[-1]}" if run else "ranks " + ", ".join(map(str, of))
