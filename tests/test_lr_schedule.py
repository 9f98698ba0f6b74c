"""The lr schedule (trainer/optim/lr_schedule.py): every step against the documented formula, the
default's values before decay_steps/decay_ratio existed, the extension property, the config
errors, and a resume that changes the schedule (in process, then end to end)."""

import math

import pytest
import torch

from tests.helpers import BASE_FP32, run_train, scalars, stopped_after_save
from trainer.config.job import LRScheduler, load_config
from trainer.errors import ConfigError
from trainer.optim.lr_schedule import decay_steps, lr_factor
from trainer.optim.optimizer import build_lr_scheduler


def build(peak: float, total_steps: int, **sched):
    """An AdamW over one parameter and the trainer's scheduler for it."""
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=peak)
    return opt, build_lr_scheduler(opt, LRScheduler(**sched), total_steps)


def train(opt, scheduler, steps: int) -> list[float]:
    """The lr of each of `steps` steps as the trainer applies it: the optimizer's lr, the
    scheduler stepped after it."""
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        assert scheduler.get_last_lr() == [lrs[-1]]
        opt.step()
        scheduler.step()
    return lrs


def schedule_lrs(total_steps: int, peak: float = 1.0, **sched) -> list[float]:
    """The lr of steps 1..total_steps."""
    return train(*build(peak, total_steps, **sched), total_steps)


