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

The bookkeeping is trainer/plan/fake.py (`MemoryTrace`: every op's outputs, their bytes, the
op and the loop's phase, freed with their storage). The peak is that of a
steady-state step: the optimizer's moments exist from the first step on, so they are added to
the forward/backward peak. What a trace cannot see is stated beside it: the CUDA context and
NCCL buffers, the allocator's fragmentation (the plan's reserve, trainer/plan/memory.py), and
`torch.compile`, which is traced eagerly (compile usually holds less).

Validation and evals are traced the same way (`trace_scoring`): a forward under no_grad
through the chunked, loss-parallel head (trainer/models/common/loss.py scoring_loss).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import traceback

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, unset_fake_temporarily

from trainer.config.job import JobConfig
from trainer.health import heartbeat
from trainer.models.common.moe import GROUPED_MM
from trainer.plan.fake import (
    CATEGORIES,
    GIB,
    Allocation,
    MemoryTrace,  # noqa: F401
    TraceResult,
    fake_world,
    summarize,
    tracking,
)
from trainer.plan.stages import StageDriver, traced_ranks
from trainer.plan.traffic import Traffic, traffic_lines
from trainer.plan.work import counting, ideal_flops, measure_factors, ranks_text, work_lines


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
def balanced_dispatch():
    """Expert parallelism's all-to-all split sizes are data (trainer/parallel/ep_dispatch.py
    reads them on the host); on the trace they are perfect balance, the steady state load
    balancing aims at: under the flat dispatch every rank sends an equal share of its routed
    rows to each ep rank and receives as many; under the node-limited one each token goes to
    topk_group nodes, an equal share to each, and fans out evenly there. A skewed router's
    receiving rank holds more."""
    from trainer.parallel.ep_dispatch import Dispatcher

    original = Dispatcher.host_lists

    def even(self, sizes, tokens):
        return self.balanced(tokens)

    Dispatcher.host_lists = even
    try:
        yield
    finally:
        Dispatcher.host_lists = original


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
    from trainer.models.build import build_model
    from trainer.optim.optimizer import build_optimizer
    from trainer.parallel.parallelize import materialize, shard_model
    from trainer.plan.memory import plan_args, resolve_vocab

    pd, accum = cfg.resolve(world_size)
    pd.build_mesh("cpu")  # fake tensors carry the shapes; the device's kernels do not matter
    args = plan_args(cfg, resolve_vocab(cfg)[0])
    param = (
        "bfloat16"
        if cfg.training.mixed_precision_param == "auto"
        else cfg.training.mixed_precision_param
    )
    device = torch.device("cpu")
    model = shard_model(build_model(args), pd, cfg, device=device, param_dtype=param)
    with trace:
        materialize(model, cfg, device)
        optimizer = build_optimizer(model, cfg.optimizer)
    return model, optimizer, pd, accum, args


def traced_config(cfg: JobConfig) -> JobConfig:
    """The config as traced: compile off (traced eagerly), the GPU's fused AdamW."""
    return dataclasses.replace(
        cfg,
        compile=dataclasses.replace(cfg.compile, enable=False),
        optimizer=dataclasses.replace(
            cfg.optimizer,
            implementation="fused"
            if cfg.optimizer.implementation == "auto"
            else cfg.optimizer.implementation,
        ),
    )


