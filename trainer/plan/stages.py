"""Pipeline configs on the traced dry run: each distinct pp rank's stages, traced on their own.

A pipeline schedule cannot run on fake tensors (its warm-up reads a received value on the
host), and one process is one rank anyway. So the trace takes the place of a pp rank (the fake
world's rank `pp_rank x world / pp`: the first rank of every other mesh dimension), builds the
model exactly as train.py does (pruned to that rank's stages, TP, AC, FSDP per stage) and runs
a real TrainStep whose pipeline loop (trainer/parallel/pipeline.py) has its schedule step
replaced by `StageDriver`: the rank's own stage-microbatches in the order that holds the most
at once,

    1. one forward and backward of every stage of the rank, gradient sync off: in a schedule's
       steady state the unsharded gradients of earlier microbatches are already accumulating;
    2. the K stage-microbatches the schedule keeps in flight on this rank (trainer/plan/
       pipeline.py `in_flight`: 1F1B's first stage pp of them, its last one), forwards only,
       on fake activations from the previous stage (tokens on the first);
    3. their backwards, in order, on fake gradients from the next stage (the loss on the last),
       neither resharding nor reducing, as a schedule's backwards do; then each stage's FSDP
       post-backward (`reduce_stage`, torch's `perform_reduce_grad`): reshard, and the
       reduce-scatter on the optimizer step's last schedule step.

Every pp rank whose stages differ in shape (trainer/plan/pipeline.py `rank_shape`: its units,
each layer by its kind) is traced, once per shape: ranks of one shape do the same work per
stage-microbatch and differ only in how many they hold at once, so the plan's memory-largest
of them stands for the others (the 405B's middle ranks 1-6 are one trace). The busiest rank
by the plan's work count is therefore always traced.

Per optimizer step the books scale as the schedule would run them: the FSDP all-gathers once
per schedule step (stages keep their parameters gathered over its microbatches), the gradient
reduce-scatters once per optimizer step under gradient_accumulation_sync 'last' (else once per
schedule step), and every other collective (tp, cp, ep, the stages' point-to-point sends) per
stage-microbatch: m x v x accum of them, m pipeline microbatches, v stages per rank.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.pipelining.microbatch import split_args_kwargs_into_chunks

from trainer.health import heartbeat
from trainer.parallel.pipeline import reduce_stage


def traced_ranks(cfg, world_size: int) -> dict[int, list[int]]:
    """The pp ranks the trace runs, each with the ranks of its shape it stands for: one per
    shape, the plan's memory-largest of them (see the module docstring)."""
    from trainer.plan.memory import memory_plan
    from trainer.plan.pipeline import rank_shape

    pp = cfg.parallelism.pipeline_parallel_degree
    totals = memory_plan(cfg, world_size)["pp_rank_totals"]
    shapes: dict[tuple, list[int]] = {}
    for r in range(pp):
        shapes.setdefault(rank_shape(cfg, r), []).append(r)
    return dict(sorted((max(ranks, key=totals.__getitem__), ranks) for ranks in shapes.values()))


class StageDriver:
    """Stands in for `PipelineLoop.schedule_step` on the trace (see the module docstring)."""

    def __init__(self, loop, cfg, pp_rank: int, traffic):
        from trainer.plan.pipeline import in_flight

        self.loop, self.cfg, self.traffic = loop, cfg, traffic
        self.stages = list(loop.model.pipeline_stages)
        self.owner, self.me = loop.model.stage_ranks, pp_rank
        v, m = len(self.stages), loop.n_microbatches
        self.held = min(m * v, math.ceil(in_flight(cfg, pp_rank) * v))
        self.warm = v if m * v > self.held else 0
        self.traced = 0  # stage-microbatches run (forward and backward)

    def __call__(self, inputs, labels, losses: list, kwargs: dict) -> None:
        args = (inputs,) if self.loop.first else ()
        chunks_args, chunks_kwargs = split_args_kwargs_into_chunks(
            args, kwargs, self.loop.n_microbatches
        )
        mb_args = chunks_args[0]
        mb_kwargs = chunks_kwargs[0]
        for stage in self.stages[: self.warm]:  # the steady state's accumulating gradients
            self._backward(*self._forward(stage, mb_args, mb_kwargs, losses), sync=False)
        running = [
            self._forward(self.stages[j % len(self.stages)], mb_args, mb_kwargs, losses)
            for j in range(self.held)
        ]
        for item in running:
            self._backward(*item, sync=False)
        for stage in self.stages:  # the schedule step's end: torch's perform_reduce_grad
            reduce_stage(stage, now=self.loop.reduce_now)
        self.traced += self.warm + self.held

    def _forward(self, stage, mb_args, mb_kwargs, losses):
        heartbeat.phase("forward")
        spec = stage.spec
        if spec.embedding:
            x = mb_args[0]
        else:
            shape = self.loop._shapes(stage, self.cfg, torch.device("cpu"))["input_args"]
            x = torch.empty(shape.shape, dtype=shape.dtype).requires_grad_()
        out = stage(x, **mb_kwargs)
        if spec.head:
            out = self.loop._scaled(out, None)
            losses.append(out)
        elif self.owner[spec.index + 1] != self.me:  # the activations to the next rank
            self.traffic.add("pp", out.numel() * out.element_size())
        return stage, x, out

    def _backward(self, stage, x, out, sync: bool) -> None:
        heartbeat.phase("backward")
        for name in (
            "set_requires_gradient_sync",
            "set_reshard_after_backward",
            "set_is_last_backward",
        ):
            if hasattr(stage, name):
                getattr(stage, name)(sync)
        if stage.spec.head:
            out.backward()
        else:
            out.backward(torch.empty_like(out))
        if not stage.spec.embedding and self.owner[stage.spec.index - 1] != self.me:
            self.traffic.add("pp", x.numel() * x.element_size())  # its gradient, back

    def per_step(self, accum: int) -> dict[str, float]:
        """Bytes per optimizer step by dimension (see the module docstring)."""
        from trainer.plan.traffic import DIMS

        per_mb = self.loop.n_microbatches * len(self.stages) * accum / max(self.traced, 1)
        syncs = 1 if self.cfg.training.gradient_accumulation_sync == "last" else accum
        policy = str(self.cfg.parallelism.fsdp_reshard_after_forward)
        gathers = accum if policy in ("default", "never") else per_mb
        out = dict.fromkeys(DIMS, 0.0)
        for seg, books in self.traffic.bytes.items():
            for (label, kind), b in books.items():
                if seg == "step":
                    w = 1
                elif label in ("dp_shard", "dp_replicate"):
                    w = gathers if kind == "gather" else syncs
                else:
                    w = per_mb
                out[label] = out.get(label, 0.0) + w * b
        return out

    def ideal_tokens(self) -> float:
        """The tokens whose model FLOPs the traced stage-microbatches stand for."""
        par = self.cfg.parallelism
        return (
            par.pipeline_parallel_microbatch_size
            * self.cfg.training.seq_len
            * self.traced
            / len(self.stages)
        )
