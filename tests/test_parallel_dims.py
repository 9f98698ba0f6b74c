"""ParallelDims: degree resolution and validation (pure), and the real mesh on 4 gloo ranks."""

import json
import re

import pytest

from tests.helpers import REPO, torchrun
from trainer.errors import ConfigError
from trainer.parallel.dims import ParallelDims


@pytest.mark.parametrize(
    "replicate, shard, world, expect",
    [
        (1, -1, 4, 4),
        (2, -1, 4, 2),
        (4, -1, 4, 1),
        (1, -1, 1, 1),
        (2, 2, 4, 2),
        (3, -1, 6, 2),
    ],
)
def test_minus_one_resolves_to_the_rest(replicate, shard, world, expect):
    pd = ParallelDims(replicate, shard, world)
    assert pd.dp_shard == expect and pd.dp_size == world


@pytest.mark.parametrize(
    "replicate, shard, world, needles",
    [
        (
            3,
            -1,
            4,
            [
                "data_parallel_replicate_degree = 3",
                "data_parallel_shard_degree = -1",
                "world size 4",
                "must divide the world size",
            ],
        ),
        (
            1,
            2,
            4,
            [
                "data_parallel_replicate_degree = 1",
                "data_parallel_shard_degree = 2",
                "multiply to 2, but the world size is 4",
            ],
        ),
        (2, 4, 4, ["multiply to 8, but the world size is 4"]),
        (
            1,
            0,
            4,
            [
                "data_parallel_shard_degree = 0 is out of range",
                "world size 4",
                "data_parallel_replicate_degree = 1",
            ],
        ),
        (
            0,
            4,
            4,
            [
                "data_parallel_replicate_degree = 0 is out of range",
                "world size 4",
                "data_parallel_shard_degree = 4",
            ],
        ),
        (1, -2, 4, ["data_parallel_shard_degree = -2 is out of range"]),
    ],
)
def test_invalid_combinations(replicate, shard, world, needles):
    with pytest.raises(ConfigError) as e:
        ParallelDims(replicate, shard, world)
    for needle in needles:
        assert needle in str(e.value)


@pytest.mark.parametrize(
    "replicate, shard, tp, world, needles",
    [
        (
            1,
            -1,
            3,
            4,
            ["tensor_parallel_degree = 3 does not divide world size 4", "valid: 1, 2, 4"],
        ),
        (1, 4, 2, 4, ["multiply to 8, but the world size is 4"]),
        (3, -1, 2, 8, ["do not fit world size 8, 4 dp ranks of tp 2", "valid: a divisor of 4"]),
    ],
)
def test_invalid_tp_combinations(replicate, shard, tp, world, needles):
    with pytest.raises(ConfigError) as e:
        ParallelDims(replicate, shard, world, tp=tp)
    for needle in needles:
        assert needle in str(e.value)


def test_tp_takes_its_share_of_the_world():
    pd = ParallelDims(2, -1, 8, tp=2)
    assert (pd.dp_replicate, pd.dp_shard, pd.tp, pd.dp_size) == (2, 2, 2, 4)


PP_LAYOUTS = [(2, 1, 2, 1, 1), (2, 1, 1, 1, 2), (4, 1, 1, 1, 1)]  # pp, replicate, shard, cp, tp
LAYOUTS = [
    (1, 4, 1, 1),
    (2, 2, 1, 1),
    (4, 1, 1, 1),
    (1, 2, 1, 2),
    (2, 1, 1, 2),
    (1, 1, 1, 4),
    (1, 2, 2, 1),
    (1, 1, 2, 2),
    (2, 1, 2, 1),
    (1, 1, 4, 1),
]  # replicate, shard, cp, tp


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    """The folder of every layout's per-rank JSON: all layouts built in one 4-rank launch."""
    out = tmp_path_factory.mktemp("mesh")
    torchrun(
        REPO / "tests/scripts/mesh_probe.py",
        str(out),
        *("x".join(map(str, layout)) for layout in LAYOUTS + PP_LAYOUTS),
        nproc=4,
        fork=True,
    )
    return out


