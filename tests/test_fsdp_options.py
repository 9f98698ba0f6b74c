"""FSDP2 options beyond the default: partial resharding (`fsdp_reshard_after_forward = N`,
ZeRO++ hpZ) and CPU offload (`fsdp_offload = "cpu"`, CUDA only).

On CPU ranks: hpZ trains to the same losses as the default policy and its backward
all-gathers span N ranks; offload is a one-line config error on a CPU run, and its state dict
(FSDP2's CPUOffloadPolicy, unpinned on a CPU mesh) is the one without offload, so
checkpoints move between the two. The memory plan's arithmetic for both is checked here;
offload itself (pinned memory, CUDA streams) needs a GPU.
"""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, SYNTHETIC, subprocess_env, torchrun
from trainer.config.__main__ import main as config_main
from trainer.config.job import load_config
from trainer.plan.host import pinned
from trainer.plan.memory import memory_plan

PROBE = REPO / "tests" / "scripts" / "fsdp_options_probe.py"
RESHARD = "--parallelism.fsdp_reshard_after_forward"
OFFLOAD = "--parallelism.fsdp_offload"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp_options")
    torchrun(
        PROBE,
        str(out),
        *SYNTHETIC,
        "--training.seq_len",
        "32",
        "--training.local_batch_size",
        "2",
        "--training.mixed_precision_param",
        "float32",
        nproc=4,
    )
    return json.loads((out / "probe.json").read_text())


def test_reshard_to_pairs_matches_default_losses(probe):
    """4 CPU ranks, fp32, 5 steps on the same batches: hpZ with N = 2 changes where params
    live between forward and backward, not the math (every rank's loss, within 1e-6)."""
    assert len(probe["losses"]["2"]) == len(probe["losses"]["default"]) == 5
    assert probe["losses"]["2"][0] != probe["losses"]["2"][-1]  # it trained
    assert probe["loss_max_abs_diff"] <= 1e-6, probe["losses"]


def test_backward_all_gathers_span_the_reshard_group(probe):
    """Forward gathers every group over all 4 ranks; backward re-gathers the 2 blocks and the
    embedding from their post-forward shards over 2 ranks (the head stays unsharded)."""
    forward = [n for phase, n in probe["gathers"] if phase == "forward"]
    backward = [n for phase, n in probe["gathers"] if phase == "backward"]
    assert forward == [4] * 4  # embedding, 2 blocks, norm + head
    assert backward == [2] * 3, probe["gathers"]


def test_offload_state_dict_is_the_same_dtensor_layout(probe):
    """Same keys, global shapes, placements and mesh with and without CPUOffloadPolicy: DCP
    checkpoints are interchangeable, and one step gives bit-equal state."""
    assert probe["layouts"]["none"] == probe["layouts"]["cpu"]
    assert any(k.startswith("optim.") for k in probe["layouts"]["cpu"])
    assert probe["same_after_step"] and probe["states_differ"]
    assert probe["loaded_none_into_cpu"] and probe["loaded_cpu_into_none"]


