"""The named model flavors (`model.flavor`: each family's, from its package's flavors.py)
and `model_args`, which fits one to a run: its
vocab, sequence length, number of blocks, attention fields and [moe] knobs. Without torch, like
args.py: a config is checked before any process starts."""

from __future__ import annotations

import dataclasses

from trainer.models.args import ModelArgs
from trainer.models.registry import package_flavors

# Every family's flavors, in the registry's order (the docs list them so).
FLAVORS: dict[str, ModelArgs] = package_flavors()


def model_args(
    flavor: str,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    n_layers: int = 0,
    moe_config=None,
    **attention,
):
    """The flavor's args with the run's vocab and length, its first `n_layers` blocks (0: all;
    model.n_layers), the attention fields of trainer.models.common.attention.attention_args
    (default:
    causal, sequence positions) and, for a MoE flavor, the [moe] section's training knobs
    (`moe_config`)."""
    args = FLAVORS[flavor]
    changes = {
        k: v
        for k, v in (
            ("vocab_size", vocab_size),
            ("max_seq_len", max_seq_len),
            ("n_layers", n_layers),
        )
        if v
    }
    if moe_config is not None and args.moe is not None:
        changes["moe"] = dataclasses.replace(
            args.moe,
            capacity_factor=moe_config.capacity_factor,
            aux_loss_weight=moe_config.aux_loss_weight,
            seq_aux_loss_weight=moe_config.seq_aux_loss_weight,
            router_z_loss_weight=moe_config.router_z_loss_weight,
            n_experts=moe_config.num_experts or args.moe.n_experts,
            top_k=moe_config.top_k or args.moe.top_k,
            n_group=moe_config.n_group or args.moe.n_group,
            topk_group=moe_config.topk_group or args.moe.topk_group,
            dispatch=moe_config.dispatch,
            save_dispatch=moe_config.save_dispatch,
        )
    return dataclasses.replace(args, **changes, **attention)