@pytest.mark.parametrize("replicate, shard, cp, tp", LAYOUTS)
def test_mesh_on_four_ranks(meshes, replicate, shard, cp, tp):
    infos = sorted(
        (
            json.loads(p.read_text())
            for p in (meshes / f"{replicate}x{shard}x{cp}x{tp}").glob("rank*.json")
        ),
        key=lambda i: i["rank"],
    )
    assert len(infos) == 4
    dp, inner = replicate * shard, cp * tp  # inner: the ranks of one dp rank
    for info in infos:
        r = info["rank"]
        assert info["dim_names"] == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
        assert info["shape"] == [1, replicate, shard, cp, tp]
        assert info["pp_group"] == [r]
        # Row-major, tp innermost, then cp: the cp and tp ranks of a dp rank are contiguous
        # ranks and read the same samples.
        assert info["dp_size"] == dp and info["dp_rank"] == r // inner
        assert info["tp_group"] == list(range(r // tp * tp, r // tp * tp + tp))
        first_cp = r // inner * inner + r % tp
        assert info["cp_group"] == list(range(first_cp, first_cp + inner, tp))
        assert info["dp_group"] == list(range(r % inner, 4, inner))
        block = shard * inner  # ranks of one replica
        first = r // block * block + r % inner
        assert info["shard_group"] == list(range(first, first + block, inner))
        assert info["replicate_group"] == list(range(r % block, 4, block))
        # FSDP shards over dp_shard x cp: the ranks of one replica with this rank's tp rank
        first_fsdp = r // block * block + r % tp
        assert info["fsdp_shard_group"] == list(range(first_fsdp, first_fsdp + block, tp))
        assert info["fsdp_mesh_ndim"] == (2 if replicate > 1 else 1)


@pytest.mark.parametrize("pp, replicate, shard, cp, tp", PP_LAYOUTS)
def test_pipeline_stages_are_the_outermost_dimension(meshes, pp, replicate, shard, cp, tp):
    """pp outermost: a stage's ranks are contiguous (rank // (world / pp)), and the dp, tp
    groups live inside one stage; the pp group links the same place in every stage."""
    per_stage = 4 // pp
    for path in (meshes / f"{pp}x{replicate}x{shard}x{cp}x{tp}").glob("rank*.json"):
        info = json.loads(path.read_text())
        r = info["rank"]
        assert info["shape"] == [pp, replicate, shard, cp, tp]
        assert info["pp_group"] == list(range(r % per_stage, 4, per_stage))
        stage = r // per_stage * per_stage
        assert set(info["dp_group"]) | set(info["tp_group"]) <= set(range(stage, stage + per_stage))
        assert info["dp_size"] == replicate * shard and len(info["tp_group"]) == tp


@pytest.mark.parametrize(
    "shard, tp, ep, world, needle",
    [
        (
            -1,
            2,
            3,
            8,
            "parallelism.expert_parallel_degree = 3 is not parallelism.tensor_parallel_degree"
            " = 2 x a divisor of dp_shard = 4 (world size 8, 4 dp ranks of tp 2, ",
        ),
        (
            -1,
            2,
            6,
            8,
            "under tensor parallelism the expert-parallel group takes in the tp ranks "
            "and borrows ep / tp ranks from dp_shard; valid: 1, 2, 4, 8",
        ),
        (-1, 2, 16, 8, "valid: 1, 2, 4, 8"),  # ep / tp = 8 does not divide dp_shard = 4
        (-1, 4, 12, 8, "valid: 1, 4, 8"),
        (-1, 1, 8, 4, "expert_parallel_degree = 8 does not divide dp_shard = 4"),  # tp 1: as before
    ],
)
def test_ep_under_tp_is_tp_times_a_divisor_of_dp_shard(shard, tp, ep, world, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        ParallelDims(1, shard, world, tp=tp, ep=ep)


def test_ep_takes_in_the_tp_ranks():
    """EP 4 x TP 2 on 8 ranks (dp_shard 4): ep = 2 dp_shard ranks x the 2 tp ranks, the experts
    sharded over efsdp = 2; without tp ep stays all dp_shard's; ep 1 leaves tp alone."""
    pd = ParallelDims(1, -1, 8, tp=2, ep=4)
    assert (pd.ep_dp, pd.ep_tp, pd.efsdp, pd.dp_size) == (2, 2, 2, 4)
    assert (
        "EP 4 (experts split over ep = 2 dp_shard x 2 tp ranks, 1/4 each, sharded over "
        "efsdp=2; all-to-all)" in pd.describe()
    )
    assert (ParallelDims(1, -1, 8, ep=4).ep_dp, ParallelDims(1, -1, 8, ep=4).efsdp) == (4, 2)
    assert (ParallelDims(1, -1, 8, tp=2).ep_dp, ParallelDims(1, -1, 8, tp=2).ep_tp) == (1, 1)


def test_the_ep_group_over_dp_shard_and_tp_ranks():
    """The mesh of EP 4 x TP 2 x FSDP 4 (and cp 2 under it) on a fake world, seen from rank 5:
    ep = its dp_shard pair's 4 ranks in increasing order, tp innermost; the experts' FSDP
    over efsdp (x cp); the dense FSDP mesh and dp as without ep."""
    import subprocess
    import sys

    code = (
        "import json, torch.distributed as dist\n"
        "from trainer.parallel.dims import ParallelDims\n"
        "from trainer.plan.fake import fake_world\n"
        "out = {}\n"
        "for cp, world in ((1, 8), (2, 16)):\n"
        "    with fake_world(world, 5):\n"
        "        pd = ParallelDims(1, -1, world, tp=2, cp=cp, ep=4); pd.build_mesh('cpu')\n"
        "        g = lambda m: sorted(dist.get_process_group_ranks(m.get_group()))\n"
        "        out[cp] = dict(ep=pd.ep_mesh.mesh.tolist(), efsdp=g(pd.expert_fsdp_mesh),\n"
        "                       dense=g(pd.fsdp_mesh), dp=g(pd.dp_mesh), tp=g(pd.tp_mesh),\n"
        "                       names=list(pd.world_mesh.mesh_dim_names))\n"
        "print(json.dumps(out))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.splitlines()[-1])
    # world 8: rank = dp_shard index x 2 + tp; dp_shard = (efsdp 2, ep_dp 2)
    assert got["1"] == {
        "ep": [4, 5, 6, 7],
        "efsdp": [1, 5],
        "dense": [1, 3, 5, 7],
        "dp": [1, 3, 5, 7],
        "tp": [4, 5],
        "names": ["pp", "dp_replicate", "efsdp", "ep_dp", "cp", "tp"],
    }
    # world 16, cp 2: rank = (dp_shard index x 2 + cp) x 2 + tp; rank 5 = shard 1, cp 0, tp 1
    assert got["2"]["ep"] == [0, 1, 4, 5] and got["2"]["tp"] == [4, 5]
    assert got["2"]["efsdp"] == [5, 7, 13, 15]  # efsdp 2 x cp 2
    assert got["2"]["dense"] == [1, 3, 5, 7, 9, 11, 13, 15] and got["2"]["dp"] == [1, 5, 9, 13]
