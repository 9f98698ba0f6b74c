"""Build a model of any family on the meta device, as its family builds it
(trainer/models/registry.py)."""

from __future__ import annotations

import torch

from trainer.models import registry
from trainer.models.args import ModelArgs


def build_model(args: ModelArgs) -> torch.nn.Module:
    """Validated, on the meta device: no memory is allocated until `to_empty` after sharding."""
    args.validate()
    with torch.device("meta"):
        return registry.hooks(args).build(args)


def new_model(args: ModelArgs) -> torch.nn.Module:
    """The family's model on the current device, weights uninitialised: what tests and tools
    that run a model eagerly, without sharding, start from (`init_weights(seed)` next)."""
    return registry.hooks(args).build(args)
