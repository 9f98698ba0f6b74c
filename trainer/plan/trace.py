"""The traced dry run: the real training step at the real shapes, on fake tensors, in one CPU
process.

    python -m trainer.plan --config configs/llama3_70b.toml --ngpu 8 --nnodes 8 --trace

`FakeTensorMode` runs every op for its shapes and allocates nothing; the `fake` process-group
backend stands in for a world of any size (this process is rank 0, which holds the largest
FSDP shard; the other ranks' collectives are assumed). The model is sharded exactly as
train.py shards it (`shard_model`: float8, TP, AC, FSDP/HSDP), and one real `TrainStep` runs:
the microbatches' forward and backward through the parallelism's seam, the token count's
all-reduce, clipping over every mesh, the fused AdamW step with its on-device skip. A host
sync in that step cannot happen on fake tensors: it stops the trace, naming the line.

`MemoryTrace` records every storage the fake tensors would allocate, its bytes, the op that
made it and the loop's phase then (trainer/health/heartbeat.py), and frees it when the
storage dies (FSDP2's `resize_` of its unsharded buffers included). The peak is that of a
steady-state step: the optimizer's moments exist from the first step on, so they are added to
the forward/backward peak. What a trace cannot see is stated beside it: the CUDA context and
NCCL buffers, the allocator's fragmentation (the plan's reserve, trainer/plan/memory.py), and
`torch.compile`, which is traced eagerly (compile usually holds less).

Validation and evals are traced the same way (`trace_scoring`): a forward under no_grad
through the chunked, loss-parallel head (trainer/models/loss.py scoring_loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback
import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import (DataDependentOutputException, FakeTensorMode,
                                          unset_fake_temporarily)

from trainer.config.job import JobConfig
from trainer.health import heartbeat

GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


@dataclass
class Allocation:
    nbytes: int
    op: str
    shape: tuple[int, ...]
    dtype: str
    phase: str

    def describe(self) -> str:
        return (f"{self.nbytes / GIB:.3f} GiB {self.dtype} {list(self.shape)} from {self.op} "
                f"({self.phase})")


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

    # --------------------------------------------------------------- bookkeeping

    def dispatch(self, func, types, args=(), kwargs=None):
        # Only an op's own outputs count: what the fake implementation runs inside it (its
        # decompositions, DTensor's sharding propagation) is not what the GPU kernel allocates.
        self.depth += 1
        try:
            out = super().dispatch(func, types, args, kwargs)
        finally:
            self.depth -= 1
        if self.depth == 0 and not self.paused:
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    self._note(t, func)
        return out

    def _note(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        a = Allocation(storage.nbytes(), str(func).removeprefix("aten."), tuple(t.shape),
                       str(t.dtype).removeprefix("torch."), heartbeat._state["phase"])
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

    with patched(torch.UntypedStorage, "resize_", resize), \
            patched(ShardingPropagator, "_propagate_tensor_meta_non_cached", paused):
        yield


@contextlib.contextmanager
def host_counts():
    """The step counts the loader's labels on the host (trainer.data.count_targets): that
    runs outside the fake mode here too."""
    import trainer.step as step_module

    original = step_module.count_targets

    def count(labels):
        with unset_fake_temporarily():
            return original(labels)

    step_module.count_targets = count
    try:
        yield
    finally:
        step_module.count_targets = original


@contextlib.contextmanager
def fake_world(world_size: int):
    """A `fake` process group of `world_size` ranks, this process rank 0."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the traced dry run needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
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


class FakeLoader:
    """The loader's side of a step on the trace: `accum` microbatches of host tensors at the
    real shapes, made before the fake mode is entered (the loader's tensors are real, on the
    host). One document per sequence, or 4 when the model masks documents."""

    def __init__(self, cfg: JobConfig, vocab: int, accum: int):
        b, s = cfg.training.local_batch_size, cfg.training.seq_len
        tokens = [torch.randint(0, vocab, (b, s + 1)) for _ in range(accum)]
        self.batches = [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]

    def next_microbatch(self):
        return self.batches.pop(0)

    def document_ids(self, inputs: torch.Tensor) -> torch.Tensor:
        ids = torch.arange(inputs.shape[1], device=inputs.device) * 4 // inputs.shape[1]
        return ids.expand(inputs.shape).contiguous()


class _Metrics:  # what TrainStep asks of the metrics: nothing to record here
    def data_timer(self):
        return contextlib.nullcontext()

    def count_tokens(self, n: int) -> None:
        pass


def build_traced(cfg: JobConfig, world_size: int, trace: MemoryTrace):
    """(model, optimizer, parallel dims, accum, args) on fake tensors, as train.py builds them."""
    from trainer.models.llama import build_model
    from trainer.optim.optimizer import build_optimizer
    from trainer.parallel.parallelize import materialize, shard_model
    from trainer.plan.memory import plan_args, resolve_vocab

    pd, accum = cfg.resolve(world_size)
    pd.build_mesh("cpu")  # fake tensors carry the shapes; the device's kernels do not matter
    args = plan_args(cfg, resolve_vocab(cfg)[0])
    param = "bfloat16" if cfg.training.mixed_precision_param == "auto" else \
        cfg.training.mixed_precision_param
    device = torch.device("cpu")
    model = shard_model(build_model(args), pd, cfg, device=device, param_dtype=param)
    with trace:
        materialize(model, cfg, device)
        optimizer = build_optimizer(model, cfg.optimizer)
    return model, optimizer, pd, accum, args


