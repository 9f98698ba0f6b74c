"""The loss guard: non-finite steps are skipped on every rank together, too many in a row stop
the run with one line and exit code 4, and loss spikes are counted."""

import math
import re

import torch

from tests.helpers import BASE_FP32, losses, run_train, scalars
from trainer.config.job import JobConfig
from trainer.errors import TrainingError

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


def test_nan_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Rank 1's loss is NaN at steps 2 and 3 (testing hook): both ranks skip those optimizer
    steps, so the weights are untouched (the validation loss, on fixed samples, is bitwise the
    same after steps 1, 2 and 3), and training goes on at step 4."""
    proc = run_train(
        tmp_path,
        *BASE_FP32,
        *VAL_EVERY_STEP,
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "false",
        env={"TRAINER_TEST_NAN_LOSS": "1:2,3"},
    )
    val = scalars(tmp_path, "validation_metrics/loss")
    assert val[1] == val[2] == val[3] and val[4] < val[3], val
    assert scalars(tmp_path, "loss_metrics/skipped_steps") == {2: 1.0, 3: 2.0}
    assert "step 3: skipped the optimizer step" in proc.stdout
    assert math.isnan(losses(tmp_path)[2]) and math.isfinite(losses(tmp_path)[4])


def test_divergence_stops_with_one_line_and_a_finite_checkpoint(tmp_path):
    """lr 1e4 without clipping blows the weights up at step 1 (finite but huge); the gradients
    of step 2 on are non-finite. With max_skipped_steps 2 the run skips 2 steps and stops at
    the third, exit code 4, one line; the latest checkpoint holds finite weights."""
    proc = run_train(
        tmp_path,
        *BASE_FP32,
        "--optimizer.lr",
        "1e4",
        "--training.max_norm",
        "0",
        "--training.max_skipped_steps",
        "2",
        "--training.steps",
        "20",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
        check=False,
    )
    assert proc.returncode == 4, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr
    m = re.fullmatch(
        r"training error: non-finite (loss|grad norm) at steps (\d+)-(\d+); "
        r"last checkpoint step-(\d+)",
        lines[0],
    )
    assert m, lines[0]
    first, last, ckpt = int(m.group(2)), int(m.group(3)), int(m.group(4))
    assert last - first == 2 and max(losses(tmp_path)) == last  # stopped at the third skip
    assert scalars(tmp_path, "loss_metrics/skipped_steps") == {first: 1, first + 1: 2, last: 3}
    saved = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "checkpoint").iterdir())
    assert saved and max(saved) == ckpt < first  # never saved at a skipped step

    from trainer.config.job import load_config
    from trainer.generate import load_model

    cfg = load_config(["--job.config_file", str(tmp_path / "config.toml")])
    model = load_model(
        tmp_path / "checkpoint" / f"step-{ckpt}",
        cfg,
        token_vocab=cfg.data.vocab_size,
        max_len=64,
        device=torch.device("cpu"),
    )
    assert all(torch.isfinite(p).all() for p in model.parameters())


class _Printed(list):
    def __call__(self, line):
        self.append(line)


def test_spikes_are_counted_and_logged(tmp_path):
    """A falling, noisy loss has no spike; a jump far above the window's mean is one, written
    to TensorBoard (real writer) and printed."""
    from trainer.health.guard import LossGuard
    from trainer.models.flavors import model_args
    from trainer.observe.metrics import MetricsProcessor

    cfg = JobConfig()
    cfg.job.dump_folder = str(tmp_path)
    cfg.training.spike_window = 10
    metrics = MetricsProcessor(
        cfg,
        model_args=model_args("debugmodel"),
        seq_len=64,
        device=torch.device("cpu"),
        rank=0,
        parallel_desc="1 process",
        accumulation_steps=1,
        num_params=1,
    )
    metrics.open()
    printed = _Printed()
    guard = LossGuard(cfg.training, log=printed, metrics=metrics)
    curve = [5.0 - 0.05 * s + 0.02 * ((-1) ** s) for s in range(1, 40)]
    for step, loss in enumerate(curve, start=1):
        guard.good_step(step, loss)
    guard.good_step(40, curve[-1] + 3.0)
    guard.good_step(41, curve[-1])
    metrics.close()
    assert guard.spikes == 1 and scalars(tmp_path, "loss_metrics/spikes") == {40: 1.0}
    assert len(printed) == 1 and printed[0].startswith("loss spike at step 40:")
    # Non-finite steps in a row beyond the limit raise the one-line error.
    guard.max_skipped = 0
    try:
        guard.skipped_step(42, math.nan, math.nan, "step-40")
    except TrainingError as e:
        assert e.one_line() == "training error: non-finite loss at step 42; last checkpoint step-40"
    else:
        raise AssertionError("no TrainingError")
