"""Global order: what every dp rank sees, and exact resumes on another number of ranks.

Ranks are simulated in one process, one loader per dp rank (the loader has no collectives).
HSDP 2x2 is dp size 4 for the loader: the flattened dp mesh of (replicate, shard) ranks."""

from __future__ import annotations

import numpy as np
import pytest

from tests.data_fixtures import *  # noqa: F401,F403
from tests.data_fixtures import DataConfig, batch_hash, build, row_hashes, run_global_batches
from trainer.data.order import permute, window_of_sample
from trainer.errors import DataError

LAYOUTS = {"dp1": 1, "fsdp2": 2, "fsdp4": 4, "hsdp2x2": 4}
G, STEPS = 8, 6


@pytest.fixture(params=["synthetic", "store"])
def cfg(request, store_cfg):
    return (
        DataConfig(dataset="synthetic", vocab_size=1000)
        if request.param == "synthetic"
        else store_cfg
    )


def ranks(cfg, dp_size, local_batch_size=1, **kw):
    return [
        build(cfg, r, dp_size, local_batch_size=local_batch_size, global_batch_size=G, **kw)
        for r in range(dp_size)
    ]


def reference(cfg, steps=STEPS, **kw):
    """One rank taking whole global batches: global batch s = samples [s*G, (s+1)*G)."""
    return run_global_batches(
        [build(cfg, 0, 1, local_batch_size=G, global_batch_size=G, **kw)], steps
    )


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.needs_datasets
def test_union_of_ranks_is_the_global_batches(cfg, layout):
    dp = LAYOUTS[layout]
    want = reference(cfg)
    got = run_global_batches(ranks(cfg, dp, local_batch_size=2 if dp < 4 else 1), STEPS)
    seen = []
    for step, (mine, ref) in enumerate(zip(got, want, strict=True)):
        # each rank's slice is the contiguous [s*G + r*G/dp, s*G + (r+1)*G/dp) in order
        assert row_hashes(mine) == row_hashes(ref), f"step {step}"
        seen += row_hashes(mine)
    assert len(set(seen)) == len(seen) == STEPS * G  # no sample seen twice


@pytest.mark.needs_datasets
def test_rank_slices_and_microbatches(store_cfg):
    loader = build(store_cfg, 1, 2, local_batch_size=2, global_batch_size=8)
    assert loader.accum_steps == 2
    assert loader.sample_indices(0) == [4, 5, 6, 7]
    assert loader.sample_indices(3) == [28, 29, 30, 31]


@pytest.mark.parametrize(
    "before,after", [(("hsdp2x2", 1), ("fsdp2", 2)), (("dp1", 4), ("fsdp8", 1))]
)
@pytest.mark.needs_datasets
def test_resume_on_another_dp_size(cfg, before, after):
    """4 ranks (HSDP 2x2) -> 2 ranks, and 1 rank -> 8 ranks, continue with the next samples;
    the microbatch size may change too."""
    (name_a, bs_a), (name_b, bs_b) = before, after
    dp_a, dp_b = LAYOUTS.get(name_a, 4), LAYOUTS.get(name_b, 8)
    want = [batch_hash(b) for b in reference(cfg, steps=8)]
    first = ranks(cfg, dp_a, bs_a)
    got = [batch_hash(b) for b in run_global_batches(first, 4)]
    states = [loader.state_dict() for loader in first]
    assert all(s == states[0] for s in states)  # the same on every rank: plain values
    assert states[0]["samples_consumed"] == 4 * G
    second = ranks(cfg, dp_b, bs_b)
    for loader in second:
        loader.load_state_dict(states[0])
    got += [batch_hash(b) for b in run_global_batches(second, 4)]
    assert got == want


