"""DualPipeV's overlap: one microbatch's forward runs while another's backward communicates.

torch's ScheduleDualPipeV (torch.distributed.pipelining) pairs, in its steady state, the forward
of one of a rank's two stages with the backward of the other as one OVERLAP_F_B action. Unless
a function is registered for that action, torch runs the two one after the other, and the
schedule DeepSeek built to hide the MoE all-to-alls behind compute hides nothing. `overlap_f_b`
is that function: the backward runs on a second thread, on the backward lane
(trainer/parallel/lanes.py: its collectives go out on twin process groups), while the calling
thread runs the forward on the forward lane. torch ops and the collectives' waits release the
GIL, so while one thread waits for an all-to-all the other computes.

Why it is safe:
- the pair never depends on itself: the forward and the backward are of different stages and
  microbatches (the schedule's invariant), and neither is a stage's first forward (FSDP's lazy
  init) nor its last backward (the gradient reduction): checked for pp 2-4 and 4-12
  microbatches, and the reduction is a separate REDUCE_GRAD action on torch >= 2.13;
- the point-to-point receives are waited on, and the FSDP unshards checked, on the calling
  thread before the threads start: the pp group stays one thread's;
- each stage is its own FSDP root, so the two threads touch different FSDP states; autograd
  runs a backward on the thread that calls it (CPU) and keeps the two graphs apart;
- the activation-checkpoint memo (trainer/parallel/recompute.py) is a context variable: each
  thread has its own.
Layouts whose stages issue collectives that have no lane (TP's DTensor collectives, CP's K/V
gathers, the MoE aux losses summed over them) run the pair one after the other, and the
startup line says so (`plan_overlap`). So does CUDA for now: both threads would launch on one
stream in an order of their own on each rank, and NCCL collectives of the two lanes could wait
on each other across ranks (torchtitan orders the threads' launches with barrier hooks); the
overlap runs on gloo, where each collective's wait is the thread's own.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.profiler import record_function

from trainer.parallel import lanes


def supported(schedule) -> bool:
    """Whether this torch lets a function run the schedule's OVERLAP_F_B actions."""
    from torch.distributed.pipelining import schedules

    return (
        hasattr(schedule, "register_custom_function")
        and hasattr(schedules, "_ComputationType")
        and hasattr(schedules._ComputationType, "OVERLAP_F_B")
    )


def plan_overlap(cfg, schedule, device_type: str = "cpu") -> tuple[bool, str]:
    """(overlap or not, the startup line), the same on every rank: decided from the config,
    the device type and this torch, never from the rank's stages. The MoE dispatch
    (trainer/parallel/ep_dispatch.py) sends every collective through `lanes.lane_group`."""
    par = cfg.parallelism
    if device_type == "cuda":
        # One stream, two threads: each rank's kernel launches interleave in its own order, so
        # a rank's stream can wait on one lane's collective while its peer's waits on the
        # other's: a cycle (torchtitan orders the two threads' launches with barrier hooks;
        # none here yet). Correct, serial, and said.
        return False, (
            "pipeline: DualPipeV's overlapped actions run forward then backward on "
            "CUDA (the two threads' kernel launches are not yet ordered across "
            "ranks; overlap runs on gloo)"
        )
    if not supported(schedule):
        return False, (
            f"pipeline: DualPipeV's overlapped actions run forward then backward "
            f"(torch {torch.__version__} cannot register an OVERLAP_F_B function)"
        )
    if not getattr(par, "pipeline_parallel_overlap", True):
        return False, (
            "pipeline: DualPipeV's overlapped actions run forward then backward "
            "(parallelism.pipeline_parallel_overlap = false)"
        )
    unlaned = [
        f"{name} {degree}"
        for name, degree in (
            ("tp", par.tensor_parallel_degree),
            ("cp", par.context_parallel_degree),
        )
        if degree > 1
    ]
    if unlaned:
        return False, (
            "pipeline: DualPipeV's overlapped actions run forward then backward: "
            f"the stages' collectives under {', '.join(unlaned)} have no "
            "backward lane"
        )
    what = (
        "the ep all-to-alls of one microbatch's backward (on twin groups) behind another's forward"
        if par.expert_parallel_degree > 1
        else "one microbatch's backward beside another's forward"
    )
    return True, f"pipeline: DualPipeV overlaps {what} (two threads per rank)"


