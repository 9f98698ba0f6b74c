"""The README's first command: `./run_train.sh` with no arguments, as a newcomer runs it."""

import subprocess

import torch

from tests.helpers import RUN_TRAIN, losses, subprocess_env
from trainer.device import cpu_native_bf16, visible_gpus


def test_default_run_trains_and_checkpoints(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = subprocess_env({"HOME": str(home)})  # the stdlib tokenizer/store cache goes to ~/.cache
    for var in ("NGPU", "CONFIG_FILE", "OMP_NUM_THREADS"):
        env.pop(var, None)
    proc = subprocess.run([str(RUN_TRAIN)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dump = tmp_path / "outputs" / "debug_model"
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
    assert f"mesh: FSDP mesh (dp_replicate=1, dp_shard={gpus or 2})" in proc.stdout
    dtype = "bfloat16" if gpus or cpu_native_bf16()[0] else "float32"
    assert f"compute dtype: {dtype} (auto: " in proc.stdout
    assert "training done at step 100" in proc.stdout
