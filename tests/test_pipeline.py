"""Pipeline parallelism (trainer/parallel/pipeline.py, pp_layout.py) on CPU ranks: gloo, fp32,
the debug model's 6 layers and heads at dim 64 (debugmodel-narrow), seq 64.

Through run_train.sh, 5 steps with a z-loss and validation at step 5: on 4 ranks, PP 2 x FSDP 2
(1F1B), PP 2 x TP 2, PP 2 x FSDP 2 with Interleaved1F1B (2 stages per rank), PP 4 with
ZBVZeroBubble (8 stages, one unit each: the embedding and the head alone) and PP 2 (GPipe) x 2
replicas with gradient accumulation give the 1-rank losses, gradient norms, z-losses and
validation losses within 1e-4. The PP 2 x FSDP 2 checkpoint of step 3 resumes at FSDP 4, at
PP 4 and on 1 rank: the loaded weights are bitwise the saved ones and steps 4-5 continue the
run. A spike rolled back under PP ends bitwise where the run told to skip the same batch ends.
The stage split, the schedules' bubbles and every bad setting (one line) are checked in-process.
"""

import re
import subprocess

import pytest

from tests.helpers import (
    REPO,
    SYNTHETIC,
    fork_python,
    losses,
    run_train,
    scalars,
    stopped_after_save,
)
from tests.test_tp import saved_digest
from trainer.checkpoint.safe_load import load_tensors
from trainer.config.job import load_config
from trainer.errors import ConfigError
from trainer.parallel.dims import ParallelDims
from trainer.parallel.pipeline import _SAME_RANK_STAGES, _SPLIT_BACKWARD_THROUGH_FUNCTIONS
from trainer.parallel.pp_layout import (
    SCHEDULES,
    bubble_fraction,
    rank_stages,
    split_stages,
    stage_rank,
    stage_work,
)

# torch 2.11 (the GPU machines) cannot run V schedules over gloo (trainer/parallel/pipeline.py
# check_torch): there the 8-stage PP 4 runs interleaved instead; torch 2.12 runs ZBV, but its
# weight pass cannot walk the chunked loss's Function: the eager loss there (the same losses)
V = (
    ("ZBVZeroBubble", *(() if _SPLIT_BACKWARD_THROUGH_FUNCTIONS else ("--training.loss", "eager")))
    if _SAME_RANK_STAGES
    else ("Interleaved1F1B",)
)

PP, SCHED = "--parallelism.pipeline_parallel_degree", "--parallelism.pipeline_parallel_schedule"
# the debug model's 6 layers and heads at dim 64 (debugmodel-narrow): the layouts, not the width
COMMON = (
    "--training.device",
    "cpu",
    "--model.flavor",
    "debugmodel-narrow",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.min_lr_factor",
    "1.0",
    *SYNTHETIC,
    "--training.steps",
    "5",
    "--training.z_loss_weight",
    "1e-3",
    "--validation.enable",
    "true",
    "--validation.freq",
    "5",
    "--validation.steps",
    "1",
    "--validation.local_batch_size",
    "2",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
    "--checkpoint.last_save_in_hf",
    "true",
)
LAYOUTS = {  # name: (ranks, overrides)
    "ref": (1, ()),
    "pp2_fsdp2": (4, (PP, "2")),
    "pp2_tp2": (4, (PP, "2", "--parallelism.tensor_parallel_degree", "2")),
    "pp2_interleaved_fsdp2": (4, (PP, "2", SCHED, "Interleaved1F1B")),
    "pp4_zbv": (4, (PP, "4", SCHED, *V)),
    "pp2_gpipe_replicas": (
        4,
        (PP, "2", SCHED, "GPipe", "--parallelism.data_parallel_replicate_degree", "2"),
    ),
}
TAGS = ("loss_metrics/global_avg_loss", "grad_norm", "loss_metrics/z_loss")


def close(a: dict, b: dict, tol=1e-4) -> bool:
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= tol * max(1.0, abs(b[s])) for s in b)