def trace_step(
    cfg: JobConfig, world_size: int, keep_all: bool = False, pp_rank: int = 0
) -> TraceResult:
    """One real TrainStep of `cfg` on rank 0 of `world_size` fake ranks (`keep_all`: with
    every allocation in `allocations`); under pp, on the first rank of pp rank `pp_rank`,
    its stages driven by trainer/plan/stages.py."""
    from trainer.models.common.loss import build_loss
    from trainer.optim.optimizer import build_lr_scheduler
    from trainer.optim.step_hooks import ExpertBalance
    from trainer.parallel.forward_backward import build_forward_backward
    from trainer.step import TrainStep

    t0 = time.monotonic()
    cfg = traced_config(cfg)
    trace = MemoryTrace(keep_all)
    pp = cfg.parallelism.pipeline_parallel_degree
    with fake_world(world_size, pp_rank * world_size // pp), tracking(trace):
        model, optimizer, pd, accum, args = build_traced(cfg, world_size, trace)
        trace.traffic = Traffic(pd)
        for group in getattr(optimizer, "process_groups", list)():  # Muon's gathers
            trace.traffic.names[group.group_name] = "optimizer"
        loader = FakeLoader(cfg, args.vocab_size, accum)
        loss_fn = build_loss(
            cfg.training.loss,
            cfg.training.loss_chunk_size,
            z_loss_weight=cfg.training.z_loss_weight,
            vocab_parallel_group=pd.loss_parallel_group,
        )
        device = torch.device("cpu")
        step = TrainStep(
            model,
            optimizer,
            build_lr_scheduler(optimizer, cfg.lr_scheduler, cfg.training.steps),
            loader,
            forward_backward=build_forward_backward(
                model, loss_fn, cfg, device=device, parallel_dims=pd, loader=loader
            ),
            metrics=_Metrics(),
            dp_group=pd.dp_mesh.get_group(),
            device=device,
            max_norm=cfg.training.max_norm,
            pp=pd.pp,
            hooks=[  # MoE: the loads' all-reduce, the bias
                ExpertBalance(
                    n_layers=args.n_blocks,
                    device=device,
                    coeff=cfg.moe.load_balance_coeff,
                    moe_ids=args.moe_layer_ids,
                )
            ],
        )
        grads: list[Allocation] = []
        optimizer.register_step_pre_hook(
            lambda *_: grads.extend(
                a
                for p in model.parameters()
                if p.grad is not None
                for a in [trace.storage_of(p.grad)]
                if a is not None
            )
        )
        resident = {
            id(a)
            for p in [*model.parameters(), *model.buffers()]
            for a in [trace.storage_of(p)]
            if a is not None
        }
        driver = None
        if pd.pp_enabled:  # the rank's stages, without the schedule
            driver = StageDriver(step.forward_backward, cfg, pp_rank, trace.traffic)
            step.forward_backward.schedule_step = driver
        with trace, host_counts(), balanced_dispatch(), trace.traffic.segments():
            micro = 1 if driver else earlier_microbatches(cfg, model, accum)
            with counting() as flops:  # this rank's work (trainer/plan/work.py)
                step(1, micro)
        states = [
            trace.storage_of(t)
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor)
        ]
        states = [a for a in states if a is not None]
        result = summarize(
            trace,
            resident,
            {id(a) for a in grads},
            {id(a) for a in states},
            sum(a.nbytes for a in {id(a): a for a in states}.values()),
        )
        result.allocations = trace.all or []
        result.flops = float(flops.get_total_flops())
        result.ideal_flops = ideal_flops(
            cfg, args, world_size, pd.dp_size, driver.ideal_tokens() if driver else None, micro
        )
        result.pp, result.pp_rank = pd.pp, pp_rank
        result.comm_bytes = (
            driver.per_step(accum)
            if driver
            else trace.traffic.per_step(
                accum,
                micro,
                once=("dp_replicate",)
                if cfg.training.gradient_accumulation_sync == "hsdp_reduce_scatter"
                else (),
            )
        )
        result.comm_unknown = trace.traffic.unknown
        result.muon_ns_flops = getattr(optimizer, "ns_flops", lambda: None)()
        trace.traffic = None
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


def trace_scoring(cfg: JobConfig, world_size: int, kind: str) -> TraceResult:
    """A validation (`kind` "validation": validation.local_batch_size sequences of seq_len) or
    eval ("eval": eval.local_batch_size requests as long as seq_len allows) forward of `cfg`,
    as trainer/evals scores them: no_grad, through the chunked, loss-parallel head. The peak
    is of the model alone: in a run the optimizer's states are there too (`with_states`).
    Under context parallelism it scores whole sequences, where a run splits them over cp: an
    upper bound there."""
    from trainer.evals.scoring import Request, score_batch
    from trainer.models.common.loss import scoring_loss

    t0 = time.monotonic()
    cfg = traced_config(cfg)
    trace = MemoryTrace(keep_all=True)
    with fake_world(world_size), tracking(trace):
        model, _, pd, _, args = build_traced(cfg, world_size, trace)
        loss_fn = scoring_loss(cfg.training.loss_chunk_size, pd.loss_parallel_group)
        resident = {
            id(a)
            for p in [*model.parameters(), *model.buffers()]
            for a in [trace.storage_of(p)]
            if a is not None
        }
        b = cfg.validation.local_batch_size if kind == "validation" else cfg.eval.local_batch_size
        loader = FakeLoader(
            dataclasses.replace(
                cfg, training=dataclasses.replace(cfg.training, local_batch_size=b)
            ),
            args.vocab_size,
            1,
        )
        inputs, labels = loader.next_microbatch()
        requests = [Request(tuple(t), n_cont=8) for t in inputs.tolist()] if kind == "eval" else []
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


