"""Acting on loss spikes (training.on_spike): the decision logic in one process, then end to end
through run_train.sh on 2 CPU ranks: a skipped spike leaves the weights as they were, a rollback
ends bitwise where an uninterrupted run with training.skip_data_steps ends (also across a crash
right after the rollback), and the rollbacks are bounded.

The spikes are injected with TRAINER_TEST_SPIKE_LOSS on rank 1 only, so every rank must decide
on the global loss. The hook follows the data: it fires on the global batch that step N trains
in an uninterrupted run, so a step that passes over that batch does not meet it again."""

import math
import re

import pytest

from tests.helpers import BASE_FP32, losses, run_train, scalars
from trainer.checkpoint.safe_load import load_tensors
from trainer.checkpoint.states import TrainState
from trainer.config.job import JobConfig, load_config
from trainer.errors import ConfigError, DataError, TrainingError
from trainer.health.guard import LossGuard, Spike, spike_action
from trainer.health.spikes import check_data_skips

# ------------------------------------------------------------------------------ decision logic


class _Out:
    """What the guard prints and writes to TensorBoard."""

    def __init__(self):
        self.lines, self.tb = [], {}

    def __call__(self, line):
        self.lines.append(line)

    def log_scalars(self, step, values):
        for tag, value in values.items():
            self.tb.setdefault(tag, {})[step] = value


def guard_for(on_spike="skip", window=3, threshold=6.0, max_skipped=5, max_rollbacks=3, state=None):
    cfg = JobConfig().training
    cfg.on_spike, cfg.spike_window, cfg.spike_threshold = on_spike, window, threshold
    cfg.max_skipped_steps, cfg.max_rollbacks = max_skipped, max_rollbacks
    out = _Out()
    return LossGuard(cfg, log=out, metrics=out, state=state or TrainState()), out


def never_asked():
    raise AssertionError("the newest checkpoint was asked for without a rollback in question")


def test_spike_action_policy():
    assert spike_action("log", 0, 3, None) == "log"
    assert spike_action("skip", 9, 3, 4) == "skip"
    assert spike_action("rollback", 0, 3, 4) == "rollback"
    assert spike_action("rollback", 2, 3, 4) == "rollback"
    assert spike_action("rollback", 3, 3, 4) == "stop"  # max_rollbacks done: the next one stops
    assert spike_action("rollback", 0, 3, None) == "skip"  # nothing to roll back to yet
    assert spike_action("rollback", 0, 0, None) == "stop"  # 0: stop at the first spike


def test_detector_needs_a_full_window_and_more_than_threshold_std():
    guard, _ = guard_for(window=3, threshold=2.0)
    for step, loss in enumerate([3.0, 5.0], start=1):
        assert guard.before_update(step, loss, never_asked) is None
    assert guard.detect(3, 100.0) is None  # 2 of 3 losses: no verdict yet
    assert guard.before_update(3, 4.0, never_asked) is None
    mean, std = 4.0, math.sqrt(2 / 3)
    assert guard.detect(4, mean + 2.0 * std) is None  # at the threshold: not above it
    assert guard.detect(4, math.inf) is None and guard.detect(4, math.nan) is None
    spike = guard.detect(4, 6.0)
    assert spike == Spike(4, 6.0, mean, pytest.approx(std), 3)
    assert spike.describe(2.0) == "6.0000 > mean 4.0000 + 2 x std 0.8165 of the previous 3 steps"
    off, _ = guard_for(on_spike="log", window=0)
    off.good_step(1, 1.0)
    assert off.detect(2, 1e9) is None and off.state.loss_window == []