def documented(s: int, T: int, W: int, K: int, shape: str, f: float) -> float:
    """factor(s) of trainer/optim/lr_schedule.py's docstring, written out again."""
    if s <= W:
        return s / (W + 1)
    if K == 0 or s <= T - K:
        return 1.0
    p = min(1.0, (s - T + K) / K)
    g = {"linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2, "sqrt": 1 - math.sqrt(p)}
    return f + (1 - f) * g[shape]


# T = 10, warmup 2, the last 4 steps decay to 0.2: warmup 1/3, 2/3; stable 3..6; decay 7..10.
WSD_10 = {
    "linear": [1 / 3, 2 / 3, 1, 1, 1, 1, 0.8, 0.6, 0.4, 0.2],
    "cosine": [1 / 3, 2 / 3, 1, 1, 1, 1, 0.882842712, 0.6, 0.317157288, 0.2],
    "sqrt": [1 / 3, 2 / 3, 1, 1, 1, 1, 0.6, 0.434314575, 0.307179677, 0.2],
}


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
def test_wsd_values_by_hand(shape):
    got = schedule_lrs(10, warmup_steps=2, decay_steps=4, decay_type=shape, min_lr_factor=0.2)
    assert got == pytest.approx(WSD_10[shape], abs=1e-9)
    assert got[2:6] == [1.0] * 4  # the stable phase is exactly the peak
    assert got[-1] == pytest.approx(0.2, abs=1e-15)  # min_lr_factor at the last step


@pytest.mark.parametrize("shape", ["linear", "cosine", "sqrt"])
@pytest.mark.parametrize(
    "T, W, sched",
    [
        (50, 5, {}),  # default: decay over every step after W + 1
        (50, 0, {}),
        (50, 5, {"decay_steps": 12}),
        (50, 5, {"decay_steps": 45}),  # W + K = T: no step at the peak
        (50, 5, {"decay_steps": 0}),  # no decay at all
        (50, 5, {"decay_ratio": 0.25}),  # K = round(12.5) = 12 (half to even)
        (37, 3, {"decay_ratio": 0.3}),  # K = round(11.1) = 11
        (4, 7, {}),  # the run ends in warmup
    ],
)
def test_every_step_matches_the_documented_formula(shape, T, W, sched):
    cfg = LRScheduler(warmup_steps=W, decay_type=shape, min_lr_factor=0.1, **sched)
    K = decay_steps(cfg, T)
    expected = [0.3 * documented(s, T, W, K, shape, 0.1) for s in range(1, T + 1)]
    got = schedule_lrs(T, peak=0.3, warmup_steps=W, decay_type=shape, min_lr_factor=0.1, **sched)
    assert got == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if K:
        assert got[-1] == pytest.approx(0.3 * 0.1, rel=1e-12)  # min_lr_factor at the end
    if T - K > W:
        assert got[T - K - 1] == 0.3  # the last stable step: exactly the peak


def test_decay_ratio_rounds_like_torchtitan():
    assert [decay_steps(LRScheduler(decay_ratio=r), 50) for r in (0.25, 0.23, 0.0, 1.0)] == [
        12,
        12,
        0,
        50,
    ]  # round(12.5) = 12, round(11.5) = 12: half to even


def previous_lr_factor(step, *, warmup_steps, total_steps, decay_type, min_lr_factor):
    """The factor before decay_steps/decay_ratio existed (0-based step), kept as the reference
    for the default schedule."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    decay = max(1, total_steps - warmup_steps - 1)
    progress = min(1.0, (step - warmup_steps) / decay)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if decay_type == "cosine" else 1 - progress
    return min_lr_factor + (1.0 - min_lr_factor) * shape


@pytest.mark.parametrize("shape", ["linear", "cosine"])
def test_default_is_the_previous_schedule_bit_for_bit(shape):
    for T in (1, 2, 3, 10, 11, 12, 57, 200):
        for W in (0, 1, 9, 10, 11, 30):
            for f in (0.0, 0.1, 0.3, 1 / 3, 0.7, 1.0):
                cfg = LRScheduler(warmup_steps=W, decay_type=shape, min_lr_factor=f)
                K = decay_steps(cfg, T)
                for s in range(1, T + 1):
                    new = lr_factor(
                        s,
                        warmup_steps=W,
                        decay_steps=K,
                        total_steps=T,
                        decay_type=shape,
                        min_lr_factor=f,
                    )
                    old = previous_lr_factor(
                        s - 1, warmup_steps=W, total_steps=T, decay_type=shape, min_lr_factor=f
                    )
                    assert new == old, (T, W, f, s, new, old)


@pytest.mark.parametrize("K", [0, 5])
def test_raising_steps_in_the_stable_phase_changes_no_lr_used(K):
    """Steps 1..20-K (all of a 20-step run but its decay) have the same lr for training.steps
    20 and 40 with the same decay_steps; the decay moves to the new end."""
    short = schedule_lrs(20, warmup_steps=3, decay_steps=K, decay_type="cosine", min_lr_factor=0.1)
    long = schedule_lrs(40, warmup_steps=3, decay_steps=K, decay_type="cosine", min_lr_factor=0.1)
    assert long[: 20 - K] == short[: 20 - K]
    assert long[20 - K : 40 - K] == [1.0] * 20
    if K:
        assert short[20 - K :] != long[20 - K : 20]
    # The default ties the slope to training.steps: every lr after warmup + 1 moves.
    short = schedule_lrs(20, warmup_steps=3)
    long = schedule_lrs(40, warmup_steps=3)
    assert all(a != b for a, b in zip(short[4:], long[4:20], strict=True))


def resumed(saved, peak: float, total_steps: int, **sched):
    """A new optimizer and scheduler loaded from `saved` (their state dicts) in the
    Checkpointer's order: the optimizer, then the scheduler."""
    opt, scheduler = build(peak, total_steps, **sched)
    opt.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    return opt, scheduler


def test_resume_applies_the_new_schedule_from_the_resumed_step():
    """The resumed step trains at the new config's lr (peak lr and formula), not at the
    checkpoint's next lr, which the optimizer's own state brings back."""
    opt, sched = build(1e-3, 100, warmup_steps=2, decay_steps=20)
    train(opt, sched, 10)
    saved = opt.state_dict(), sched.state_dict()
    assert opt.param_groups[0]["lr"] == 1e-3  # stable phase

    opt2, sched2 = build(2e-3, 16, warmup_steps=2, decay_steps=6)
    opt2.load_state_dict(saved[0])
    assert opt2.param_groups[0]["lr"] == 1e-3  # the checkpoint's lr, until the scheduler loads
    sched2.load_state_dict(saved[1])
    got = train(opt2, sched2, 6)  # the decay: steps 11..16, from the new peak
    expected = [
        2e-3
        * lr_factor(
            s, warmup_steps=2, decay_steps=6, total_steps=16, decay_type="linear", min_lr_factor=0.0
        )
        for s in range(11, 17)
    ]
    assert got == pytest.approx(expected, rel=1e-12) and got[-1] == 0.0
    assert "step 11 trains at lr 0.00166667" in sched2.resume_note()
    assert "would have used 0.001" in sched2.resume_note()

    # Only training.steps raised, in the stable phase: nothing changes, nothing is printed.
    opt3, sched3 = resumed(saved, 1e-3, 200, warmup_steps=2, decay_steps=20)
    assert opt3.param_groups[0]["lr"] == 1e-3 and sched3.resume_note() is None


def test_a_muon_schedule_saves_the_same_on_every_rank():
    """Muon at muon_lr 0.02 and lr 3e-4 under pipeline parallelism: rank 0 holds Muon's group
    and AdamW's, a stage of blocks Muon's alone. DCP saves one rank's copy of the schedule,
    not always rank 0's: both ranks save the same lrs by kind, and a resume with the same
    config from the blocks rank's copy names no change (it named lr 3e-4 against 0.02); one
    with another optimizer.lr names that alone."""
    peaks = {"lr": 3e-4, "muon": 0.02}

    def rank(kinds, lr=3e-4):
        groups = [{"params": [torch.nn.Parameter(torch.zeros(2, 2))], "use_muon": True, "lr": 0.02}]
        if kinds == 2:
            groups.append(
                {"params": [torch.nn.Parameter(torch.zeros(2))], "use_muon": False, "lr": lr}
            )
        opt = torch.optim.AdamW(groups)
        sched = build_lr_scheduler(
            opt, LRScheduler(warmup_steps=2, decay_steps=4), 10, {**peaks, "lr": lr}
        )
        for _ in range(7):  # the next, step 8, halfway down the decay: factor 0.5
            opt.step()
            sched.step()
        return opt, sched

    saved0, saved1 = rank(2)[1].state_dict(), rank(1)[1].state_dict()
    assert saved0 == saved1 and saved1["_last_lr"] == pytest.approx([0.01, 1.5e-4])
    _, again = rank(2)
    again.load_state_dict(saved1)
    assert again.resume_note() is None
    opt, lower = rank(2, lr=1e-4)
    lower.load_state_dict(saved1)
    assert lower.resume_note() == (
        "lr schedule changed at the resume: step 8 trains at lr 5e-05 (this run's "
        "optimizer.lr, muon_lr, [lr_scheduler] and training.steps); the checkpoint's run "
        "would have used 0.00015"
    )
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([0.01, 5e-5])


def test_unchanged_schedule_resumes_bit_for_bit_mid_decay():
    cfg = dict(warmup_steps=3, decay_steps=12, decay_type="cosine", min_lr_factor=0.1)
    straight = schedule_lrs(30, peak=3e-4, **cfg)
    opt, sched = build(3e-4, 30, **cfg)
    first = train(opt, sched, 22)
    again = train(*resumed((opt.state_dict(), sched.state_dict()), 3e-4, 30, **cfg), 8)
    assert first + again == straight and straight[21] < 3e-4


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["--lr_scheduler.decay_ratio", "1.5"],
            "lr_scheduler.decay_ratio = 1.5 is out of range; it must be in [0, 1], or -1 (off)",
        ),
        (["--lr_scheduler.decay_ratio", "-0.5"], "lr_scheduler.decay_ratio = -0.5 is out of range"),
        (["--lr_scheduler.decay_steps", "-2"], "lr_scheduler.decay_steps = -2 is out of range"),
        (
            ["--lr_scheduler.decay_steps", "10", "--lr_scheduler.decay_ratio", "0.1"],
            "lr_scheduler.decay_steps = 10 and lr_scheduler.decay_ratio = 0.1 are both set",
        ),
        (
            [
                "--training.steps",
                "100",
                "--lr_scheduler.warmup_steps",
                "10",
                "--lr_scheduler.decay_steps",
                "91",
            ],
            "lr_scheduler.warmup_steps = 10 plus lr_scheduler.decay_steps = 91 exceed "
            "training.steps = 100",
        ),
        (
            [
                "--training.steps",
                "100",
                "--lr_scheduler.warmup_steps",
                "10",
                "--lr_scheduler.decay_ratio",
                "0.95",
            ],
            "lr_scheduler.decay_ratio = 0.95 (round(0.95 * 100) = 95 decay steps) exceed",
        ),
        (
            ["--lr_scheduler.decay_type", "exp"],
            "lr_scheduler.decay_type = 'exp' is not valid; choose one of 'linear', 'cosine', "
            "'sqrt'",
        ),
    ],
)
def test_config_errors_name_the_key(args, needle):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    line = e.value.one_line()
    assert line.startswith("config error: ") and "\n" not in line
    assert needle in line


