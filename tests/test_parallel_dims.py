"""ParallelDims: degree resolution and validation (pure), and the real mesh on 4 gloo ranks."""

import json

import pytest

from tests.helpers import REPO, torchrun
from trainer.errors import ConfigError
from trainer.parallel_dims import ParallelDims


@pytest.mark.parametrize("replicate, shard, world, expect", [
    (1, -1, 4, 4), (2, -1, 4, 2), (4, -1, 4, 1), (1, -1, 1, 1), (2, 2, 4, 2), (3, -1, 6, 2),
])
def test_minus_one_resolves_to_the_rest(replicate, shard, world, expect):
    pd = ParallelDims(replicate, shard, world)
    assert pd.dp_shard == expect and pd.dp_size == world


@pytest.mark.parametrize("replicate, shard, world, needles", [
    (3, -1, 4, ["data_parallel_replicate_degree = 3", "data_parallel_shard_degree = -1",
                "world size 4", "must divide the world size"]),
    (1, 2, 4, ["data_parallel_replicate_degree = 1", "data_parallel_shard_degree = 2",
               "multiply to 2, but the world size is 4"]),
    (2, 4, 4, ["multiply to 8, but the world size is 4"]),
    (1, 0, 4, ["data_parallel_shard_degree = 0 is out of range", "world size 4",
               "data_parallel_replicate_degree = 1"]),
    (0, 4, 4, ["data_parallel_replicate_degree = 0 is out of range", "world size 4",
               "data_parallel_shard_degree = 4"]),
    (1, -2, 4, ["data_parallel_shard_degree = -2 is out of range"]),
])
def test_invalid_combinations(replicate, shard, world, needles):
    with pytest.raises(ConfigError) as e:
        ParallelDims(replicate, shard, world)
    for needle in needles:
        assert needle in str(e.value)


LAYOUTS = [(1, 4), (2, 2), (4, 1)]


@pytest.fixture(scope="module")
def meshes(tmp_path_factory):
    """The folder of every layout's per-rank JSON: all layouts built in one 4-rank launch."""
    out = tmp_path_factory.mktemp("mesh")
    torchrun(REPO / "tests/scripts/mesh_probe.py", str(out), *(f"{r}x{s}" for r, s in LAYOUTS),
             nproc=4, fork=True)
    return out


@pytest.mark.parametrize("replicate, shard", LAYOUTS)
def test_mesh_on_four_ranks(meshes, replicate, shard):
    infos = sorted((json.loads(p.read_text())
                    for p in (meshes / f"{replicate}x{shard}").glob("rank*.json")),
                   key=lambda i: i["rank"])
    assert len(infos) == 4
    for info in infos:
        r = info["rank"]
        assert info["dim_names"] == ["dp_replicate", "dp_shard"]
        assert info["shape"] == [replicate, shard]
        assert info["dp_size"] == 4 and info["dp_rank"] == r
        # Row-major layout: shard groups are contiguous ranks, replicate groups are strided.
        assert info["shard_group"] == list(range(r // shard * shard, r // shard * shard + shard))
        assert info["replicate_group"] == list(range(r % shard, 4, shard))
        assert info["fsdp_mesh_ndim"] == (2 if replicate > 1 else 1)
