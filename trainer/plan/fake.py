"""The bookkeeping of the traced dry run (trainer/plan/trace.py): a fake-tensor mode that books
the memory every op's outputs would take, a `fake` process group of any world size, and the
peak's summary by category.

`MemoryTrace` records every storage the fake tensors would allocate, its bytes, the op that
made it and the loop's phase then (trainer/health/heartbeat.py), and frees it when the storage
dies (FSDP2's `resize_` of its unsharded buffers included: `tracking`). Only an op's own
outputs count: what a fake implementation runs inside an op, and DTensor's sharding
propagation (fake tensors of the global shapes), are not what a GPU kernel allocates.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from trainer.health import heartbeat
from trainer.plan.traffic import COMM_NAMESPACES

GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass
class Allocation:
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    phase: str
    category: str = ""  # set by `MemoryTrace.book_as`; else from the phase (summarize)

    def describe(self) -> str:
        return (
            f"{self.nbytes / GIB:.3f} GiB {self.dtype} {list(self.shape)} from {self.op} "
            f"({self.phase})"
        )


class MemoryTrace(FakeTensorMode):
    """A FakeTensorMode that keeps the books of the memory its tensors would take."""

    SNAPSHOT_STEP = 1.002  # a new snapshot of the live set once the peak grows by 0.2%

    def __init__(self, keep_all: bool = False):
        super().__init__(allow_non_fake_inputs=True)  # the loader's host tensors, the meshes
        self.all: list[Allocation] | None = [] if keep_all else None  # every allocation
        self.live: dict[int, Allocation] = {}
        self.bytes = 0
        self.peaks: dict[str, int] = {}  # per phase group: "step" and "optimizer"
        self.snapshots: dict[str, list[Allocation]] = {}
        self.largest: Allocation | None = None
        self.depth = self.paused = 0
        self.traffic = None  # trainer/plan/traffic.py's books of the collectives, if kept

    # --------------------------------------------------------------- bookkeeping

    def dispatch(self, func, types, args=(), kwargs=None):
        # Only an op's own outputs count: what the fake implementation runs inside it (its
        # decompositions, DTensor's sharding propagation) is not what the GPU kernel allocates.
        if self.traffic is not None and func.namespace in COMM_NAMESPACES:
            self.traffic.record(func, args)
        self.depth += 1
        try:
            out = super().dispatch(func, types, args, kwargs)
        finally:
            self.depth -= 1
        if self.depth == 0 and not self.paused:
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self._note(t, func)
        return out

    def _note(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        a = Allocation(
            storage.nbytes(),
            str(func).removeprefix("aten."),
            tuple(t.shape),
            str(t.dtype).removeprefix("torch."),
            heartbeat._state["phase"],
        )
        self.live[key] = a
        if self.all is not None:
            self.all.append(a)
        weakref.finalize(storage, self._free, key)
        self._grow(a.nbytes)
        if self.largest is None or a.nbytes > self.largest.nbytes:
            self.largest = a

    def _free(self, key: int) -> None:
        a = self.live.pop(key, None)
        if a is not None:
            self.bytes -= a.nbytes

    def _grow(self, nbytes: int) -> None:
        self.bytes += nbytes
        group = "optimizer" if heartbeat._state["phase"] == "optimizer" else "step"
        if self.bytes > self.peaks.get(group, 0):
            if self.bytes > self.peaks.get(group, 0) * self.SNAPSHOT_STEP:
                self.snapshots[group] = list(self.live.values())
            self.peaks[group] = self.bytes

    def resized(self, storage, nbytes: int) -> None:
        """FSDP2 frees and re-allocates its unsharded parameters with `storage.resize_`."""
        a = self.live.get(storage._cdata)
        if a is not None and a.nbytes != nbytes:
            delta, a.nbytes = nbytes - a.nbytes, nbytes
            if delta > 0:
                self._grow(delta)
            else:
                self.bytes += delta

    def book_as(self, t: torch.Tensor, category: str) -> None:
        """Book `t`'s storage under `category` whatever phase made it (the chunked loss's
        head-weight gradient, computed in the forward: a gradient, not an activation)."""
        a = self.storage_of(t)
        if a is not None:
            a.category = category

    def storage_of(self, t: torch.Tensor) -> Allocation | None:
        local = t.to_local() if hasattr(t, "to_local") else t
        return self.live.get(local.untyped_storage()._cdata)


@contextlib.contextmanager
def patched(owner, name: str, wrap):
    """`owner.name` replaced by `wrap(original)` for the block (left alone if absent)."""
    original = getattr(owner, name, None)
    if original is None:
        yield
        return
    setattr(owner, name, wrap(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def tracking(trace: MemoryTrace):
    """What the fake mode alone would get wrong: FSDP2 frees and re-allocates its unsharded
    parameters with `storage.resize_` (not an op), and DTensor's sharding propagation makes
    fake tensors of the global shapes to infer an op's output (not an allocation)."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    def resize(original):
        def resize_(storage, size):
            out = original(storage, size)
            trace.resized(storage, size)
            return out

        return resize_

    def paused(original):
        def run(*args, **kwargs):
            trace.paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                trace.paused -= 1

        return run

    with (
        patched(torch.UntypedStorage, "resize_", resize),
        patched(ShardingPropagator, "_propagate_tensor_meta_non_cached", paused),
    ):
        yield


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """A `fake` process group of `world_size` ranks, this process rank `rank`."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the traced dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@dataclass
class TraceResult:
    peak: int  # bytes: the steady-state peak of one rank
    phase: str  # where it is: "forward/backward" or "optimizer step"
    categories: dict[str, int]  # CATEGORIES at the peak
    largest: Allocation | None
    top_ops: list[tuple[str, int]] = field(default_factory=list)  # temporaries by op
    seconds: float = 0.0
    allocations: list[Allocation] = field(default_factory=list)  # every one (shapes, ops)
    flops: float = 0.0  # the traced microbatches' matmul and attention FLOPs (plan/work.py)
    ideal_flops: float = 0.0  # this rank's even share of the model's FLOPs of them
    pp: int = 1
    pp_rank: int = 0
    comm_bytes: dict = field(default_factory=dict)  # sent per step by dimension (traffic.py)
    comm_unknown: dict = field(default_factory=dict)  # collectives the books do not know
    muon_ns_flops: float | None = None  # Muon: this rank's Newton-Schulz FLOPs (its owners)
    stands_for: list = field(default_factory=list)  # under pp: the ranks of this one's shape


def summarize(
    trace: MemoryTrace, resident: set[int], grads: set[int], states: set[int], state_bytes: int = 0
) -> TraceResult:
    """The steady-state peak and its categories, from the trace's snapshots; `state_bytes`:
    the optimizer's states, resident from the first step on."""
    candidates = {
        "forward/backward": (trace.peaks.get("step", 0) + state_bytes, "step"),
        "optimizer step": (trace.peaks.get("optimizer", 0), "optimizer"),
    }
    phase = max(candidates, key=lambda k: candidates[k][0])
    peak, group = candidates[phase]
    cats = dict.fromkeys(CATEGORIES, 0)
    ops: dict[str, int] = {}
    for a in trace.snapshots.get(group, []):
        cat = a.category or (
            "parameters"
            if id(a) in resident
            else "gradients"
            if id(a) in grads
            else "optimizer_state"
            if id(a) in states
            else "activations"
            if a.phase == "forward"
            else "temporaries"
        )
        cats[cat] += a.nbytes
        if cat == "temporaries":
            ops[a.op] = ops.get(a.op, 0) + a.nbytes
    if group == "step":
        cats["optimizer_state"] += state_bytes
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
    return TraceResult(peak, phase, cats, trace.largest, top)
