"""Blends of token stores, in one process: the assignment of samples to sources, the global
order on every dp layout, resumes, stage changes, and the one-line errors.

Ranks are simulated in one process, one loader per dp rank (the loader has no collectives)."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter

import numpy as np
import pytest
import torch

from tests.data_fixtures import *  # noqa: F401,F403
from tests.data_fixtures import build, mix_cfg, row_hashes, run_global_batches
from tests.helpers import REPO, fork_python
from trainer.config.job import load_config
from trainer.data.blend import Blend, _floor_sum
from trainer.data.mix_loader import MixLoader
from trainer.data.order import permute, permute_many
from trainer.errors import ConfigError, DataError

G = 8  # samples per global batch


# -- the assignment ---------------------------------------------------------------------------
def test_floor_sum_is_exact():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n, m = int(rng.integers(0, 300)), int(rng.integers(1, 10**6))
        a, b = int(rng.integers(0, 3 * m)), int(rng.integers(0, 3 * m))
        assert _floor_sum(n, m, a, b) == sum((a * j + b) // m for j in range(n))


@pytest.mark.parametrize(
    "weights,seed",
    [
        ({"web": 0.75, "code": 0.25}, 0),
        ({"a": 5, "b": 3, "c": 2, "z": 0}, 7),
        ({"x": 0.001, "y": 0.999}, 3),
    ],
)
def test_counts_are_closed_forms_of_a_low_discrepancy_assignment(weights, seed):
    blend = Blend(weights, seed)
    which = blend.index_of(np.arange(20_000))
    total = sum(weights.values())
    worst = 0.0
    for n in (*range(1, 400), *range(400, 20_000, 97)):
        counts = np.bincount(which[:n], minlength=len(blend.names))
        for s, name in enumerate(blend.names):
            if n % 7 == 0 or n < 50:  # the closed form equals counting (sampled: it is slow)
                assert blend.count(name, n) == counts[s], (name, n)
            worst = max(worst, abs(counts[s] - weights[name] / total * n))
    # independent draws would be off by ~sqrt(n w (1-w)) ~ 60 samples at n = 20000
    assert worst <= 3.0, worst
    assert blend.count("z", 20_000) == 0 if "z" in weights else True


def test_assignment_ignores_table_order_and_depends_on_the_seed():
    a = Blend({"web": 3, "code": 1}, 0).index_of(np.arange(64))
    b = Blend({"code": 1, "web": 3}, 0).index_of(np.arange(64))
    c = Blend({"web": 3, "code": 1}, 1).index_of(np.arange(64))
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_first_sample_reaching_inverts_count():
    blend = Blend({"a": 0.2, "b": 0.8}, 5)
    for k in (1, 2, 17, 400):
        i = blend.first_sample_reaching("a", k, 0, 0)
        assert blend.count("a", i + 1) == k and blend.count("a", i) == k - 1


# -- the global order -----------------------------------------------------------------------
def mix_ranks(cfg, dp, local_batch_size=1):
    return [
        build(cfg, r, dp, seq_len=64, local_batch_size=local_batch_size, global_batch_size=G)
        for r in range(dp)
    ]


def take_ids(loaders, steps):
    """Per step, the source/epoch/window ids of the whole global batch (rank order)."""
    out = []
    for _ in range(steps):
        ids = []
        for loader in loaders:
            ids += loader.sample_ids(loader.sample_indices(0))
            for _ in range(loader.accum_steps):
                loader.next_microbatch()
        out.append(ids)
    return out


@pytest.fixture
def blend_cfg(mix_stores):
    return mix_cfg(mix_stores, {"email": 0.75, "json": 0.25}, val_fraction=0.05)


@pytest.mark.parametrize("dp,local", [(1, 8), (2, 2), (4, 1)])
def test_every_layout_sees_the_same_global_batches(blend_cfg, dp, local):
    want = run_global_batches(mix_ranks(blend_cfg, 1, local_batch_size=G), 5)
    got = run_global_batches(mix_ranks(blend_cfg, dp, local_batch_size=local), 5)
    assert [row_hashes(b) for b in got] == [row_hashes(b) for b in want]


def test_realised_token_fractions_follow_the_weights_and_the_small_source_wraps(blend_cfg):
    loader = mix_ranks(blend_cfg, 1, local_batch_size=G)[0]
    ids = [i for step in take_ids([loader], 200) for i in step]
    by_source = Counter(i.split("/")[0] for i in ids)
    assert abs(by_source["email"] / len(ids) - 0.75) < 0.01
    assert abs(by_source["json"] / len(ids) - 0.25) < 0.01
    assert len(ids) == len(set(ids))  # no window twice within an epoch of its source
    events = loader.pop_events()
    n_json = loader.sources["json"].n_windows
    assert by_source["json"] > n_json, "the fixture's small source should wrap"
    assert events[0] == (
        f"source 'json' starts epoch 1 (all {n_json:,} of its windows seen 1 "
        "time; a new permutation)"
    )
    m = loader.metrics()
    assert m["data_metrics/tokens/json"] == by_source["json"] * 64
    assert m["data_metrics/epoch/json"] == (by_source["json"] - 1) // n_json
    epoch0 = [i for i in ids if i.startswith("json/0/")]
    assert sorted(int(i.split("/")[2]) for i in epoch0) == list(range(n_json))  # a permutation


def test_resume_on_other_dp_sizes_continues_the_order(blend_cfg):
    want = take_ids(mix_ranks(blend_cfg, 1, local_batch_size=G), 8)
    first = mix_ranks(blend_cfg, 4)  # HSDP 2x2 is dp 4 for the loader
    assert take_ids(first, 3) == want[:3]
    state = first[0].state_dict()
    assert all(r.state_dict() == state for r in first)  # one state for every rank
    second = mix_ranks(blend_cfg, 2, local_batch_size=2)
    for r in second:
        r.load_state_dict(state)
    assert take_ids(second, 5) == want[3:]
    assert second[0].pop_events() == []  # same weights: the same stage, no line


def test_stage_changes_continue_every_source_and_never_repeat_a_window(mix_stores):
    stage0 = mix_cfg(mix_stores, {"email": 0.75, "json": 0.25}, val_fraction=0.05)
    stage1 = mix_cfg(
        mix_stores,
        {"email": 0.75, "json": 0.25},
        val_fraction=0.05,
        mix_weights=["email=0.25", "json=0.75"],
    )  # the command-line override
    stage2 = mix_cfg(mix_stores, {"email": 0.25, "json": 0.75, "http": 0.5}, val_fraction=0.05)
    loader = mix_ranks(stage0, 2, local_batch_size=2)
    ids = take_ids(loader, 40)
    for cfg, steps, line in (
        (
            stage1,
            60,
            "stage 1 starts at sample 320: email 75.0% -> 25.0%, "
            "json 25.0% -> 75.0%; every source continues where it stopped",
        ),
        (
            stage2,
            60,
            "stage 2 starts at sample 800: email 25.0% -> 16.7%, "
            "http new 33.3%, json 75.0% -> 50.0%; every source continues "
            "where it stopped",
        ),
    ):
        state = loader[0].state_dict()
        before = {n: json.loads(state["mix"])["sources"][n]["samples"] for n in ("email", "json")}
        loader = mix_ranks(cfg, 4)
        for r in loader:
            r.load_state_dict(state)
        assert loader[0].pop_events() == [line]
        assert {n: loader[0].consumed_by_source()[n] for n in before} == before  # counters go on
        ids += take_ids(loader, steps)
    flat = [i for step in ids for i in step]
    assert len(flat) == len(set(flat)) == 160 * G  # every sample: no window twice in its epoch
    assert {i.split("/")[1] for i in flat if i.startswith("json/")} >= {"0", "1", "2"}
    saved = json.loads(loader[0].state_dict()["mix"])
    assert [s["start"] for s in saved["stages"]] == [0, 320, 800]
    # a source dropped from the config keeps its count in the checkpoint
    only_email = mix_cfg(mix_stores, {"email": 1.0}, val_fraction=0.05)
    again = mix_ranks(only_email, 1, local_batch_size=G)[0]
    again.load_state_dict(loader[0].state_dict())
    assert json.loads(again.state_dict()["mix"])["sources"]["json"] == saved["sources"]["json"]
    assert "json 50.0% -> removed" in again.pop_events()[0]


def test_a_zero_weight_source_gets_no_samples(mix_stores):
    cfg = mix_cfg(mix_stores, {"email": 1, "json": 0}, val_fraction=0.05)
    ids = take_ids(mix_ranks(cfg, 1, local_batch_size=G), 10)
    assert {i.split("/")[0] for step in ids for i in step} == {"email"}


# -- errors, one line each -------------------------------------------------------------------
@pytest.mark.parametrize(
    "override,message",
    [
        (
            "--data.mix_weights=web=1,nope=2",
            "data.mix_weights names an unknown source 'nope'; the "
            "sources in data.mix are: web, code",
        ),
        (
            "--data.mix_weights=code=-0.5",
            "data.mix source 'code' has weight -0.5; a weight must be "
            "a finite number >= 0 (0 drops the source)",
        ),
        (
            "--data.mix_weights=web=0,code=0",
            "data.mix: every weight is 0 (web, code); give at least one source a positive weight",
        ),
        ("--data.mix_weights=web", "data.mix_weights entry 'web' is not name=weight"),
        ("--data.store_path=/x", "data.store_path is set together with data.mix"),
    ],
)
def test_config_errors(tmp_path, override, message):
    toml = tmp_path / "blend.toml"
    toml.write_text(
        '[[data.mix]]\nname = "web"\nstore_path = "/s/web"\nweight = 3\n\n'
        '[[data.mix]]\nname = "code"\nstore_path = "/s/code"\n'
    )
    with pytest.raises(ConfigError) as e:
        load_config(["--job.config_file", str(toml), override])
    assert str(e.value).startswith(message)


def test_table_errors_name_the_key(tmp_path):
    toml = tmp_path / "blend.toml"
    toml.write_text('[[data.mix]]\nname = "web"\nstore = "/s/web"\n')
    with pytest.raises(
        ConfigError,
        match=r"unknown key data.mix\[0\].store \(did you mean "
        r"'store_path'\?\)",
    ):
        load_config(["--job.config_file", str(toml)])
    with pytest.raises(ConfigError, match="data.mix has two sources named 'a'"):
        load_config(["--data.mix", '[{name="a", store_path="/x"}, {name="a", store_path="/y"}]'])
    with pytest.raises(ConfigError, match=r"data.mix\[0\].name = 'a b' is not valid"):
        load_config(["--data.mix", '[{name="a b", store_path="/x"}]'])
    with pytest.raises(ConfigError, match=r"data.mix\[0\].weight must be a float"):
        load_config(["--data.mix", '[{name="a", store_path="/x", weight="big"}]'])


def test_effective_config_records_the_weights_in_force(tmp_path):
    cfg = load_config(
        [
            "--data.mix",
            '[{name="web", store_path="/s/w", weight=3}, {name="code", store_path="/s/c"}]',
            "--data.mix_weights",
            "web=0.6",
        ]
    )
    cfg.save(str(tmp_path / "config.toml"))
    again = load_config(["--job.config_file", str(tmp_path / "config.toml")])
    assert again.data.mix_weights == []
    assert [(s.name, s.weight) for s in again.data.mix] == [("web", 0.6), ("code", 1.0)]


def test_store_and_tokenizer_errors(mix_stores, tmp_path):
    missing = mix_cfg({**mix_stores, "json": str(tmp_path / "nope")}, {"email": 1, "json": 1})
    with pytest.raises(DataError, match=r"^data.mix source 'json': token store not found: "):
        build(missing, seq_len=64)
    damaged = tmp_path / "json"
    shutil.copytree(mix_stores["json"], damaged)
    shard = sorted(damaged.glob("shard_*.bin"))[0]
    shard.write_bytes(shard.read_bytes()[:-2])
    with pytest.raises(DataError, match=r"^data.mix source 'json': truncated shard "):
        build(mix_cfg({**mix_stores, "json": str(damaged)}, {"email": 1, "json": 1}), seq_len=64)
    other = tmp_path / "other"  # the same tokens, recorded as made by another tokenizer
    shutil.copytree(mix_stores["json"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "f" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(
        DataError,
        match=r"^data.mix sources 'email' and 'json' were prepared "
        r"with different tokenizers \(.*email/tokenizer.model",
    ):
        build(mix_cfg({**mix_stores, "json": str(other)}, {"email": 1, "json": 1}), seq_len=64)


@pytest.mark.needs_datasets
def test_resume_refusals(mix_stores, blend_cfg, store_cfg):
    state = mix_ranks(blend_cfg, 1, local_batch_size=G)[0].state_dict()
    swapped = mix_cfg(
        {**mix_stores, "json": mix_stores["http"]}, {"email": 0.75, "json": 0.25}, val_fraction=0.05
    )
    with pytest.raises(DataError, match="data.mix source 'json' reads .* which is not the store"):
        mix_ranks(swapped, 1, local_batch_size=G)[0].load_state_dict(state)
    unshuffled = mix_cfg(
        mix_stores, {"email": 0.75, "json": 0.25}, val_fraction=0.05, shuffle=False
    )
    with pytest.raises(
        DataError,
        match="the checkpoint walked its windows with shuffle=True, this run with shuffle=False",
    ):
        mix_ranks(unshuffled, 1, local_batch_size=G)[0].load_state_dict(state)
    resplit = mix_cfg(mix_stores, {"email": 0.75, "json": 0.25}, val_fraction=0.1)
    with pytest.raises(DataError, match="data.mix source 'email': its train split has"):
        mix_ranks(resplit, 1, local_batch_size=G)[0].load_state_dict(state)
    single = build(store_cfg, seq_len=16).state_dict()
    with pytest.raises(DataError, match="is for a 'store' loader but data.mix is a blend"):
        mix_ranks(blend_cfg, 1, local_batch_size=G)[0].load_state_dict(single)
    with pytest.raises(DataError, match="is for a 'mix' loader"):
        build(store_cfg, seq_len=64).load_state_dict(state)
    assert isinstance(mix_ranks(blend_cfg, 1)[0], MixLoader)


def test_a_source_too_small_for_its_validation_split(blend_cfg):
    import torch

    from trainer.evals.validate import Validator

    cfg = load_config(["--training.seq_len", "64", "--validation.steps", "100"])
    cfg.data = blend_cfg
    train = mix_ranks(blend_cfg, 1, local_batch_size=G)[0]
    with pytest.raises(
        DataError,
        match=r"^data.mix source 'email': the validation split holds "
        r"\d+ windows of 65 tokens, fewer than the 800 samples",
    ):
        Validator(
            cfg,
            train_loader=train,
            dp_rank=0,
            dp_size=1,
            dp_group=None,
            device=torch.device("cpu"),
            loss_fn=None,
        )


# -- the commands ------------------------------------------------------------------------------
def run_module(*args):
    python, env = fork_python()
    return subprocess.run(
        [python, "-m", *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=120
    )


def test_mix_command_prints_what_the_loader_delivers(mix_stores, blend_cfg, tmp_path):
    toml = tmp_path / "blend.toml"
    toml.write_text(
        "".join(
            f'[[data.mix]]\nname = "{n}"\nstore_path = "{mix_stores[n]}"\nweight = {w}\n'
            for n, w in (("email", 0.75), ("json", 0.25))
        )
        + "[training]\nseq_len = 64\nlocal_batch_size = 2\n"
    )
    proc = run_module(
        "trainer.data.mix",
        "--config",
        str(toml),
        "--steps",
        "200",
        "--world-size",
        "4",
        "--data.val_fraction",
        "0.05",
    )
    assert proc.returncode == 0, proc.stderr
    ids = [i for step in take_ids(mix_ranks(blend_cfg, 1, local_batch_size=G), 200) for i in step]
    rows = {line.split()[0]: line.split() for line in proc.stdout.splitlines()[2:]}
    for name in ("email", "json"):
        samples = sum(i.startswith(name + "/") for i in ids)
        assert rows[name][4] == f"{samples:,}" and rows[name][5] == f"{samples * 64:,}"
    wrap = next(
        s
        for s, step in enumerate(take_ids(mix_ranks(blend_cfg, 1, local_batch_size=G), 200))
        if any("json/1/" in i for i in step)
    )
    assert rows["json"][8].rstrip(",") == str(wrap + 1)
    bad = run_module("trainer.data.mix", "--config", str(toml), "--data.mix_weights", "x=1")
    assert bad.returncode == 2 and bad.stderr.startswith("config error: data.mix_weights names")


def test_prepare_every_source_of_a_blend_in_one_command(tmp_path):
    toml = tmp_path / "blend.toml"
    toml.write_text(
        f'[data]\ndataset = "stdlib"\ncache_dir = "{tmp_path / "cache"}"\n\n'
        f'[[data.mix]]\nname = "json"\nstore_path = "{tmp_path / "json"}"\n'
        'data_files = ["json/**"]\n\n'
        f'[[data.mix]]\nname = "tomllib"\nstore_path = "{tmp_path / "toml"}"\n'
        'data_files = ["tomllib/**"]\n'
    )
    proc = run_module("trainer.data.prepare", "--config", str(toml), "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert "== source 1/2 'json': stdlib json/** ->" in proc.stdout
    assert "prepared 2 sources: json, tomllib" in proc.stdout
    for name in ("json", "toml"):
        manifest = json.loads((tmp_path / name / "manifest.json").read_text())
        assert manifest["source"]["patterns"] and manifest["total_tokens"] > 1000
    stamp = (tmp_path / "json" / "manifest.json").stat().st_mtime_ns
    again = run_module("trainer.data.prepare", "--config", str(toml), "--workers", "1")
    assert again.returncode == 0 and "prepared 2 sources" in again.stdout
    assert (tmp_path / "json" / "manifest.json").stat().st_mtime_ns == stamp  # reused as is
    nothing = run_module(
        "trainer.data.prepare",
        "--dataset",
        "stdlib",
        "--data_files",
        "nope/**",
        "--store_path",
        str(tmp_path / "x"),
        "--cache_dir",
        str(tmp_path / "cache"),
    )
    assert nothing.returncode == 2 and nothing.stderr.startswith(
        "data error: data.data_files pattern 'nope/**' matches no module"
    )


@pytest.mark.needs_datasets
def test_planning_ahead_changes_no_window(blend_cfg, store_cfg):
    """Locating ~256 samples of a rank at once (the fast path) reads the same windows as
    locating each microbatch alone, for a blend and a single store, across steps."""
    for cfg in (blend_cfg, store_cfg):
        planned, direct = (build(cfg, 1, 2, seq_len=64, local_batch_size=2) for _ in range(2))
        direct.PLAN_AHEAD = 0
        for _ in range(150):
            a, b = planned.next_microbatch(), direct.next_microbatch()
            assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_permute_many_equals_permute_per_element():
    rng = np.random.default_rng(0)
    n_of, seed_of = [7, 1000, 1 << 20, 3], [5, 2**63 + 11, 0, 9]
    group, epoch = rng.integers(0, 4, 3000), rng.integers(0, 3, 3000)
    pos = np.array([rng.integers(0, n_of[g]) for g in group])
    want = [
        permute(np.array([p]), n_of[g], seed_of[g], int(e))[0]
        for p, g, e in zip(pos, group, epoch, strict=True)
    ]
    assert permute_many(pos, group, epoch, n_of, seed_of).tolist() == want


def test_a_batch_ramp_takes_the_next_samples_of_the_global_order(blend_cfg):
    """Global batches of 2, 4, 6, 8 on 2 ranks read samples [0, 2), [2, 6), ... of the order
    that a constant batch reads."""
    ranks = mix_ranks(blend_cfg, 2)
    got = []
    for gbs in (2, 4, 6, 8, 8):
        for r in ranks:
            r.set_global_batch_size(gbs)
        got += [i for step in take_ids(ranks, 1) for i in step]
    want = [i for step in take_ids(mix_ranks(blend_cfg, 1, local_batch_size=G), 4) for i in step]
    assert got == want[:28]
    assert ranks[0].consumed_by_source() == {
        n: sum(i.startswith(n + "/") for i in got) for n in ("email", "json")
    }
