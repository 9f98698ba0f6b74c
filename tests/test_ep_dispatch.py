"""MoE dispatch under expert parallelism (trainer/parallel/ep_dispatch.py): the node-limited
two-stage dispatch and the flat one against one rank on two torchrun "nodes", the AC recompute
that reuses the dispatched rows, the shared experts computed while the dispatch is in flight,
the refusals, and the traced inter-node bytes."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import uuid

import pytest

from tests.helpers import REPO, fork_python, subprocess_env

PROBE = REPO / "tests" / "scripts" / "ep_dispatch_probe.py"


@pytest.fixture(scope="module")
def probed(tmp_path_factory):
    """One launch: 4 ranks as 2 nodes of 2 (two torchrun launchers, --nnodes 2, meeting
    through a c10d rendezvous on 127.0.0.1: each sets its ranks' LOCAL_WORLD_SIZE = 2); the
    ranks forked from their launcher (tests/scripts/forkrun.py: torchrun's agent, without
    each rank importing torch anew)."""
    tmp = tmp_path_factory.mktemp("ep_dispatch")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    python, env = fork_python({"OMP_NUM_THREADS": "1"})  # forkrun's imports: the zygote's
    cmd = [
        python,
        str(REPO / "tests" / "scripts" / "forkrun.py"),
        "--nnodes",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        uuid.uuid4().hex[:8],
        "2",
        str(PROBE),
        str(tmp),
    ]
    procs = [
        subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    return {r: json.loads((tmp / f"rank{r}.json").read_text()) for r in range(4)}


def test_node_and_flat_dispatch_equal_one_rank(probed):
    """Output, the input's gradient and every parameter's (router, shared and routed experts)
    within 1e-4 of the same layer on one rank holding every token and expert."""
    for r, info in probed.items():
        assert info["auto"] == "NodeDispatch"  # 2 nodes, n_group 2: auto is node-limited
        for name in ("flat", "node"):
            diffs = info["diffs"][name]
            assert {
                "output",
                "input",
                "moe.router.gate.weight",
                "moe.experts.w1",
                "moe.experts.w2",
                "moe.experts.w3",
                "moe.shared_experts.w1.weight",
            } <= set(diffs)
            assert max(diffs.values()) <= 1e-4, (r, name, diffs)


def test_a_token_crosses_to_each_node_once_then_fans_out_inside_it(probed):
    """Node dispatch: the forward's rows go to the same local index on the other node (stage
    1), then only within the node (stage 2), then back the same ways; the flat one sends to
    every rank."""
    for r, info in probed.items():
        peer, mate = (r + 2) % 4, r ^ 1
        rows = [c for c in info["calls"]["node"] if c["dtype"] != "torch.int64"]
        assert [c["phase"] for c in rows] == ["forward"] * 5 + ["backward"] * 4
        for c, to in zip(rows, [peer, peer, mate, mate, peer, peer, mate, mate, peer], strict=True):
            assert set(c["to"]) <= {to}, (r, rows)
        assert any(c["to"] for c in rows)
        flat = [c for c in info["calls"]["flat"] if c["dtype"] != "torch.int64"]
        assert {tuple(c["to"]) for c in flat} == {tuple(sorted({0, 1, 2, 3} - {r}))}


def test_the_recompute_reuses_the_dispatch_and_its_split_sizes(probed):
    """Full AC (the trainer's checkpointed forward): bitwise the same output and gradients; the
    backward sends the gradients only (flat) or also the intra-node stage again (node, saving
    only the inter-node stage's rows); no count exchange (and no host sync) in the recompute."""
    for r, info in probed.items():
        calls = info["calls"]
        for name in ("flat", "node"):
            assert info["diffs"][name + "_ac_vs_no_ac"] <= 1e-6, (r, name)
            back = [c for c in calls[name] if c["phase"] == "backward"]
            back_ac = [c for c in calls[name + "_ac"] if c["phase"] == "backward"]
            assert all(c["dtype"] != "torch.int64" for c in back_ac)
            assert [c for c in calls[name + "_ac"] if c["phase"] == "forward"] == [
                c for c in calls[name] if c["phase"] == "forward"
            ]
            extra = len(back_ac) - len(back)
            assert extra == (0 if name == "flat" else 1), (r, name, back_ac)
        from collections import Counter

        ac, no_ac = (
            Counter(tuple(c["to"]) for c in calls[k] if c["phase"] == "backward")
            for k in ("node_ac", "node")
        )
        assert list((ac - no_ac).elements()) == [(r ^ 1,)]  # the recompute's: within the node


def test_the_shared_experts_run_while_the_dispatch_is_in_flight(probed):
    """2048 x 512 rows per rank: on every rank the dispatch's all-to-all is read only after
    the shared expert ends, and has not completed when the shared expert starts: in one of
    the forwards at least, each run with another rank issuing the dispatch 0.5 s late (the
    late rank may see its transfer finish at once; a dispatch waited for before the side would
    be done in every forward)."""
    for r, info in probed.items():
        for name, tries in info["timeline"].items():
            for events in tries:
                names = [e[0] for e in events]
                assert names == ["dispatch issued", "side start", "side end", "dispatch received"]
            assert len(tries) == len(probed)  # one forward per late rank
            assert any(events[1][2] for events in tries), (r, name, tries)  # in flight


CHECK = """
import os, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from trainer.errors import ConfigError
from trainer.models.args import MoEArgs
from trainer.parallel.expert_parallel import choose_dispatcher
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
ranks = [int(r) for r in sys.argv[1].split(",")]
group = dist.new_group(ranks)
moe = MoEArgs(n_experts=12, top_k=2, n_group=int(sys.argv[2]), topk_group=1,
              dispatch=sys.argv[3])
try:
    print(type(choose_dispatcher(group, moe)).__name__)
except ConfigError as e:
    print(e.one_line())
"""


@pytest.mark.parametrize(
    "ranks,n_group,dispatch,want",
    [
        ("0,1,2,3", 2, "auto", "NodeDispatch"),
        ("0,1,2,3", 4, "auto", "AllToAllDispatch"),
        ("0,1", 1, "auto", "AllToAllDispatch"),
        ("0,1,2,3", 2, "flat", "AllToAllDispatch"),
        (
            "0,1,2,3",
            4,
            "node",
            "config error: moe.dispatch = 'node': moe.n_group = 4, but the ep "
            "group's 4 ranks span 2 node(s) of 2 rank(s): node-limited dispatch needs one expert "
            "group per node",
        ),
        (
            "0,1,2,3,4,5",
            2,
            "node",
            "config error: moe.dispatch = 'node': expert group 1 (ep ranks "
            "3..5, global [3, 4, 5]) spans several nodes: the ep group's ranks are not node-major",
        ),
    ],
)
def test_the_dispatch_is_chosen_from_the_ep_groups_nodes(ranks, n_group, dispatch, want):
    """Nodes of 2 ranks (LOCAL_WORLD_SIZE; 4 for the 6-rank group), 12 experts:
    node-limited where the expert groups are nodes,
    refused in one line where asked and they are not."""
    per_node = "4" if ranks == "0,1,2,3,4,5" else "2"
    out = subprocess.run(
        [sys.executable, "-c", CHECK, ranks, str(n_group), dispatch],
        env=subprocess_env({"LOCAL_WORLD_SIZE": per_node}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip().splitlines()[-1] == want, out.stderr[-2000:]


def test_the_trace_books_inter_node_bytes_and_no_replayed_dispatch(monkeypatch):
    """debugmodel-dsv3 (8 experts in 2 groups, a token to 1 group, top 2) at EP 4 x FSDP 8 on
    nodes of 2 (the ep group: 2 nodes): the node-limited dispatch sends half the flat one's ep bytes
    to the other node, and full AC sends what no AC sends across nodes."""
    from trainer.config.job import load_config
    from trainer.plan.trace import trace_step

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    base = [
        "--job.config_file",
        str(REPO / "configs" / "debug_dsv3.toml"),
        "--parallelism.expert_parallel_degree",
        "4",
        "--training.seq_len",
        "64",
        "--training.local_batch_size",
        "2",
        "--training.global_batch_size",
        "16",
    ]
    got = {}
    for name, extra in (
        ("flat", ["--moe.dispatch", "flat", "--activation_checkpoint.mode", "none"]),
        ("node", ["--activation_checkpoint.mode", "none"]),
        ("node_full_ac", ["--activation_checkpoint.mode", "full"]),
    ):
        got[name] = trace_step(load_config([*base, *extra]), 8).comm_bytes
    flat, node, full = (got[k]["ep@internode"] for k in ("flat", "node", "node_full_ac"))
    assert 0.45 * flat <= node <= 0.55 * flat, got
    assert full == pytest.approx(node, rel=1e-6), got


@pytest.mark.parametrize("cp, nodes, node", [(1, 8, True), (2, 16, False)])
def test_the_plan_books_the_dispatch_the_layout_runs_under_cp(monkeypatch, cp, nodes, node):
    """DeepSeek-V3 671B's ep group of 64 on 128 nodes of 8: node-major over 8 nodes, its 8
    expert groups one per node, so `auto` runs node-limited and the plan books the received
    rows it keeps for the recompute. Context parallelism sits between ep_dp and tp in the mesh:
    at cp 2 the group's ranks stride over 16 nodes, `auto` runs flat (node_span says why, and
    so does the startup line), and the plan books no kept rows either."""
    from trainer.config.job import load_config
    from trainer.models.flavors import model_args
    from trainer.parallel.ep_dispatch import node_fallback, node_span
    from trainer.plan.moe import saved_dispatch_bytes

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    cfg = load_config(
        [
            *("--job.config_file", str(REPO / "configs" / "deepseek_v3_671b.toml")),
            *("--parallelism.context_parallel_degree", str(cp)),
            *("--training.global_batch_size", "2048"),
        ]
    )
    pd, _ = cfg.resolve(1024)
    ranks = pd.ep_group_ranks()
    assert len(ranks) == 64 and ranks[1] - ranks[0] == cp
    args = model_args(cfg.model.flavor)
    spanned, why = node_span(ranks, 8, args.moe.n_group)
    assert spanned == nodes and (why == "") == node, why
    assert bool(node_fallback("auto", spanned, why)) == (not node)
    kept = saved_dispatch_bytes(cfg, args, pd, 2, 4096)
    assert (kept > 0) == node, kept


def test_the_experts_keep_no_view_of_the_received_rows_for_backward():
    """run_experts multiplies the experts' outputs by the rows' weights (the received rows'
    last column): what autograd saves for that product is an [m, 1] tensor of its own, not a
    view that keeps the whole received [m, dim + 1] copy alive until the backward."""
    import types

    import torch

    from trainer.parallel.ep_dispatch import Dispatcher

    m, dim = 64, 32
    mine = torch.randn(m, dim + 1, requires_grad=True)
    per_source = torch.tensor([[10, 22], [20, 12]])
    w = torch.randn(dim, dim, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = Dispatcher.run_experts(
            types.SimpleNamespace(local=2), mine, per_source, lambda rows, n: rows @ w
        )
    out.sum().backward()
    whole = m * (dim + 1) * 4
    assert saved and max(saved) < whole, (saved, whole)
    assert mine.grad is not None and mine.grad[:, -1].abs().sum() > 0