def test_fitting_schedules_are_valid():
    load_config(
        [
            "--training.steps",
            "100",
            "--lr_scheduler.warmup_steps",
            "10",
            "--lr_scheduler.decay_steps",
            "90",
        ]
    )  # W + K = T
    load_config(["--training.steps", "5", "--lr_scheduler.warmup_steps", "10"])  # default
    load_config(["--lr_scheduler.decay_ratio", "0", "--lr_scheduler.decay_type", "sqrt"])


# ----------------------------------------------------------------------------- end to end

PEAK = 1e-3
WSD = [
    *BASE_FP32,
    "--optimizer.lr",
    str(PEAK),
    "--lr_scheduler.decay_steps",
    "5",
    "--lr_scheduler.decay_type",
    "sqrt",
    "--lr_scheduler.min_lr_factor",
    "0.1",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "10",
]


# One rank, one thread: torchrun sets OMP_NUM_THREADS=1 only for several ranks, and a
# two-thread rank on 2 busy cores ran this test's 40-step resume 6x slower (44 s vs 7 s).
ONE_RANK = {"nproc": 1, "env": {"OMP_NUM_THREADS": "1"}}


def expected_lrs(T: int, K: int) -> dict[int, float]:
    return {s: PEAK * documented(s, T, 2, K, "sqrt", 0.1) for s in range(1, T + 1)}