# What each run saves: step 3 where a resume or the step-3 comparison reads it, the last step
# (and its HF export) where the export is compared, nothing where only the logs are.
SAVES = {
    "ref": (),
    "pp2_fsdp2": (),
    "pp2_tp2": ("--checkpoint.interval", "5"),
    "pp4_zbv": ("--checkpoint.interval", "5"),
    "pp2_interleaved_fsdp2": ("--checkpoint.enable", "false"),
    "pp2_gpipe_replicas": ("--checkpoint.enable", "false"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("pp")
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        proc = run_train(root / name, *COMMON, *overrides, *SAVES[name], nproc=nproc)
        out[name] = (root / name, proc.stdout)
    return out


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "ref"])
def test_pipeline_layouts_train_as_one_rank(runs, name):
    dump, stdout = runs[name]
    ref = runs["ref"][0]
    for tag in TAGS:
        want, have = scalars(ref, tag), scalars(dump, tag)
        assert sorted(have) == [1, 2, 3, 4, 5], (tag, have)
        assert close(have, want), (tag, have, want)
    assert close(scalars(dump, "validation_metrics/loss"), scalars(ref, "validation_metrics/loss"))
    assert re.search(r"^mesh: PP \d \(pipeline stages, p2p\) x ", stdout, re.M), stdout
    assert "pipeline: " in stdout
    # 8 samples per step over dp 2 (4 with TP, ZBV): gradient accumulation on top of the schedule
    accum = 4 if name in ("pp2_tp2", "pp4_zbv") else 2
    assert f"gradient accumulation steps: {accum}" in stdout


@pytest.mark.skipif(not _SAME_RANK_STAGES, reason="torch 2.11 runs no V schedule over gloo")
def test_the_stage_line_says_where_each_stage_lives(runs):
    out = runs["pp4_zbv"][1]
    line = next(ln for ln in out.splitlines() if ln.startswith("pipeline: "))
    assert "ZBVZeroBubble, 8 stages over pp 4" in line, line
    assert "rank 0: stage 0 (embedding) + stage 7 (norm+head)" in line, line


@pytest.mark.parametrize(
    "source, name, nproc, overrides",
    [
        ("pp2_fsdp2", "fsdp4", 4, ()),
        ("pp2_fsdp2", "pp4", 4, (PP, "4", SCHED, *V)),
        ("pp2_fsdp2", "one", 1, ()),
        ("ref", "one-to-pp2-tp2", 4, (PP, "2", "--parallelism.tensor_parallel_degree", "2")),
    ],
)
def test_pp_checkpoint_resumes_on_other_layouts(runs, tmp_path, source, name, nproc, overrides):
    """Saved at PP 2 x FSDP 2: at FSDP 4, PP 4 and on 1 rank; and the other way, a 1-rank
    checkpoint under PP 2 x TP 2."""
    saved = runs[source][0]
    dump = stopped_after_save(saved, tmp_path / name, 5)
    out = run_train(
        dump, *COMMON, *overrides, nproc=nproc, env={"TRAINER_DEBUG_WEIGHT_DIGEST": "1"}
    ).stdout
    assert re.search(r"resumed from \S*step-3 \(step 3\)", out), out
    assert f"loaded weights digest {saved_digest(saved / 'checkpoint' / 'step-3')}" in out, out
    for tag in TAGS:
        assert close(scalars(dump, tag), {s: v for s, v in scalars(saved, tag).items() if s > 3}), (
            tag
        )