def traced_config(cfg: JobConfig) -> JobConfig:
    """The config as traced: compile off (traced eagerly), the GPU's fused AdamW."""
    return dataclasses.replace(
        cfg, compile=dataclasses.replace(cfg.compile, enable=False),
        optimizer=dataclasses.replace(cfg.optimizer, implementation="fused"
                                      if cfg.optimizer.implementation == "auto"
                                      else cfg.optimizer.implementation))


def trace_step(cfg: JobConfig, world_size: int, keep_all: bool = False) -> TraceResult:
    """One real TrainStep of `cfg` on rank 0 of `world_size` fake ranks (`keep_all`: with
    every allocation in `allocations`)."""
    from trainer.models.loss import build_loss
    from trainer.optim.optimizer import build_lr_scheduler
    from trainer.parallel.microbatches import build_forward_backward
    from trainer.step import TrainStep

    t0 = time.monotonic()
    cfg = traced_config(cfg)
    trace = MemoryTrace(keep_all)
    with fake_world(world_size), tracking(trace):
        model, optimizer, pd, accum, args = build_traced(cfg, world_size, trace)
        loader = FakeLoader(cfg, args.vocab_size, accum)
        loss_fn = build_loss(cfg.training.loss, cfg.training.loss_chunk_size,
                             z_loss_weight=cfg.training.z_loss_weight,
                             vocab_parallel_group=pd.loss_parallel_group)
        device = torch.device("cpu")
        step = TrainStep(model, optimizer, build_lr_scheduler(optimizer, cfg.lr_scheduler,
                                                              cfg.training.steps), loader,
                         forward_backward=build_forward_backward(
                             model, loss_fn, cfg, device=device, dp_size=pd.dp_mesh.size(),
                             loader=loader),
                         metrics=_Metrics(), dp_group=pd.dp_mesh.get_group(), device=device,
                         max_norm=cfg.training.max_norm)
        grads: list[Allocation] = []
        optimizer.register_step_pre_hook(lambda *_: grads.extend(
            a for p in model.parameters() if p.grad is not None
            for a in [trace.storage_of(p.grad)] if a is not None))
        resident = {id(a) for p in [*model.parameters(), *model.buffers()]
                    for a in [trace.storage_of(p)] if a is not None}
        with trace, host_counts():
            micro = earlier_microbatches(cfg, model, accum)
            step(1, micro)
        states = [trace.storage_of(t) for s in optimizer.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor)]
        states = [a for a in states if a is not None]
        result = summarize(trace, resident, {id(a) for a in grads}, {id(a) for a in states},
                           sum(a.nbytes for a in {id(a): a for a in states}.values()))
        result.allocations = trace.all or []
    heartbeat.phase("setup")
    result.seconds = time.monotonic() - t0
    return result


def earlier_microbatches(cfg: JobConfig, model, accum: int) -> int:
    """How many microbatches the trace runs for a step of `accum`: with gradient sync every
    microbatch, one, after the earlier microbatches' sharded gradients are put in place (FSDP
    adds to them); with sync on the last one only, two (one that keeps its unsharded gradients,
    one that reduces them): every later microbatch repeats one of those."""
    if accum > 1 and cfg.training.gradient_accumulation_sync != "last":
        heartbeat.phase("backward")
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        return 1
    return min(accum, 2)


def summarize(trace: MemoryTrace, resident: set[int], grads: set[int], states: set[int],
              state_bytes: int = 0) -> TraceResult:
    """The steady-state peak and its categories, from the trace's snapshots; `state_bytes`:
    the optimizer's states, resident from the first step on."""
    candidates = {"forward/backward": (trace.peaks.get("step", 0) + state_bytes, "step"),
                  "optimizer step": (trace.peaks.get("optimizer", 0), "optimizer")}
    phase = max(candidates, key=lambda k: candidates[k][0])
    peak, group = candidates[phase]
    cats = dict.fromkeys(CATEGORIES, 0)
    ops: dict[str, int] = {}
    for a in trace.snapshots.get(group, []):
        cat = ("parameters" if id(a) in resident else "gradients" if id(a) in grads else
               "optimizer_state" if id(a) in states else
               "activations" if a.phase == "forward" else "temporaries")
        cats[cat] += a.nbytes
        if cat == "temporaries":
            ops[a.op] = ops.get(a.op, 0) + a.nbytes
    if group == "step":
        cats["optimizer_state"] += state_bytes
    top = sorted(ops.items(), key=lambda kv: -kv[1])[:3]
    return TraceResult(peak, phase, cats, trace.largest, top)


