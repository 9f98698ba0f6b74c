"""The README's first command: `./run_train.sh` with no arguments, as a newcomer runs it.

`.ci/run` runs that command itself before the suite (it is the quick start's first line); it
passes the run's folder in TRAINER_TEST_DEFAULT_RUN, and this test then checks that run instead
of training the same 100 steps a second time. Anywhere else the test launches it.
"""

import os
import subprocess
from pathlib import Path

import torch

from tests.helpers import RUN_TRAIN, losses, subprocess_env
from trainer.device import cpu_native_bf16, visible_gpus


def default_run(tmp_path: Path) -> tuple[Path, str]:
    """(the run's folder, its stdout): .ci/run's run of the first command, else a new one."""
    shared = os.environ.get("TRAINER_TEST_DEFAULT_RUN")
    if shared:  # .ci/run: `cd $dir && ./run_train.sh > stdout.log`, exit code in rc
        assert (Path(shared) / "rc").read_text().strip() == "0"
        return Path(shared), (Path(shared) / "stdout.log").read_text()
    home = tmp_path / "home"
    home.mkdir()
    env = subprocess_env({"HOME": str(home)})  # the stdlib tokenizer/store cache goes to ~/.cache
    for var in ("NGPU", "CONFIG_FILE", "OMP_NUM_THREADS"):
        env.pop(var, None)
    proc = subprocess.run(
        [str(RUN_TRAIN)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return tmp_path, proc.stdout


def test_default_run_trains_and_checkpoints(tmp_path):
    cwd, stdout = default_run(tmp_path)
    dump = cwd / "outputs" / "debug_model"
    assert (dump / "config.toml").exists()
    ckpts = sorted(p.name for p in (dump / "checkpoint").iterdir())
    assert ckpts == ["step-100", "step-50"]
    assert (dump / "checkpoint" / "step-100" / ".metadata").exists()
    curve = losses(dump)
    assert sorted(curve)[:2] == [1, 10] and max(curve) == 100
    assert curve[100] < curve[1] - 2.0, curve  # the loss falls visibly
    # One rank per GPU where GPUs are visible (bf16), else 2 CPU ranks in the dtype the CPU
    # computes natively: the README's promise on every machine.
    gpus = visible_gpus()[0] if torch.cuda.is_available() else 0
    assert f"mesh: FSDP mesh (dp_replicate=1, dp_shard={gpus or 2})" in stdout
    dtype = "bfloat16" if gpus or cpu_native_bf16()[0] else "float32"
    assert f"compute dtype: {dtype} (auto: " in stdout
    assert "training done at step 100" in stdout
