"""DualPipeV's overlap on gloo, with a probe model (tests/test_dualpipe.py), on 4 ranks.

Mesh (pp 2, ep 2): each pp rank holds two of the four stages in a V (torch's
ScheduleDualPipeV), and the two ranks of one pp coordinate are an "ep" pair. Every stage is a
matmul followed by `Exchange`: its forward adds the ep pair's sum of the activations (an
all-reduce), its backward the pair's sum of the gradients plus a bulky all-reduce standing in
for an MoE combine's all-to-all; both go out on `lane_group(ep)`, as the MoE dispatch does.
The same schedule step runs twice, without and with trainer/parallel/dualpipe.py's overlap,
and the probe records, per thread, when each backward collective started and ended and when
each forward matmul ran. Prints one `result {json}` line per rank: the losses and gradients'
bitwise equality, the seconds a backward collective was in flight while a forward matmul ran
on the other thread, and which group each lane's collectives used.

`Handshake` pins the two threads' order inside an overlapped action, so that the measure does
not depend on the OS scheduler (on a loaded 2-core machine a thread can be descheduled for a
whole action): the backward lane's first collective starts once the forward lane's matmul has
started, and the matmul is recorded as ended once that collective has started. Only threads
that really run at once can complete it: a pair run one after the other waits out the timeout
once, the handshake is dropped, and the overlap measured is what the scheduler gave.
"""

import json
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from trainer.parallel import dualpipe, lanes
from trainer.parallel.pp_layout import rank_stages

DIM, ROWS, MICROBATCHES, PAYLOAD = 256, 64, 6, 1 << 20
EVENTS: list = []  # (what, thread id, start, end)
GROUPS: dict = {}  # lane -> set of "own" / "twin"
TIMEOUT_S = 30.0  # far past any stall of a working pair; a serial one pays it once


class Handshake:
    """Counts the overlapped forwards started and the backward-lane collectives started."""

    def __init__(self):
        self.cond, self.forwards, self.collectives, self.on = threading.Condition(), 0, 0, True

    def _wait(self, ready) -> None:
        with self.cond:
            if self.on and not self.cond.wait_for(ready, TIMEOUT_S):
                self.on = False  # not concurrent: measure without pinning from here on

    def forward_started(self) -> None:
        with self.cond:
            self.forwards += 1
            self.cond.notify_all()

    def forward_may_end(self) -> None:
        n = self.forwards
        self._wait(lambda: self.collectives >= n)

    def collective_may_start(self) -> None:
        n = self.collectives
        self._wait(lambda: self.forwards > n)

    def collective_started(self) -> None:
        with self.cond:
            self.collectives += 1
            self.cond.notify_all()


HANDSHAKE = Handshake()


def _overlapped_forward() -> bool:
    """Whether this thread runs the forward of an overlapped action (its lane set explicitly:
    the forward lane is every thread's default)."""
    return getattr(lanes._LOCAL, "lane", None) == lanes.FORWARD


def _record(what: str, start: float) -> None:
    EVENTS.append((what, threading.get_ident(), start, time.perf_counter()))


def _all_reduce(t: torch.Tensor, group, what: str, pinned: bool = False) -> torch.Tensor:
    used = lanes.lane_group(group)
    GROUPS.setdefault(lanes.current_lane(), set()).add("own" if used is group else "twin")
    start = time.perf_counter()
    if pinned:
        HANDSHAKE.collective_started()
    dist.all_reduce(t, group=used)
    _record(what, start)
    return t