def trace_scoring(cfg: JobConfig, world_size: int, kind: str) -> TraceResult:
    """A validation (`kind` "validation": validation.local_batch_size sequences of seq_len) or
    eval ("eval": eval.local_batch_size requests as long as seq_len allows) forward of `cfg`,
    as trainer/evals scores them: no_grad, through the chunked, loss-parallel head. The peak
    is of the model alone: in a run the optimizer's states are there too (`with_states`)."""
    from trainer.evals.scoring import Request, score_batch
    from trainer.models.loss import scoring_loss

    t0 = time.monotonic()
    cfg = traced_config(cfg)
    trace = MemoryTrace(keep_all=True)
    with fake_world(world_size), tracking(trace):
        model, _, pd, _, args = build_traced(cfg, world_size, trace)
        loss_fn = scoring_loss(cfg.training.loss_chunk_size, pd.loss_parallel_group)
        resident = {id(a) for p in [*model.parameters(), *model.buffers()]
                    for a in [trace.storage_of(p)] if a is not None}
        b = cfg.validation.local_batch_size if kind == "validation" else cfg.eval.local_batch_size
        loader = FakeLoader(dataclasses.replace(cfg, training=dataclasses.replace(
            cfg.training, local_batch_size=b)), args.vocab_size, 1)
        inputs, labels = loader.next_microbatch()
        requests = [Request(tuple(t), n_cont=8) for t in inputs.tolist()]
        model.eval()
        heartbeat.phase("validation" if kind == "validation" else "eval")
        with trace, torch.no_grad():
            if kind == "validation":
                doc_ids = loader.document_ids(inputs) if model.uses_documents else None
                model(inputs, labels, loss_fn, doc_ids=doc_ids)
            else:
                score_batch(model, requests, torch.device("cpu"), loss_fn)
        result = summarize(trace, resident, set(), set())
        result.allocations = trace.all
    heartbeat.phase("setup")
    result.seconds = time.monotonic() - t0
    return result


def trainer_frame(e: BaseException) -> str:
    """file:line of the innermost trainer frame of an exception's traceback."""
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        if "/trainer/" in frame.filename and "/plan/trace.py" not in frame.filename:
            where = f"trainer/{frame.filename.split('/trainer/')[-1]}:{frame.lineno}"
    return where


def trace_lines(cfg: JobConfig, world_size: int, plan: dict[str, int], mem_gib: float,
                need) -> list[str]:
    """The printed trace beside the analytic plan (`plan`: trainer.plan.memory.memory_plan);
    `need(peak)`: the device bytes a peak takes with the plan's reserve."""
    accum = cfg.resolve(world_size)[1]
    try:
        r = trace_step(cfg, world_size)
    except DataDependentOutputException as e:
        return [f"traced dry run stopped: the step reads a device value on the host (a host "
                f"sync, {e.func}) at {trainer_frame(e)}: a bug to report"]
    sync = cfg.training.gradient_accumulation_sync
    how = ("1 microbatch" if accum == 1 else
           f"1 of {accum} microbatches, after the earlier ones' sharded gradients (sync "
           f"'{sync}')" if sync != "last" else
           f"2 of {accum} microbatches (one keeping its unsharded gradients, one reducing)")
    lines = [f"traced dry run: one training step of rank 0 of {world_size} on fake tensors "
             f"({how}; {r.seconds:.1f} s)",
             f"    {'':<34}{'traced':>12}{'plan':>12}"]
    for key in CATEGORIES:
        theirs = f"{plan[key] / GIB:9.3f} GiB" if key in plan else f"{'-':>13}"
        lines.append(f"    {key.replace('_', ' '):<34}{r.categories[key] / GIB:9.3f} GiB{theirs}")
    diff = plan["total"] / r.peak - 1
    lines += [f"    {'peak (at the ' + r.phase + ')':<34}{r.peak / GIB:9.3f} GiB"
              f"{plan['total'] / GIB:9.3f} GiB  (plan {diff:+.1%})"]
    if r.largest is not None:
        lines.append(f"  largest tensor: {r.largest.describe()}")
    if r.top_ops:
        lines.append("  largest temporaries at the peak, by op: " + ", ".join(
            f"{op.removesuffix('.default')} {n / GIB:.2f} GiB" for op, n in r.top_ops))
    states = r.categories["optimizer_state"]
    for kind, on in (("validation", cfg.validation.enable), ("eval", cfg.eval.enable)):
        if on:
            v = trace_scoring(cfg, world_size, kind)
            lines.append(f"  {kind} forward: {v.peak / GIB:.3f} GiB + the optimizer states "
                         f"{states / GIB:.3f} GiB = {(v.peak + states) / GIB:.3f} GiB "
                         f"(training's peak {r.peak / GIB:.3f} GiB)")
    fits = need(r.peak) <= mem_gib * GIB
    lines += [
        f"  agreement: the plan is {'within' if abs(diff) <= 0.10 else 'NOT within'} 10% of "
        f"the trace ({diff:+.1%})",
        "  not traced: torch.compile (traced eagerly; compiled blocks usually hold less), the "
        "CUDA context, NCCL buffers and fragmentation (the plan's reserve)",
        f"trace verdict: {'FITS' if fits else 'DOES NOT FIT'}: {need(r.peak) / GIB:.2f} GiB "
        f"with the reserve, of {mem_gib:.1f} GiB"]
    return lines
