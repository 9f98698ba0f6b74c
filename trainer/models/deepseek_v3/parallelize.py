"""Multi-head latent attention's tensor-parallel styles (trainer/parallel/tp.py asks them
through the family's hooks, `tp_mixer_styles`)."""

from __future__ import annotations

import functools

from torch.distributed.tensor import Replicate, Shard

from trainer.parallel.tp import sum_grad_over


def mla_styles(attention, tp_mesh, colwise, prepare_input) -> dict:
    """Multi-head latent attention (trainer/models/common/mla.py): the heads split (`wq` or
    `wq_b`, and `wkv_b` colwise; `wo` rowwise), the down projections and their norms replicated:
    plain parameters that every tp rank applies to the whole gathered sequence. Their
    gradients come out whole on every rank: the colwise up projections all-reduce their
    input's gradient, and the shared RoPE key's gradient is summed over tp here."""
    attention.shared_key = functools.partial(sum_grad_over, group=tp_mesh.get_group())
    styles = {
        "attention": prepare_input(
            input_layouts=(Shard(1), None, None, None),
            desired_input_layouts=(Replicate(), None, None, None),
            use_local_output=True,
        ),
        "attention.wkv_b": colwise(),
    }
    styles["attention.wq" if attention.wq is not None else "attention.wq_b"] = colwise()
    return styles
