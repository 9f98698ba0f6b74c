"""The step's seam, as types: what a parallelism's forward/backward takes and returns.

trainer/parallel/microbatches.py builds one (`build_forward_backward`); each implementation
(`MicrobatchLoop` there, with or without context parallelism's split, and `PipelineLoop` in
pipeline.py) returns `Losses`.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch


class Losses(NamedTuple):
    loss_sum: torch.Tensor  # this rank's summed token loss / the step's global token count
    z_loss: torch.Tensor | None  # the z-loss term summed over this rank's tokens, or None
    aux: torch.Tensor | None = None  # MoE aux + router z terms, mean over microbatches, or None
    # the MTP heads' summed token loss (every depth) / the global token count, or None
    mtp: torch.Tensor | None = None


class ForwardBackward(Protocol):
    def __call__(
        self,
        batches: list[tuple[torch.Tensor, torch.Tensor]],
        global_tokens: torch.Tensor,
        step: int,
    ) -> Losses:
        """Run forward and backward over this rank's microbatches `(inputs, labels)` of one step;
        gradients accumulate in the model's parameters, ready for the optimizer."""