def check(capsys, *argv: str) -> tuple[int, str]:
    code = config_main(["--check", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("value, world", [("3", "4"), ("1", "4"), ("8", "4"), ("2", "1")])
def test_invalid_reshard_group_is_one_line_naming_valid_values(capsys, value, world):
    code, err = check(capsys, "--world-size", world, RESHARD, value)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"config error: parallelism.fsdp_reshard_after_forward = '{value}'")
    valid = "2, 4" if world == "4" else "no integer"
    assert "'default', 'always', 'never', or " in err and valid in err


def test_reshard_value_types(capsys, tmp_path):
    code, err = check(capsys, "--world-size", "4", RESHARD, "sometimes")
    assert code == 2 and "or an integer N > 1" in err
    toml = tmp_path / "c.toml"
    toml.write_text("[parallelism]\nfsdp_reshard_after_forward = 2\n")  # a TOML integer
    cfg = load_config(["--job.config_file", str(toml)])
    assert cfg.parallelism.fsdp_reshard_after_forward == "2"
    assert check(capsys, "--world-size", "4", "--job.config_file", str(toml)) == (0, "")


def test_offload_on_a_cpu_run_is_one_line(capsys, monkeypatch, tmp_path):
    code, err = check(capsys, "--world-size", "2", OFFLOAD, "cpu", "--training.device", "cpu")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("config error: parallelism.fsdp_offload = 'cpu' needs a CUDA run")
    # device auto on a machine without a visible GPU: run_train.sh's launch check says so ...
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    code, err = check(capsys, "--nnodes", "1", "--nproc-per-node", "", OFFLOAD, "cpu")
    assert code == 2 and "needs a CUDA run, but no GPU is visible" in err
    # ... and a rank started without that check stops with the same one line.
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", OFFLOAD, "cpu", "--job.dump_folder", str(tmp_path)],
        env=subprocess_env({"CUDA_VISIBLE_DEVICES": ""}),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "needs a CUDA run, but this rank computes on cpu" in proc.stderr


LLAMA_8B = [
    "--job.config_file",
    str(REPO / "configs" / "llama3_8b.toml"),
    "--training.global_batch_size",
    "-1",
    "--checkpoint.async_mode",
    "disabled",
]


DEBUG = [
    "--data.dataset",
    "synthetic",
    "--training.global_batch_size",
    "-1",
    "--training.mixed_precision_param",
    "bfloat16",
]


def test_plan_counts_hpz_shards_kept_between_forward_and_backward():
    """N = 2 or 4 of 8: each rank keeps 1/2 of the blocks' and embedding's params (bf16) from
    forward to backward; 'never' keeps them whole, so hpZ adds exactly half of what 'never'
    adds over 'default' while a block is backpropagated."""
    plans = {
        policy: memory_plan(load_config([*DEBUG, RESHARD, policy]), 8)
        for policy in ("default", "never", "2", "4")
    }
    extra = {
        k: plans[k]["peak_block_backward"] - plans["default"]["peak_block_backward"]
        for k in ("never", "2", "4")
    }
    assert extra["never"] > 0
    assert extra["2"] == extra["never"] // 2 and extra["4"] == extra["never"] // 4
    assert plans["2"]["parameters"] == plans["default"]["parameters"]


def test_plan_with_offload_moves_sharded_state_to_host():
    base, off = (memory_plan(load_config([*LLAMA_8B, OFFLOAD, o]), 1) for o in ("none", "cpu"))
    assert base["host_parameters"] == 0 and base["offload_staging"] == 0
    # The device no longer holds the fp32 params, grads and AdamW states (120 GiB for 8B),
    # only the staging copies; the optimizer steps on the host.
    on_device = base["parameters"] + base["optimizer_state"]
    assert base["peak_loss"] - off["peak_loss"] == on_device - off["offload_staging"]
    assert off["peak_optimizer_step"] == off["buffers_and_inputs"] + off["offload_staging"]
    assert base["total"] > 80 * 2**30 > off["total"]
    # Host: pinned params and grads at the allocator's power-of-two sizes, AdamW exact.
    assert off["host_optimizer_state"] == base["optimizer_state"]
    assert off["parameters"] <= off["host_parameters"] < 2 * off["parameters"]
    assert pinned(3) == 4 and pinned(4) == 4 and pinned(2**20 + 1) == 2**21
    assert off["host_total"] == sum(
        v for k, v in off.items() if k.startswith("host_") and k != "host_total"
    )


def test_plan_cli_checks_host_ram(capsys):
    from trainer.plan.report import main as plan_main

    argv = [
        "--config",
        str(REPO / "configs" / "llama3_8b.toml"),
        "--ngpu",
        "1",
        "--training.global_batch_size",
        "-1",
        "--checkpoint.async_mode",
        "disabled",
        OFFLOAD,
        "cpu",
    ]
    assert plan_main([*argv, "--host-gib", "1024"]) == 0  # needs 129 GiB
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "host: " in out and "(--host-gib): fits" in out
    assert plan_main([*argv, "--host-gib", "64"]) == 0
    out = capsys.readouterr().out
    assert "verdict: DOES NOT FIT" in out and "not enough host memory" in out