@pytest.mark.needs_datasets
def test_epochs_wrap_with_a_new_permutation(store_cfg):
    loader = build(store_cfg, seq_len=4095, local_batch_size=1, global_batch_size=1)
    n = loader.n_windows
    assert 10 < n < 1000
    epoch0 = window_of_sample(np.arange(n), n, seed=0)
    epoch1 = window_of_sample(np.arange(n, 2 * n), n, seed=0)
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert list(epoch0) != list(epoch1)
    for _ in range(n + 3):  # crossing the epoch boundary needs no special state
        loader.next_microbatch()
    assert loader.state_dict()["epoch"] == 1


def test_permutation_is_a_pure_function():
    for n in (1, 2, 3, 17, 1000, 4097):
        p = permute(np.arange(n), n, seed=5, epoch=2)
        assert sorted(p.tolist()) == list(range(n))
        assert np.array_equal(permute(np.arange(n)[::-1], n, 5, 2), p[::-1])
    j = np.arange(100)
    assert not np.array_equal(permute(j, 100, seed=1, epoch=0), permute(j, 100, seed=2, epoch=0))
    big = permute(np.array([0, 10**9, 5 * 10**9 - 1]), 5 * 10**9, 0, 0)  # no materialised table
    assert (big < 5 * 10**9).all() and len(set(big.tolist())) == 3


@pytest.mark.needs_datasets
def test_seed_changes_the_order(store_cfg):
    a = run_global_batches([build(store_cfg, seed=0)], 1)[0]
    b = run_global_batches([build(store_cfg, seed=1)], 1)[0]
    assert batch_hash(a) != batch_hash(b)


@pytest.mark.needs_datasets
def test_state_refuses_other_setups(store_cfg):
    loader = build(store_cfg)
    run_global_batches([loader], 1)
    sd = loader.state_dict()
    for kw, key in (({"seq_len": 64}, "seq_len"), ({"seed": 3}, "seed")):
        with pytest.raises(DataError, match=key):
            build(store_cfg, **kw).load_state_dict(sd)
    with pytest.raises(DataError, match="'store' loader"):
        build(DataConfig(dataset="synthetic")).load_state_dict(sd)
    loader.next_microbatch()  # mid-step: taking a state here is a bug of the caller
    with pytest.raises(RuntimeError, match="mid-step"):
        loader.state_dict()


@pytest.mark.needs_datasets
def test_validation_split_is_held_out(store_cfg):
    train = build(store_cfg, seq_len=256, local_batch_size=8)
    val = build(store_cfg, seq_len=256, local_batch_size=8, split="validation")
    assert val.lo == train.hi and val.n_windows >= 1
    t = set(row_hashes(run_global_batches([train], train.n_windows // 8)[0]))
    v = set(row_hashes(run_global_batches([val], 1)[0]))
    assert not t & v


def test_the_suites_stdlib_vocab_is_datas_default():
    """tests/helpers.py's STDLIB_VOCAB (what the tests that train on the stdlib corpus put back
    after TINY's small synthetic vocab) is the default the suite's cached tokenizer is built at."""
    from tests.helpers import STDLIB_VOCAB

    assert STDLIB_VOCAB == ("--data.vocab_size", str(DataConfig().vocab_size))


def test_synthetic_is_learnable_and_deterministic():
    cfg = DataConfig(dataset="synthetic", vocab_size=8192)
    a = run_global_batches([build(cfg, seq_len=64)], 2)
    b = run_global_batches([build(cfg, seq_len=64)], 2)
    assert [batch_hash(x) for x in a] == [batch_hash(x) for x in b]
    loader = build(cfg, seq_len=64)
    assert loader.vocab_size == 8192 and loader.tokenizer_path == ""
    x, _ = loader.next_microbatch()
    assert x.dtype.is_floating_point is False and int(x.max()) < 8192
    assert len(set(x.flatten().tolist())) < 64  # repeated patterns over a small active set
    val = build(cfg, seq_len=64, split="validation")
    assert batch_hash(run_global_batches([val], 1)[0]) != batch_hash(a[0])