def untraceable(cfg: JobConfig) -> str | None:
    """Why `cfg`'s step cannot be traced on this CPU, or None."""
    from trainer.plan.memory import plan_args, resolve_vocab

    args = plan_args(cfg, resolve_vocab(cfg)[0])
    if args.moe is not None and not GROUPED_MM:
        return (
            "this torch has no grouped GEMM (torch._grouped_mm): the experts' per-expert "
            "loop splits its rows by the data; the analytic plan above counts them"
        )
    if args.attn_implementation == "flex":
        return (
            "block_causal attention runs FlexAttention on GPUs, which only compiles for "
            "CUDA; the analytic plan above counts its block mask (trace the same shapes "
            "with --model.attn_mask_type causal for the rest)"
        )
    return None


def trace_ranks(cfg: JobConfig, world_size: int) -> list[TraceResult]:
    """Each traced pp rank's step (trainer/plan/stages.py), each in a process of its own
    (forked: a fake world of another rank cannot follow a destroyed one in one process, its
    DeviceMesh groups outlive it), as many at once as there are CPUs."""
    import multiprocessing
    import os

    ranks = traced_ranks(cfg, world_size)
    with multiprocessing.get_context("fork").Pool(
        min(len(ranks), os.cpu_count() or 1), maxtasksperchild=1
    ) as pool:
        results = pool.starmap(
            trace_step, [(cfg, world_size, False, k) for k in ranks], chunksize=1
        )
    for r in results:  # the ranks of its shape it stands for
        r.stands_for = ranks[r.pp_rank]
    return results


def trainer_frame(e: BaseException) -> str:
    """file:line of the innermost trainer frame of an exception's traceback."""
    where = "?"
    for frame in traceback.extract_tb(e.__traceback__):
        if "/trainer/" in frame.filename and "/plan/trace.py" not in frame.filename:
            where = f"trainer/{frame.filename.split('/trainer/')[-1]}:{frame.lineno}"
    return where