def test_resume_extends_or_starts_the_decay(tmp_path):
    """A 20-step WSD run (warmup 2, decay 16..20, z-loss on, 2 ranks), resumed from its
    step-10 checkpoint (1 rank) twice:
    - `--training.steps 40` (and no z-loss): steps 11..15 keep the original lr, 16..35 are at
      the peak, 36..40 decay; step 11's cross-entropy equals the original's (whose logged loss
      is the cross-entropy alone, without the z-loss term);
    - the two-stage recipe, `--training.steps 16 --lr_scheduler.decay_steps 6`: the decay
      starts at step 11, whose lr is the new formula's (the optimizer's lr, as logged)."""
    run = tmp_path / "run"
    run_train(run, *WSD, "--training.steps", "20", "--training.z_loss_weight", "1e-3", nproc=2)
    lr = scalars(run, "lr")
    assert lr == pytest.approx(expected_lrs(20, 5), rel=1e-6)
    assert lr[20] == pytest.approx(0.1 * PEAK, rel=1e-6)  # TensorBoard keeps float32
    assert len({lr[s] for s in range(3, 16)}) == 1  # the stable phase: one value, the peak
    z = scalars(run, "loss_metrics/z_loss")
    assert sorted(z) == list(range(1, 21)) and all(0 < v < 1 for v in z.values())

    longer = stopped_after_save(run, tmp_path / "longer", 20)
    out = run_train(longer, *WSD, "--training.steps", "40", **ONE_RANK).stdout
    assert "resumed from" in out and "lr schedule changed" not in out
    lr40 = scalars(longer, "lr")
    assert sorted(lr40) == list(range(11, 41))
    assert all(lr40[s] == lr[s] for s in range(11, 16))  # no jump, nothing used changes
    assert lr40 == pytest.approx({s: v for s, v in expected_lrs(40, 5).items() if s > 10}, rel=1e-6)
    assert not scalars(longer, "loss_metrics/z_loss")
    ce = scalars(run, "loss_metrics/global_avg_loss")[11]
    assert scalars(longer, "loss_metrics/global_avg_loss")[11] == pytest.approx(ce, rel=1e-5)
    assert z[11] > 100 * 1e-5 * ce  # had the z-loss term been in it, that would have failed

    decay = stopped_after_save(run, tmp_path / "decay", 20)
    out = run_train(
        decay, *WSD, "--training.steps", "16", "--lr_scheduler.decay_steps", "6", **ONE_RANK
    ).stdout
    assert "lr schedule changed at the resume: step 11 trains at lr" in out
    lr16 = scalars(decay, "lr")
    assert lr16 == pytest.approx({s: v for s, v in expected_lrs(16, 6).items() if s > 10}, rel=1e-6)
    assert lr16[11] < PEAK and lr16[16] == pytest.approx(0.1 * PEAK, rel=1e-6)