def stage_groups(model) -> list:
    """The process groups the stages' MoE dispatchers hold (this rank's; none without MoE)."""
    from trainer.models.common.moe import moe_layers

    found: list = []
    for layer in moe_layers(model).values():
        for value in vars(getattr(layer, "dispatcher", None) or object()).values():
            if isinstance(value, dist.ProcessGroup) and value not in found:
                found.append(value)
    return found


def install(schedule, groups) -> None:
    """Give `groups` their backward-lane twins (collective: every rank calls it) and register
    `overlap_f_b` for the schedule's OVERLAP_F_B actions."""
    from torch.distributed.pipelining.schedules import _ComputationType

    lanes.make_twins(groups)
    schedule.register_custom_function(_ComputationType.OVERLAP_F_B, overlap_f_b)


def overlap_f_b(action, ctx) -> None:
    """Run an OVERLAP_F_B action: its backward on a second thread (backward lane), its forward
    here (forward lane); both done when this returns."""
    from torch.distributed.pipelining.schedules import _wait_batch_p2p

    schedule = ctx.schedule_ref
    stages = {stage.stage_index: stage for stage in schedule._stages}
    fwd, bwd = action.sub_actions
    f_stage, b_stage = stages[fwd.stage_index], stages[bwd.stage_index]
    # The pp group's receives: waited on here, one thread (a stage fed by its rank's other
    # stage, the V's turn, receives nothing).
    if not f_stage.is_first and fwd.stage_index - 1 not in stages:
        _wait_batch_p2p(schedule.fwd_recv_ops.pop((fwd.stage_index, fwd.microbatch_index)))
    if not b_stage.is_last and bwd.stage_index + 1 not in stages:
        _wait_batch_p2p(schedule.bwd_recv_ops.pop((bwd.stage_index, bwd.microbatch_index)))
    schedule._assert_unsharded(f_stage)
    schedule._assert_unsharded(b_stage)
    failed: list[BaseException] = []
    device = b_stage.device
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def backward_lane():
        try:
            if stream is not None:  # a new thread starts on device 0 and its default stream
                torch.cuda.set_device(device)
                torch.cuda.set_stream(stream)
            with lanes.lane(lanes.BACKWARD), record_function(f"dualpipe B{bwd}"):
                _backward(schedule, stages, bwd)
        except BaseException as e:  # re-raised on the calling thread
            failed.append(e)

    thread = threading.Thread(target=backward_lane, name=f"dualpipe-backward-{bwd}", daemon=True)
    thread.start()
    try:
        with lanes.lane(lanes.FORWARD), record_function(f"dualpipe F{fwd}"):
            _forward(schedule, stages, fwd, ctx)
    finally:
        thread.join()
    if failed:
        raise failed[0]


def _forward(schedule, stages: dict, action, ctx) -> None:
    """A FORWARD action's compute, as torch's runtime runs it (its receive already waited).
    The last stage's output is not kept for merging: PipelineLoop steps with
    return_outputs=False (the loss is the output)."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    output = stage.forward_one_chunk(
        mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False
    )
    schedule._maybe_compute_loss(stage, output, ctx.target_mbs, mb)
    if action.stage_index + 1 in stages:  # the V's turn: the next stage is this rank's
        stages[action.stage_index + 1].set_local_fwd_input(output, mb)


def _backward(schedule, stages: dict, action) -> None:
    """A FULL_BACKWARD action's compute, as torch's runtime runs it."""
    stage, mb = stages[action.stage_index], action.microbatch_index
    loss = schedule._maybe_get_loss(stage, mb)
    schedule.backward_counter[action.stage_index] += 1
    last = schedule.backward_counter[action.stage_index] == schedule._n_microbatches
    stage.backward_one_chunk(mb, loss=loss, full_backward=True, last_backward=last)
    if action.stage_index - 1 in stages:
        stages[action.stage_index - 1].set_local_bwd_input(stage.get_local_bwd_output(mb), mb)
