"""What activation checkpointing's recompute must not read again: values the forward took from
the host or from other ranks.

A checkpointed block runs its forward twice: once in the forward pass, again in the backward
(the recompute). Most of it is arithmetic on saved inputs, but a MoE layer under expert
parallelism also exchanges its per-expert counts with the other ep ranks and reads the split
sizes on the host (trainer/parallel/expert_parallel.py): one collective and one host sync per
layer, and the recompute would repeat both for values it already had. `HostMemo` keeps them:
the block's first run records each value in order, the recompute replays them in the same
order. Every ep rank recomputes the same blocks, so every rank skips the same exchanges.

    memo = current()        # None outside a checkpointed block
    value = memo.replay() if memo else None
    if value is None: value = compute(); memo and memo.record(value)

It also holds the expert parallel dispatch's received rows (trainer/parallel/ep_dispatch.py,
`moe.save_dispatch`), popped by the recompute, and tells a layer that it is being recomputed
(`replaying`: the MoE's logged aux terms are the first run's).
"""

from __future__ import annotations

import contextlib
import contextvars

_CURRENT: contextvars.ContextVar = contextvars.ContextVar("host_memo", default=None)

# Process groups whose functional all-gathers op-level activation checkpointing saves rather
# than repeats in the recompute (context parallelism's K/V: trainer/parallel/
# context_parallel.py registers its group). TP's all-gathers are recomputed, as torchtitan's
# policy does: they are cheap to repeat and [batch, seq, dim] each to keep.
SAVED_GATHER_GROUPS: set[str] = set()


class HostMemo:
    """The host-side values of one checkpointed block call (its forward and its recompute)."""

    def __init__(self):
        self.values: list = []
        self.runs = 0
        self.replaying = False  # a recompute: what the first run recorded (values, logged
        # terms such as the MoE's aux losses) is not recorded again
        self.cursor = 0

    @contextlib.contextmanager
    def run(self):
        """One run of the block: the first records, any later one replays."""
        self.runs += 1
        self.replaying, self.cursor = self.runs > 1, 0
        token = _CURRENT.set(self)
        try:
            yield
        finally:
            _CURRENT.reset(token)

    def replay(self):
        """The next recorded value during a recompute, else None."""
        if not self.replaying or self.cursor >= len(self.values):
            return None
        self.cursor += 1
        return self.values[self.cursor - 1]

    def record(self, value) -> None:
        if not self.replaying:
            self.values.append(value)


def current() -> HostMemo | None:
    return _CURRENT.get()
