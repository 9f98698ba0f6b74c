"""Under torchrun (2 ranks): trainer.optim.optimizer's Adam/AdamW, which step each DTensor's
local shard, against torch.optim's, which step through DTensor's dispatch, on the same
parameters and gradients: FSDP 2 (Shard(0)) and TP 2 (colwise Shard(0), rowwise Shard(1), a
replicated norm weight), fused and foreach, 4 steps with the lr changing (fused: the third
skipped on the device, found_inf). Every parameter and moment equal to the bit; the moments
are DTensors laid out as their parameters (what the checkpoint saves); and after the first
step (which makes the moments) no op of the local step sees a DTensor, where torch's step
does. Prints "adam probe ok <case>" per case."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trainer.optim import optimizer as ours


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(16, 32, bias=False)
        self.down = torch.nn.Linear(32, 16, bias=False)
        self.norm = torch.nn.RMSNorm(16)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def layout(name: str, mesh) -> torch.nn.Module:
    torch.manual_seed(0)
    net = Net()
    torch.nn.init.normal_(net.norm.weight)
    if name == "fsdp":
        fully_shard(net.up, mesh=mesh)
        fully_shard(net, mesh=mesh)
    else:
        parallelize_module(
            net, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)}
        )
        net.norm.weight = torch.nn.Parameter(
            DTensor.from_local(net.norm.weight.detach(), mesh, [Replicate()])
        )
    return net


class DTensorOps(TorchDispatchMode):
    """Counts the ops dispatched with a DTensor among their arguments (a mode sees them before
    DTensor's own dispatch does)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs))):
            self.count += 1
        return func(*args, **(kwargs or {}))


def run(net, cls, impl: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    opt = cls(
        net.parameters(),
        lr=1e-2,
        weight_decay=0.1,
        foreach=impl == "foreach",
        fused=impl == "fused",
    )
    grew = 0
    for step in range(4):
        torch.manual_seed(100 + step)
        x = torch.randn(4, 16)
        net.zero_grad()
        net(x).square().sum().backward()
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (step + 1)
        if impl == "fused":  # step 2 skipped on the device
            opt.found_inf = torch.tensor(1.0 if step == 2 else 0.0)
        with DTensorOps() as seen:
            opt.step()
        grew += seen.count if step else 0  # the first step makes the moments: DTensors
    return net, opt, grew


def main(argv):
    mesh = init_device_mesh("cpu", (2,))
    for name in ("fsdp", "tp"):
        for impl in ("fused", "foreach"):
            for torch_cls, our_cls in (
                (torch.optim.AdamW, ours.AdamW),
                (torch.optim.Adam, ours.Adam),
            ):
                ref_net, ref_opt, ref_grew = run(layout(name, mesh), torch_cls, impl)
                net, opt, grew = run(layout(name, mesh), our_cls, impl)
                case = f"{name} {impl} {our_cls.__name__}"
                assert ref_grew > 0 and grew == 0, (case, ref_grew, grew)
                for (n, p), q in zip(net.named_parameters(), ref_net.parameters(), strict=True):
                    assert isinstance(p, DTensor), (case, n)
                    assert torch.equal(p.to_local(), q.to_local()), (case, n)
                    for key in ("exp_avg", "exp_avg_sq"):
                        mine, ref = opt.state[p][key], ref_opt.state[q][key]
                        assert isinstance(mine, DTensor) and mine.placements == p.placements
                        assert torch.equal(mine.to_local(), ref.to_local()), (case, n, key)
                    assert torch.equal(opt.state[p]["step"], ref_opt.state[q]["step"])
                    want = 3.0 if impl == "fused" else 4.0
                    assert float(opt.state[p]["step"]) == want, (case, opt.state[p]["step"])
                if dist.get_rank() == 0:
                    print(f"adam probe ok {case}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