def trace_lines(
    cfg: JobConfig,
    world_size: int,
    plan: dict[str, int],
    mem_gib: float,
    need,
    record: dict | None = None,
) -> list[str]:
    """The printed trace beside the analytic plan (`plan`: trainer.plan.memory.memory_plan);
    `need(peak)`: the device bytes a peak takes with the plan's reserve. `record`: a dict to
    fill with the trace's figures (`--json`)."""
    accum = cfg.resolve(world_size)[1]
    if untraceable(cfg):
        return [f"traced dry run: not run: {untraceable(cfg)}"]
    pp = cfg.parallelism.pipeline_parallel_degree
    measure_factors(cfg)  # the blocks' kernel and recompute factors, before any fork
    try:
        results = trace_ranks(cfg, world_size) if pp > 1 else [trace_step(cfg, world_size)]
    except DataDependentOutputException as e:
        return [
            f"traced dry run stopped: the step reads a device value on the host (a host "
            f"sync, {e.func}) at {trainer_frame(e)}: a bug to report"
        ]
    r = max(results, key=lambda x: x.peak)
    if pp > 1:  # the table compares the largest traced rank with the plan of that rank
        from trainer.plan.memory import memory_plan

        plan = {**plan, **memory_plan(cfg, world_size, r.pp_rank)}
    sync = cfg.training.gradient_accumulation_sync
    how = (
        "1 microbatch"
        if accum == 1
        else f"1 of {accum} microbatches, after the earlier ones' sharded gradients (sync '{sync}')"
        if sync != "last"
        else f"2 of {accum} microbatches (one keeping its unsharded gradients, one reducing)"
    )
    who = "rank 0"
    if pp > 1:
        how = "its stages' in-flight microbatches, trainer/plan/stages.py"
        shared = [
            f"{x.pp_rank} for {ranks_text(x.stands_for).removeprefix('ranks ')}"
            for x in results
            if len(x.stands_for) > 1
        ]
        who = (
            f"pp ranks {', '.join(str(x.pp_rank) for x in results)}"
            + (f" (one per shape: {'; '.join(shared)})" if shared else "")
            + f" (the table: pp rank {r.pp_rank}, the largest)"
        )
    lines = [
        f"traced dry run: one training step of {who} of {world_size} on fake tensors "
        f"({how}; {sum(x.seconds for x in results):.1f} s)",
        f"    {'':<34}{'traced':>12}{'plan':>12}",
    ]
    for key in CATEGORIES:
        theirs = f"{plan[key] / GIB:9.3f} GiB" if key in plan else f"{'-':>13}"
        lines.append(f"    {key.replace('_', ' '):<34}{r.categories[key] / GIB:9.3f} GiB{theirs}")
    diff = plan["total"] / r.peak - 1
    lines += [
        f"    {'peak (at the ' + r.phase + ')':<34}{r.peak / GIB:9.3f} GiB"
        f"{plan['total'] / GIB:9.3f} GiB  (plan {diff:+.1%})"
    ]
    if pp > 1:
        lines.append(
            "  peak per traced pp rank (traced / plan): "
            + ", ".join(
                f"rank {x.pp_rank} {x.peak / GIB:.2f} / "
                f"{plan.get('pp_rank_totals', [0] * pp)[x.pp_rank] / GIB:.2f} GiB"
                for x in results
            )
        )
    if r.largest is not None:
        lines.append(f"  largest tensor: {r.largest.describe()}")
    if r.top_ops:
        lines.append(
            "  largest temporaries at the peak, by op: "
            + ", ".join(f"{op.removesuffix('.default')} {n / GIB:.2f} GiB" for op, n in r.top_ops)
        )
    busiest = max(results, key=lambda x: x.flops / max(x.ideal_flops, 1.0))
    work: dict = {}
    lines += work_lines(
        cfg,
        [(x.pp_rank, x.flops, x.ideal_flops, x.stands_for or [x.pp_rank]) for x in results],
        pp,
        work,
    )
    dims = {d for x in results for d in x.comm_bytes}
    sends = {d: max(x.comm_bytes.get(d, 0.0) for x in results) for d in dims}
    lines += traffic_lines(
        sends,
        {k.removeprefix("comm_"): v for k, v in plan.items() if k.startswith("comm_")},
        "the busiest traced pp rank" if pp > 1 else "rank 0",
    )
    if record is not None:
        record.update(
            peak_bytes=r.peak,
            phase=r.phase,
            categories=r.categories,
            comm_bytes=sends,
            largest=r.largest.describe() if r.largest else None,
            flops=busiest.flops,
            ideal_flops=busiest.ideal_flops,
            seconds=round(sum(x.seconds for x in results), 1),
            muon_ns_flops=r.muon_ns_flops,
            work=work,
            pp_ranks=[
                {
                    "pp_rank": x.pp_rank,
                    "peak_gib": x.peak / GIB,
                    "flops": x.flops,
                    "ideal_flops": x.ideal_flops,
                    "stands_for": x.stands_for,
                    "comm_bytes": x.comm_bytes,
                }
                for x in results
            ]
            if pp > 1
            else None,
        )
    states = r.categories["optimizer_state"]
    for kind, on in (("validation", cfg.validation.enable), ("eval", cfg.eval.enable)):
        if on and pp > 1:
            lines.append(
                f"  {kind} forward: not traced under pp (the stages' forward passes "
                "its activations point to point)"
            )
        elif on:
            v = trace_scoring(cfg, world_size, kind)
            lines.append(
                f"  {kind} forward: {v.peak / GIB:.3f} GiB + the optimizer states "
                f"{states / GIB:.3f} GiB = {(v.peak + states) / GIB:.3f} GiB "
                f"(training's peak {r.peak / GIB:.3f} GiB)"
            )
    fits = need(r.peak) <= mem_gib * GIB
    lines += [
        f"  agreement: the plan is {'within' if abs(diff) <= 0.10 else 'NOT within'} 10% of "
        f"the trace ({diff:+.1%})",
        "  not traced: torch.compile (traced eagerly; compiled blocks usually hold less), the "
        "CUDA context, NCCL buffers and fragmentation (the plan's reserve)",
        f"trace verdict: {'FITS' if fits else 'DOES NOT FIT'}: {need(r.peak) / GIB:.2f} GiB "
        f"with the reserve, of {mem_gib:.1f} GiB",
    ]
    return lines
