"""The parts of a checkpoint besides the model and optimizer (optim_state.py): the loop's own
state, the RNG states, and an adapter that gives DCP any object with state_dict /
load_state_dict (the lr scheduler, the dataloader)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.checkpoint.stateful import Stateful


@dataclass
class TrainState(Stateful):
    """The loop's own state. Checkpoints from before the spike window and rollbacks lack those
    keys: they load with the defaults (Checkpointer.load reads this part leniently)."""

    step: int = 0
    tokens_seen: int = 0
    loss_window: list[float] = field(default_factory=list)  # the spike detector's (guard.py)
    rollback_steps: list[int] = field(default_factory=list)  # one per rollback: the step that
    # passes over a global batch (the one it spiked on)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "loss_window": list(self.loss_window),
            "rollback_steps": list(self.rollback_steps),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.tokens_seen = int(sd["step"]), int(sd["tokens_seen"])
        self.loss_window = [float(x) for x in sd.get("loss_window", [])]
        self.rollback_steps = [int(s) for s in sd.get("rollback_steps", [])]


class Adapter(Stateful):
    """Wrap an object with state_dict/load_state_dict (scheduler, dataloader) for DCP."""

    def __init__(self, obj):
        self.obj = obj

    def state_dict(self) -> dict:
        return self.obj.state_dict()

    def load_state_dict(self, sd: dict) -> None:
        self.obj.load_state_dict(sd)


class RNGState(Stateful):
    """The RNG states. Every rank is seeded identically, so one copy serves all world sizes."""

    def state_dict(self) -> dict:
        sd = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            sd["cuda"] = torch.cuda.get_rng_state()
        return sd

    def load_state_dict(self, sd: dict) -> None:
        torch.set_rng_state(sd["cpu"])
        if "cuda" in sd and torch.cuda.is_available():
            torch.cuda.set_rng_state(sd["cuda"])