def test_skipped_spikes_stay_out_of_the_window_and_count_in_the_streak():
    state = TrainState()
    guard, out = guard_for(on_spike="skip", max_skipped=1, state=state)
    for step, loss in enumerate([5.0, 5.1, 4.9], start=1):
        assert guard.before_update(step, loss, never_asked) is None
        guard.good_step(step, loss)  # after the update: ends any streak, records nothing more
    assert state.loss_window == [5.0, 5.1, 4.9]

    spike = guard.before_update(4, 50.0, never_asked)
    assert spike.action == "skip" and spike.checkpoint is None
    guard.skipped_spike(spike, "step-2")
    assert list(guard.window) == state.loss_window == [5.0, 5.1, 4.9]  # not polluted
    assert out.tb == {"loss_metrics/spikes": {4: 1}, "loss_metrics/skipped_steps": {4: 1}}
    assert out.lines == [
        "loss spike at step 4: 50.0000 > mean 5.0000 + 6 x std 0.0816 of the "
        "previous 3 steps (1 so far); skipped its optimizer step "
        "(training.on_spike = 'skip'); 1 in a row, at most 1 allowed "
        "(training.max_skipped_steps); no checkpoint is saved at a skipped step"
    ]

    # A lasting rise stays a spike (the window keeps the old level): the streak stops the run.
    with pytest.raises(TrainingError) as e:
        guard.skipped_spike(guard.before_update(5, 50.0, never_asked), "step-2")
    assert e.value.one_line() == "training error: loss spikes at steps 4-5; last checkpoint step-2"

    # A non-finite step and a spike in one streak are both named.
    guard.good_step(6, 5.0)
    guard.skipped_step(7, math.nan, math.nan, "step-6")
    with pytest.raises(TrainingError, match=r"non-finite loss and a loss spike at steps 7-8;"):
        guard.skipped_spike(guard.before_update(8, 50.0, never_asked), "step-6")


def test_rollbacks_are_counted_in_the_state_and_bounded():
    state = TrainState(loss_window=[5.0, 5.1, 4.9])  # as a checkpoint holds it
    guard, out = guard_for(on_spike="rollback", max_rollbacks=2, state=state)
    assert list(guard.window) == [5.0, 5.1, 4.9]  # a resume detects at once

    assert guard.before_update(4, 50.0, lambda: None).action == "skip"  # no checkpoint yet
    asked = []

    def newest():
        asked.append(1)
        return 4

    spike = guard.before_update(6, 50.0, newest)
    assert (spike.action, spike.checkpoint, len(asked)) == ("rollback", 4, 1)
    guard.record(5.0)  # steps trained since the checkpoint...
    state.loss_window = [5.0, 5.1, 4.9]  # ...are undone by the reload: the state is step-4's
    state.rollback_steps.append(6)
    guard.rolled_back(spike)
    assert list(guard.window) == [5.0, 5.1, 4.9] and guard.streak == []
    assert out.tb["loss_metrics/rollbacks"] == {6: 1}
    assert out.lines[-1] == (
        "loss spike at step 6: 50.0000 > mean 5.0000 + 6 x std 0.0816 of "
        "the previous 3 steps (2 so far); rolled back to checkpoint step-4 "
        "(rollback 1, at most 2: training.max_rollbacks); step 6 will pass "
        "over one global batch, the one it spiked on"
    )

    state.rollback_steps.append(7)
    spike = guard.before_update(8, 50.0, newest)
    assert (spike.action, spike.checkpoint) == ("stop", 4)
    assert guard.rollbacks_exhausted(spike).one_line() == (
        "training error: loss spike at step 8: 50.0000 > mean 5.0000 + 6 x std 0.0816 of the "
        "previous 3 steps, after 2 rollbacks (at most 2: training.max_rollbacks); last "
        "checkpoint step-4"
    )
    assert out.tb["loss_metrics/spikes"] == {4: 1, 6: 2, 8: 3}