class Exchange(torch.autograd.Function):
    """y = x + sum over the ep pair of x; the backward sums the gradients over the pair too
    (and moves a bulky payload, as a combine's all-to-all would)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x + _all_reduce(x.detach().clone(), group, "forward collective")

    @staticmethod
    def backward(ctx, grad):
        pinned = lanes.current_lane() == lanes.BACKWARD  # in an overlapped action
        if pinned:
            HANDSHAKE.collective_may_start()
        _all_reduce(torch.ones(PAYLOAD), ctx.group, "backward collective", pinned)
        return grad + _all_reduce(grad.clone(), ctx.group, "backward collective"), None


class ProbeStage(nn.Module):
    def __init__(self, group):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)
        self.group = group

    def forward(self, x):
        start, overlapped = time.perf_counter(), _overlapped_forward()
        if overlapped:
            HANDSHAKE.forward_started()
        h = x @ self.weight
        for _ in range(6):  # compute worth hiding a collective behind
            h = torch.tanh(h @ self.weight)
        if overlapped:
            HANDSHAKE.forward_may_end()
        _record("forward matmul", start)
        return Exchange.apply(h, self.group)


def run(overlap: bool, pp_group, ep_group, pp_rank: int, ep_rank: int) -> dict:
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    torch.manual_seed(0)
    modules = [ProbeStage(ep_group) for _ in range(4)]
    mine = rank_stages(pp_rank, 2, 4, "v")
    act = torch.empty(ROWS, DIM, requires_grad=True)
    stages = [
        PipelineStage(
            modules[s],
            s,
            4,
            torch.device("cpu"),
            group=pp_group,
            input_args=(act,),
            output_args=(act,),
        )
        for s in mine
    ]
    schedule = ScheduleDualPipeV(
        stages, MICROBATCHES, loss_fn=lambda out, y: (out - y).square().mean(), scale_grads=False
    )
    if overlap:
        dualpipe.install(schedule, [ep_group])
    g = torch.Generator().manual_seed(100 + ep_rank)  # each ep rank its own data
    x = torch.randn(ROWS * MICROBATCHES, DIM, generator=g)
    y = torch.randn(ROWS * MICROBATCHES, DIM, generator=g)
    losses: list = []
    EVENTS.clear()
    GROUPS.clear()
    start = time.perf_counter()
    schedule.step(*((x,) if 0 in mine else ()), target=y, losses=losses)
    seconds = time.perf_counter() - start
    return {
        "grads": {s: modules[s].weight.grad.clone() for s in mine},
        "losses": [loss.detach().clone() for loss in losses],
        "in_flight_s": in_flight_while_computing(),
        "seconds": seconds,
        "groups": {k: sorted(v) for k, v in GROUPS.items()},
    }


def in_flight_while_computing() -> float:
    """Seconds during which a backward collective was in flight on one thread while a forward
    matmul ran on another."""
    comm = [(t, a, b) for what, t, a, b in EVENTS if what == "backward collective"]
    compute = [(t, a, b) for what, t, a, b in EVENTS if what == "forward matmul"]
    return sum(
        max(0.0, min(b1, b2) - max(a1, a2))
        for t1, a1, b1 in comm
        for t2, a2, b2 in compute
        if t1 != t2
    )


def main(argv=None) -> None:
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "ep"))
    pp_group, ep_group = mesh["pp"].get_group(), mesh["ep"].get_group()
    pp_rank, ep_rank = mesh["pp"].get_local_rank(), mesh["ep"].get_local_rank()
    seq = run(False, pp_group, ep_group, pp_rank, ep_rank)
    over = run(True, pp_group, ep_group, pp_rank, ep_rank)
    equal = (
        all(torch.equal(seq["grads"][s], over["grads"][s]) for s in seq["grads"])
        and len(seq["losses"]) == len(over["losses"])
        and all(torch.equal(a, b) for a, b in zip(seq["losses"], over["losses"], strict=True))
    )
    line = "result " + json.dumps(
        {
            "rank": dist.get_rank(),
            "pp_rank": pp_rank,
            "equal": equal,
            "n_losses": len(over["losses"]),
            "grad_norm": float(sum(g.square().sum() for g in over["grads"].values()) ** 0.5),
            "in_flight_s": {"sequential": seq["in_flight_s"], "overlap": over["in_flight_s"]},
            "seconds": {"sequential": seq["seconds"], "overlap": over["seconds"]},
            "groups": {"sequential": seq["groups"], "overlap": over["groups"]},
        }
    )
    sys.stdout.write(line + "\n")  # one write: the 4 ranks share the pipe
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
