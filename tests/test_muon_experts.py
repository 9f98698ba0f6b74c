"""Muon on stacked expert tensors (trainer/optim/muon.py, muon_layout.py, muon_dist.py): each
expert matrix is orthogonalized on its own, as torch.optim.Muon does a 2-D parameter; the
owners; the batched Newton-Schulz.

One process: a stack of experts and two same-shape dense matrices (one batched Newton-Schulz)
against torch.optim.Muon on each slice alone, bitwise. Under torchrun (4 ranks,
tests/scripts/muon_experts_probe.py): the EP/FSDP layouts (experts cut over efsdp on their
width, whole under ep x efsdp, replicated, a dense matrix cut over both dims) bitwise against
torch.optim.Muon per slice, and a wrong local shard refused with one config line on every
rank. The owner assignment: per expert, balanced, the load carried over buckets.
"""

import torch
from torch.distributed.tensor import Replicate, Shard

from tests.helpers import REPO, torchrun
from trainer.optim.muon import Muon
from trainer.optim.muon_layout import MeshPlan, Spec, ns_flops
from trainer.optim.newton_schulz import orthogonalize

HP = dict(lr=0.05, weight_decay=0.1, momentum=0.95, nesterov=True)


def test_expert_slices_equal_torch_muon_on_one_rank():
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "layers.1.feed_forward.experts.w1": (6, 24, 16),
        "layers.0.attention.wq.weight": (16, 16),
        "layers.0.attention.wk.weight": (16, 16),
    }
    full = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    params = [torch.nn.Parameter(t.clone()) for t in full.values()]
    opt = Muon(
        params,
        None,
        ns_steps=5,
        lr_adjust="match_rms_adamw",
        ns_dtype="bfloat16",
        names=list(full),
        **HP,
    )
    slices = [
        [torch.nn.Parameter(m.clone()) for m in (t if t.ndim == 3 else [t])] for t in full.values()
    ]
    ref = torch.optim.Muon([p for s in slices for p in s], adjust_lr_fn="match_rms_adamw", **HP)
    for _ in range(3):
        for p, s in zip(params, slices, strict=True):
            p.grad = torch.randn(p.shape, generator=gen)
            for k, q in enumerate(s):
                q.grad = p.grad[k] if p.ndim == 3 else p.grad
        opt.step()
        ref.step()
    for name, p, s in zip(full, params, slices, strict=True):
        assert torch.equal(p.detach(), torch.stack([q.detach() for q in s]).view(p.shape)), name


def test_batched_newton_schulz_is_torchs_per_matrix_in_bf16():
    g = torch.randn(5, 40, 24, generator=torch.Generator().manual_seed(1))
    per = torch.stack([orthogonalize(m, 5, torch.bfloat16) for m in g])
    assert torch.equal(orthogonalize(g, 5, torch.bfloat16), per)
    per32 = torch.stack([orthogonalize(m, 5, torch.float32) for m in g])
    assert (orthogonalize(g, 5, torch.float32) - per32).abs().max() < 1e-5


def test_expert_slices_on_ep_fsdp_layouts_and_a_refused_layout():
    proc = torchrun(REPO / "tests/scripts/muon_experts_probe.py", nproc=4, fork=True)
    assert "muon experts probe ok" in proc.stdout, proc.stdout + proc.stderr


def test_owners_per_expert_balanced_and_carried_over_buckets():
    """DeepSeek-V3's layout at ep 8 x efsdp 8 with 4 experts per ep rank (FSDP's Shard(1)):
    every expert of a stack gathered over its 8 efsdp ranks only, and over 4 buckets of one
    such stack every rank carries the same load (a per-bucket greedy from zero would put each
    bucket's 4 experts on the first 4 ranks of each efsdp group)."""
    sizes = (8, 8)  # (efsdp, ep)
    spec = Spec((32, 2048, 7168), (Shard(1), Shard(0)), sizes)
    plan = MeshPlan(sizes, 5)
    views = [plan.assign([spec], me=9) for _ in range(4)]
    group = views[0][0].group
    assert group == tuple(range(1, 64, 8))  # rank 9 = (efsdp 1, ep 1): the ep-1 column
    assert list(views[0][0].units) == [4, 5, 6, 7]
    assert all(o in group for v in views for a in v for o in a.owner.values())
    unit = ns_flops((2048, 7168), 5)
    assert plan.load == [2 * unit] * 64  # 4 buckets x 4 experts over 8 ranks
    dense = MeshPlan((2, 4), 5)  # HSDP replicas x dp_shard: each replica's group computes
    dense.assign([Spec((64, 64), (Replicate(), Shard(0)), (2, 4))] * 8)
    assert dense.load == [2 * ns_flops((64, 64), 5)] * 8