def test_log_mode_detects_after_the_step_only():
    guard, out = guard_for(on_spike="log")
    for step, loss in enumerate([5.0, 5.1, 4.9, 50.0, 5.0], start=1):
        guard.good_step(step, loss)
    assert out.lines[0].startswith("loss spike at step 4: 50.0000 > mean 5.0000")
    assert out.lines[0].endswith("(1 so far)") and len(out.lines) == 1
    assert guard.state.loss_window == [4.9, 50.0, 5.0]  # a logged spike joins the window
    skip, out = guard_for(on_spike="skip")
    for step, loss in enumerate([5.0, 5.1, 4.9, 50.0], start=1):
        skip.good_step(step, loss)  # the other modes detect in before_update, not here
    assert out.lines == [] and skip.state.loss_window == []


def test_train_state_of_an_older_checkpoint_loads_with_no_window_nor_rollbacks():
    state = TrainState(loss_window=[1.0], rollback_steps=[3])
    state.load_state_dict({"step": 7, "tokens_seen": 70})
    assert state == TrainState(step=7, tokens_seen=70)
    state.load_state_dict(TrainState(9, 90, [2.5], [4, 4]).state_dict())
    assert state == TrainState(9, 90, [2.5], [4, 4])


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--training.on_spike", "rollback"],
            "config error: training.on_spike = 'rollback' needs checkpoint.enable = true (a "
            "rollback reloads the latest checkpoint); without checkpoints use on_spike = 'skip' or "
            "'log'",
        ),
        (
            ["--training.on_spike", "skip", "--training.spike_window", "0"],
            "config error: training.on_spike = 'skip' needs the spike detector, which "
            "training.spike_window = 0 turns off; set a window (e.g. 50) or on_spike = 'log'",
        ),
        (
            ["--training.on_spike", "restart"],
            "config error: training.on_spike = 'restart' is not valid; choose one of 'log', "
            "'skip', 'rollback'",
        ),
        (
            ["--training.skip_data_steps", "4,0"],
            "config error: training.skip_data_steps has 0; steps count from 1",
        ),
        (
            ["--training.max_rollbacks", "-1"],
            "config error: training.max_rollbacks = -1 is out of range; it must be >= 0",
        ),
    ],
)
def test_config_errors_name_the_key(args, message):
    with pytest.raises(ConfigError) as e:
        load_config(args)
    assert e.value.one_line() == message


def test_a_streamed_dataset_cannot_pass_over_batches():
    class Streamed:  # no global order, no skip_global_batch
        pass

    cfg = load_config(["--training.skip_data_steps", "5"]).training
    with pytest.raises(
        DataError,
        match=r"^training.skip_data_steps passes over global batches, "
        r"which needs a data source with a global order",
    ):
        check_data_skips(cfg, Streamed())
    cfg = load_config(["--training.on_spike", "rollback", "--checkpoint.enable", "true"]).training
    with pytest.raises(DataError, match=r"^training.on_spike = 'rollback' passes over"):
        check_data_skips(cfg, Streamed())
    check_data_skips(load_config(["--training.on_spike", "skip"]).training, Streamed())


# ------------------------------------------------------------------------------ end to end

SPIKE = 6  # the step whose data spikes (on rank 1, x20)
COMMON = [
    *BASE_FP32,
    "--training.spike_window",
    "3",
    "--checkpoint.enable",
    "true",
    "--checkpoint.keep_latest_k",
    "0",
    "--metrics.log_freq",
    "1",
]
ROLLBACK = [
    *COMMON,
    "--training.on_spike",
    "rollback",
    "--checkpoint.interval",
    "2",
    "--training.steps",
    "8",
]
HOOKS = {"TRAINER_TEST_SPIKE_LOSS": f"1:{SPIKE}:20", "TRAINER_DEBUG_DATA_HASHES": "1"}
VAL_EVERY_STEP = [
    "--validation.enable",
    "true",
    "--validation.freq",
    "1",
    "--validation.steps",
    "1",
    "--validation.local_batch_size",
    "2",
    "--validation.global_batch_size",
    "4",
]
ROLLBACK_LINE = (
    rf"^loss spike at step {SPIKE}: ([\d.]+) > mean ([\d.]+) \+ 6 x std [\d.]+ of "
    r"the previous 3 steps \(1 so far\); rolled back to checkpoint step-4 \(rollback "
    rf"1, at most 3: training.max_rollbacks\); step {SPIKE} will pass over one "
    "global batch, the one it spiked on$"
)