def test_hf_export_and_generation_read_a_pp_checkpoint(runs, tmp_path):
    """A PP checkpoint has the whole model's names: offline export and sampling read it like
    the 1-rank one; the in-run HF export (last_save_in_hf) gathers every stage."""
    from safetensors.torch import load_file

    pp_ckpt = runs["pp2_fsdp2"][0] / "checkpoint" / "step-3"
    ref_ckpt = runs["ref"][0] / "checkpoint" / "step-3"
    pp, ref = load_tensors(pp_ckpt), load_tensors(ref_ckpt)
    python, env = fork_python()
    model_keys = [k for k in ref if ".model." in k]
    assert sorted(k for k in pp if ".model." in k) == sorted(model_keys)
    assert max(float((pp[k] - ref[k]).abs().max()) for k in model_keys) <= 1e-5

    def generated(ckpt):
        return subprocess.run(
            [
                python,
                "-m",
                "trainer.generate",
                "--checkpoint",
                str(ckpt),
                "--prompt",
                "1 2 3",
                "--max_new_tokens",
                "8",
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        ).stdout

    assert generated(pp_ckpt) == generated(ref_ckpt)
    subprocess.run(
        [python, "-m", "trainer.convert", "to-hf", str(pp_ckpt), str(tmp_path / "hf")],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert (exported["lm_head.weight"] == pp["model_optim.model.output.weight"]).all()
    want = load_file(runs["ref"][0] / "hf" / "model.safetensors")
    for name in ("pp2_fsdp2", "pp4_zbv", "pp2_tp2"):
        got = load_file(runs[name][0] / "hf" / "model.safetensors")
        assert sorted(got) == sorted(want), name
        assert max(float((got[k] - want[k]).abs().max()) for k in want) <= 1e-4, name


ROLLBACK = (
    "--training.device",
    "cpu",
    "--model.flavor",
    "debugmodel-narrow",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
    *SYNTHETIC,
    "--metrics.log_freq",
    "1",
    "--training.spike_window",
    "3",
    "--checkpoint.enable",
    "true",
    "--checkpoint.keep_latest_k",
    "0",
    "--training.on_spike",
    "rollback",
    "--checkpoint.interval",
    "2",
    "--training.steps",
    "8",
    PP,
    "2",
)


def test_a_spike_rolled_back_under_pp_ends_where_skipping_its_batch_ends(tmp_path):
    """The last stage's loss of step 6 spikes (x20, injected on rank 1): every rank rolls back
    to step-4 and passes over that batch; the run then ends bitwise equal (weights and
    optimizer state) to the run configured to pass over the same batch."""
    straight, rolled = tmp_path / "straight", tmp_path / "rolled"
    run_train(straight, *ROLLBACK, "--training.skip_data_steps", "6")
    out = run_train(rolled, *ROLLBACK, env={"TRAINER_TEST_SPIKE_LOSS": "1:6:20"}).stdout
    assert re.search(r"^loss spike at step 6: .* rolled back to checkpoint step-4", out, re.M), out
    assert losses(rolled) == losses(straight)
    got = load_tensors(rolled / "checkpoint" / "step-8")
    ref = load_tensors(straight / "checkpoint" / "step-8")
    assert got.keys() == ref.keys() and any(k.startswith("model_optim.optimizer") for k in got)
    assert [k for k in got if not bool((got[k] == ref[k]).all())] == []


# ------------------------------------------------------------------------------- in-process


def test_balanced_split_counts_the_embedding_and_the_head():
    two = split_stages(6, 2)
    assert [(s.embedding, s.layers, s.head) for s in two] == [
        (True, (0, 1, 2), False),
        (False, (3, 4, 5), True),
    ]
    eight = split_stages(6, 8)  # one unit per stage
    assert eight[0].embedding and eight[0].layers == () and eight[7].head and eight[7].layers == ()
    assert [s.layers for s in eight[1:7]] == [(i,) for i in range(6)]
    three = split_stages(6, 3)  # 8 units of equal weight: 2, 3, 3 (the first stage lighter)
    assert [s.layers for s in three] == [(0,), (1, 2, 3), (4, 5)]
    assert [s.layers for s in split_stages(6, 3, split_points=["layers.1", "layers.4"])] == [
        (0,),
        (1, 2, 3),
        (4, 5),
    ]
    assert [s.layers for s in split_stages(6, 4, layers_per_stage=2)] == [
        (0,),
        (1, 2),
        (3, 4),
        (5,),
    ]


def test_the_default_split_balances_the_units_work():
    """Weighted by their work, a free embedding and a head of 3.5 layers: 32 layers over 4
    stages put 9 layers on the first stage and 5 beside the head; the heaviest stage is the
    least any cut allows (an exhaustive search agrees), and explicit cuts ignore the weights."""
    import itertools

    weights = [0.0] + [1.0] * 32 + [3.5]
    specs = split_stages(32, 4, weights=weights)
    assert [len(s.layers) for s in specs] == [9, 9, 9, 5] and specs[3].head
    work = stage_work(specs, weights)
    best = min(
        max(sum(weights[a:b]) for a, b in zip((0, *cuts), (*cuts, 34), strict=True))
        for cuts in itertools.combinations(range(1, 34), 3)
    )
    assert max(work) == best == 9.0
    assert work == [9.0, 9.0, 9.0, 8.5]
    # a light first unit run (DeepSeek's dense layers) draws more of them onto its stage
    dense_first = [0.0] + [0.5] * 3 + [1.0] * 13 + [1.0]
    assert [len(s.layers) for s in split_stages(16, 2, weights=dense_first)] == [9, 7]
    assert [
        s.layers
        for s in split_stages(
            6, 3, split_points=["layers.1", "layers.4"], weights=[0.0] + [1.0] * 6 + [9.0]
        )
    ] == [(0,), (1, 2, 3), (4, 5)]
    # the 70B's head weighs 1.06 layers: 80 layers over 4 stages as evenly as they go
    from trainer.models.flavors import model_args
    from trainer.models.flops import unit_flops

    seventy = unit_flops(model_args("70B", vocab_size=128256), 8192)
    assert 1.0 < seventy[-1] / seventy[1] < 1.1 and seventy[0] == 0.0
    assert [len(s.layers) for s in split_stages(80, 4, weights=seventy)] == [20, 21, 20, 19]


def test_v_and_looped_placements():
    assert [stage_rank(s, 4, "v") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert rank_stages(0, 4, 8, "v") == [0, 7]
    assert rank_stages(1, 2, 4, "loop") == [1, 3]


def test_bubble_fractions():
    gpipe, inter, zbv = SCHEDULES["GPipe"], SCHEDULES["Interleaved1F1B"], SCHEDULES["ZBVZeroBubble"]
    assert bubble_fraction(gpipe, 4, 8, 1) == pytest.approx(3 / 11)
    assert bubble_fraction(inter, 4, 8, 2) == pytest.approx(1.5 / 9.5)
    assert bubble_fraction(zbv, 4, 8, 2) == 0.0
    assert bubble_fraction(gpipe, 1, 8, 1) == 0.0


def error(world: int, *args: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(["--training.device", "cpu", *args]).resolve(world)
    return str(e.value)


def test_bad_pipeline_settings_are_one_line_each():
    assert error(4, PP, "3") == (
        "parallelism.pipeline_parallel_degree = 3 does not divide world size 4; valid: 1, 2, 4"
    )
    assert "model.flavor 'debugmodel-tiny' has only 4 units to place" in error(
        4, PP, "4", SCHED, "ZBVZeroBubble", "--model.flavor", "debugmodel-tiny"
    )
    assert "needs at least 4 microbatches per step, but training.local_batch_size 2" in error(
        4, PP, "4", "--training.local_batch_size", "2"
    )
    msg = error(2, PP, "2", SCHED, "zb")
    assert msg.startswith(
        "parallelism.pipeline_parallel_schedule = 'zb' is not a schedule; "
        "valid: GPipe, 1F1B, Interleaved1F1B"
    ), msg
    assert "'layers.9', which names no layer" in error(
        2, PP, "2", "--parallelism.pipeline_parallel_split_points", "layers.9"
    )
    assert "tied to the token embedding" in error(2, PP, "2", "--model.flavor", "debugmodel-3.2")
    assert "cannot be used with it" in error(
        4, PP, "2", SCHED, "ZBVZeroBubble", "--parallelism.fsdp_reshard_after_forward", "always"
    )
    assert "must divide training.local_batch_size" in error(
        2, PP, "2", "--parallelism.pipeline_parallel_microbatch_size", "3"
    )
    assert "runs 1 stage(s) per rank (2 stages at pp 2), but the split gives 4" in error(
        2, PP, "2", "--parallelism.pipeline_parallel_split_points", "layers.1,layers.2,layers.4"
    )
    assert "with 3 stages: the stages must divide evenly over the pp ranks" in error(
        2, PP, "2", "--parallelism.pipeline_parallel_split_points", "layers.2,layers.4"
    )
    # PP 4 with ZBV, 8 stages, fits the 6-layer debug model
    load_config(["--training.device", "cpu", PP, "4", SCHED, "ZBVZeroBubble"]).resolve(4)


def test_pp_takes_its_share_of_the_world():
    pd = ParallelDims(1, -1, 8, tp=2, pp=2)
    assert (pd.dp_shard, pd.dp_size, pd.model_parallel) == (2, 2, 4)


def test_a_bad_degree_fails_before_any_rank_starts(tmp_path):
    proc = run_train(tmp_path, *COMMON, PP, "3", nproc=4, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "config error: parallelism.pipeline_parallel_degree = 3 does not divide world size 4; "
        "valid: 1, 2, 4"
    )


def plan_cfg(*args: str):
    return load_config(["--job.config_file", "configs/llama3_70b.toml", *args])


def test_the_plan_is_per_pp_rank():
    """1F1B: the first rank keeps pp microbatches' activations, the last one; the parameters of
    all ranks add up to the model's; the busiest rank is the plan's; p2p is counted."""
    from trainer.plan.comm import comm_volume
    from trainer.plan.memory import memory_plan
    from trainer.plan.pipeline import in_flight

    cfg = plan_cfg(
        PP,
        "4",
        "--training.local_batch_size",
        "8",
        "--training.global_batch_size",
        "8",
        "--parallelism.tensor_parallel_degree",
        "8",
    )
    assert [in_flight(cfg, r) for r in range(4)] == [4, 3, 2, 1]
    ranks = [memory_plan(cfg, 32, r) for r in range(4)]
    whole = memory_plan(
        plan_cfg("--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "8"),
        32,
    )
    # dp_shard = 1 at pp 4 x tp 8 on 32 GPUs, 4 without pp: the same bytes per device in sum
    assert sum(b["parameters"] for b in ranks) == pytest.approx(4 * whole["parameters"], 1e-3)
    assert ranks[0]["activations"] > ranks[3]["activations"] - ranks[3]["logits_loss"]
    plan = memory_plan(cfg, 32)
    assert plan["total"] == max(b["total"] for b in ranks)
    assert plan["pp_rank_totals"] == [b["total"] for b in ranks]
    comm = comm_volume(cfg, 32)
    # rank 1 sends activations forward and gradients backward: 2 x 8 microbatches of
    # [1, 8192 / 8, 8192] bf16 per optimizer step (one schedule step: 8 x 1 samples)
    assert comm["comm_pp"] == 2 * 8 * 2 * 1024 * 8192


def test_the_405b_config_fits_with_pp():
    from trainer.plan.memory import device_need, memory_plan

    cfg = load_config(["--job.config_file", "configs/llama3_405b.toml"])
    pd, _ = cfg.resolve(512)
    assert (pd.pp, pd.tp, pd.dp_shard) == (8, 8, 8)
    assert device_need(memory_plan(cfg, 512)["total"]) < 79 * 2**30


def test_accumulation_reduces_once_per_optimizer_step():
    """PP 2 x FSDP 2 with 4 accumulation microbatches (tests/scripts/pp_accum_probe.py): each
    FSDP group of a stage reduce-scatters once per optimizer step under sync 'last' (before:
    once per schedule step, 4x), once per microbatch under 'every', to the same gradients;
    each group is all-gathered once per schedule step (no second gather of the head group:
    the traced dry run's driver shows one, the real schedules do not)."""
    from torch.distributed.pipelining import PipelineStage

    from tests.helpers import torchrun

    if not hasattr(PipelineStage, "perform_reduce_grad"):
        pytest.skip(
            "this torch's schedules reduce inside each schedule step (no "
            "perform_reduce_grad to defer)"
        )
    proc = torchrun(REPO / "tests/scripts/pp_accum_probe.py", nproc=4, fork=True)
    assert proc.stdout.count("pp accum probe ok: 4 reduce-scatters per optimizer step") == 4, (
        proc.stdout + proc.stderr
    )
    assert proc.stdout.count(", 16 all-gathers") == 4, proc.stdout  # 4 groups x 4 steps