def batches(stdout: str) -> list[str]:
    """dp rank 0's sample hashes, one entry per step trained (TRAINER_DEBUG_DATA_HASHES)."""
    return re.findall(r"^data dp_rank 0 samples (\S+)$", stdout, re.M)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted run a rollback must equal: step 6 passes over its global batch by
    config (the hook is set too, and never fires: its batch is passed over)."""
    dump = tmp_path_factory.mktemp("straight")
    out = run_train(dump, *ROLLBACK, "--training.skip_data_steps", str(SPIKE), env=HOOKS).stdout
    assert "loss spike" not in out, out
    assert (
        f"step {SPIKE}: passed over 1 global batch, samples 40-47 (training.skip_data_steps)" in out
    ), out
    return dump, out


def test_rollback_ends_bitwise_where_skip_data_steps_ends_even_across_a_crash(straight, tmp_path):
    """Step 6 spikes: every rank reloads step-4 and re-saves it with the rollback recorded,
    trains 5 again and passes over step 6's batch. Then rank 0 dies while committing step-6;
    the resume from step-4 knows to pass over that batch (no second spike), and the run ends
    with the same weights and optimizer state, bit for bit, as the uninterrupted run."""
    ref_dump, ref_out = straight
    crashed = run_train(
        tmp_path,
        *ROLLBACK,
        check=False,
        env={**HOOKS, "TRAINER_TEST_CRASH_BEFORE_COMMIT": str(SPIKE)},
    )
    assert crashed.returncode == 17, crashed.stderr  # the crash hook, after the rollback
    out = crashed.stdout
    lines = [ln for ln in out.splitlines() if "rolled back" in ln]
    assert len(lines) == 1 and re.match(ROLLBACK_LINE, lines[0]), out
    spiked, mean = map(float, re.match(ROLLBACK_LINE, lines[0]).groups())
    assert spiked > 5 * mean
    assert (
        f"step {SPIKE}: passed over 1 global batch, samples 40-47 (a rollback from a spike "
        "at this step)" in out
    ), out
    assert scalars(tmp_path, "loss_metrics/rollbacks") == {SPIKE: 1.0}
    assert scalars(tmp_path, "loss_metrics/spikes") == {SPIKE: 1.0}
    # Steps 1-5, 6 (the spiking batch), 5 again, then 6 on the batch after: straight's batches
    # but the spiking one, and its losses.
    got, ref = batches(out), batches(ref_out)
    assert len(got) == SPIKE + 2 and got[SPIKE - 1] not in ref, got
    assert got[: SPIKE - 1] + got[SPIKE:] == ref[: SPIKE - 1] + ref[SPIKE - 2 : SPIKE]
    assert losses(tmp_path) == {s: v for s, v in losses(ref_dump).items() if s <= SPIKE}
    ckpt = tmp_path / "checkpoint"  # step-4 replaced in place: nothing abandoned or superseded
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-2", "step-4", f"step-{SPIKE}.partial"]

    resumed = run_train(tmp_path, *ROLLBACK, env=HOOKS).stdout
    assert re.search(r"resumed from \S*step-4 \(step 4\)", resumed), resumed
    assert "loss spike" not in resumed, resumed
    assert f"step {SPIKE}: passed over 1 global batch, samples 40-47 (a rollback" in resumed
    assert losses(tmp_path) == losses(ref_dump)
    got, ref = load_tensors(ckpt / "step-8"), load_tensors(ref_dump / "checkpoint/step-8")
    assert got.keys() == ref.keys() and any(k.startswith("model_optim.optimizer") for k in got)
    assert [k for k in got if not bool((got[k] == ref[k]).all())] == []
    assert scalars(tmp_path, "loss_metrics/rollbacks") == {SPIKE: 1.0}  # not counted again


def test_skip_leaves_the_weights_and_consumes_the_batch(straight, tmp_path):
    """on_spike = "skip", a spike at step 4: its loss is logged, the weights after step 4 are
    those after step 3 (validation on fixed samples, bitwise), no checkpoint at step 4, and
    step 5 trains on the next batch of the global order (the one straight trains at 5)."""
    _, ref_out = straight
    out = run_train(
        tmp_path,
        *COMMON,
        *VAL_EVERY_STEP,
        "--training.on_spike",
        "skip",
        "--checkpoint.interval",
        "1",
        "--training.steps",
        "5",
        env={**HOOKS, "TRAINER_TEST_SPIKE_LOSS": "1:4:20"},
    ).stdout
    val, loss = scalars(tmp_path, "validation_metrics/loss"), losses(tmp_path)
    assert val[4] == val[3] and val[5] != val[4], val
    assert loss[4] > 5 * loss[3], loss
    assert scalars(tmp_path, "loss_metrics/skipped_steps") == {4: 1.0}
    assert scalars(tmp_path, "loss_metrics/spikes") == {4: 1.0}
    spike_lines = [ln for ln in out.splitlines() if "spike" in ln]
    assert (
        len(spike_lines) == 1
        and spike_lines[0].startswith("loss spike at step 4: ")
        and spike_lines[0].endswith(
            "(1 so far); skipped its optimizer step (training.on_spike = "
            "'skip'); 1 in a row, at most 5 allowed "
            "(training.max_skipped_steps); no checkpoint is saved at a "
            "skipped step"
        )
    ), out
    assert batches(out) == batches(ref_out)[:5]
    names = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert names == ["step-1", "step-2", "step-3", "step-5"]


def test_spikes_beyond_max_rollbacks_stop_with_one_line(tmp_path):
    """max_rollbacks = 1, spikes in the data of steps 4, 6 and 8, a save every 5 steps. A first
    launch to step 5: step 4 has no checkpoint to go back to and is skipped instead. A resume
    (its spike window comes from step-5): step 6 rolls back to step-5, a checkpoint written
    before any load, and passes over its batch, so step 7 trains step 8's data and spikes:
    exit 4, one line."""
    args = [
        *COMMON,
        "--training.on_spike",
        "rollback",
        "--training.max_rollbacks",
        "1",
        "--checkpoint.interval",
        "5",
    ]
    env = {"TRAINER_TEST_SPIKE_LOSS": "1:4,6,8:20"}
    first = run_train(tmp_path, *args, "--training.steps", "5", env=env).stdout
    assert re.search(
        r"^loss spike at step 4: .*; no checkpoint to roll back to yet: skipped its "
        r"optimizer step instead \(training.on_spike = 'rollback'\);",
        first,
        re.M,
    ), first

    proc = run_train(tmp_path, *args, "--training.steps", "10", env=env, check=False)
    assert proc.returncode == 4, proc.stderr
    assert re.fullmatch(
        r"training error: loss spike at step 7: [\d.]+ > mean [\d.]+ \+ 6 x std "
        r"[\d.]+ of the previous 3 steps, after 1 rollback \(at most 1: "
        r"training.max_rollbacks\); last checkpoint step-5",
        proc.stderr.strip(),
    ), proc.stderr
    assert re.search(
        r"^loss spike at step 6: .*; rolled back to checkpoint step-5 \(rollback 1, "
        r"at most 1",
        proc.stdout,
        re.M,
    ), proc.stdout
    assert scalars(tmp_path, "loss_metrics/skipped_steps") == {4: 1.0}
    assert scalars(tmp_path, "loss_metrics/rollbacks") == {6: 1.0}
    assert scalars(tmp_path, "loss_metrics/spikes") == {4: 1.0, 6: 1.0, 7: 2.0}  # per launch
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-5"]
