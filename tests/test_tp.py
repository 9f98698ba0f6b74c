"""Tensor parallelism end to end: run_train.sh on 4 CPU ranks (gloo, fp32, the debug model's
heads at dim 64, two of its blocks: debugmodel-narrow, model.n_layers 2).

Every layout with TP (TP 2 x FSDP 2, TP 4, HSDP 2 x TP 2; with activation checkpointing and
each gradient-accumulation sync mode) trains with the 1-rank losses and gradient norms; a
checkpoint saved at TP 2 x FSDP 2 resumes at FSDP 4 and at TP 4 (the loaded weights are the
saved ones, bitwise; the losses continue those of the uninterrupted run), and a 1-rank
checkpoint resumes at TP 2 x FSDP 2; the tp ranks of a dp rank read the same samples; the
HF export and generation read a TP checkpoint; the loss-parallel head never creates a
full-vocabulary tensor (tests/scripts/tp_probe.py); impossible TP settings are one line each.
"""

import re
import shutil
import subprocess

import pytest

from tests.helpers import REPO, SYNTHETIC, fork_python, losses, run_train, scalars, torchrun
from trainer.checkpoint.integrity import weights_digest
from trainer.checkpoint.safe_load import load_tensors
from trainer.config.job import load_config
from trainer.errors import ConfigError

# the debug model's heads (8 query, 4 KV: GQA) at dim 64, two of its blocks: what these runs
# check is in each block alike (its sharded projections, norms, AC), not in the depth or width
COMMON = (
    "--model.flavor",
    "debugmodel-narrow",
    "--model.n_layers",
    "2",
    "--training.steps",
    "5",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
    "--training.global_batch_size",
    "4",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    *SYNTHETIC,
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
    "--validation.enable",
    "false",
)
TP = "--parallelism.tensor_parallel_degree"
LAYOUTS = {  # name: (ranks, overrides)
    "ref": (1, ()),
    "tp2_fsdp2": (4, (TP, "2")),
    "tp4": (
        4,
        (
            TP,
            "4",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
            "--training.gradient_accumulation_sync",
            "every",
        ),
    ),
    "hsdp2_tp2": (
        4,
        (
            TP,
            "2",
            "--parallelism.data_parallel_replicate_degree",
            "2",
            "--training.local_batch_size",
            "1",
            "--activation_checkpoint.mode",
            "full",
            "--training.gradient_accumulation_sync",
            "hsdp_reduce_scatter",
        ),
    ),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        env = {"TRAINER_DEBUG_DATA_HASHES": "1"} if name == "tp2_fsdp2" else None
        proc = run_train(
            root / name,
            *COMMON,
            *overrides,
            nproc=nproc,
            env=env,
            log_rank="0,1,2,3" if env else "0",
        )
        out[name] = (root / name, proc.stdout)
    return out


def close(a: dict, b: dict, steps, tol=1e-4) -> bool:
    return all(abs(a[s] - b[s]) <= tol * max(1.0, abs(b[s])) for s in steps)


@pytest.mark.parametrize("name", ["tp2_fsdp2", "tp4", "hsdp2_tp2"])
def test_tp_layouts_train_as_one_rank(runs, name):
    ref, got = runs["ref"][0], runs[name][0]
    assert "x TP" in runs[name][1]  # the startup line names the mesh
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == [1, 2, 3, 4, 5]
        assert close(have, want, range(1, 6)), (tag, have, want)


def test_tp_ranks_of_a_dp_rank_read_the_same_samples(runs):
    lines = re.findall(r"^data dp_rank (\d) samples (\S+)$", runs["tp2_fsdp2"][1], re.M)
    by_rank: dict[str, list[str]] = {}
    for dp_rank, hashes in lines:
        by_rank.setdefault(dp_rank, []).append(hashes)
    assert sorted(by_rank) == ["0", "1"] and all(len(v) == 10 for v in by_rank.values())
    for seen in by_rank.values():
        # each step's batch is printed by both tp ranks of the dp rank: 5 batches, each twice
        assert len(set(seen)) == 5 and all(seen.count(batch) == 2 for batch in seen), seen
    samples = {r: {h for batch in v for h in batch.split(",")} for r, v in by_rank.items()}
    assert not samples["0"] & samples["1"]  # the dp ranks read different samples


def resume(runs, tmp_path, source: str, name: str, nproc: int, *overrides: str):
    """Resume `source`'s step-3 checkpoint as run `name` (its later checkpoints and TB gone)."""
    dump = tmp_path / name
    shutil.copytree(runs[source][0], dump)
    shutil.rmtree(dump / "checkpoint" / "step-5")
    shutil.rmtree(dump / "tb")
    proc = run_train(
        dump, *COMMON, *overrides, nproc=nproc, env={"TRAINER_DEBUG_WEIGHT_DIGEST": "1"}
    )
    return dump, proc.stdout


def saved_digest(step_dir) -> str:
    prefix = "model_optim.model."
    return weights_digest(
        (k[len(prefix) :], t) for k, t in load_tensors(step_dir).items() if k.startswith(prefix)
    )


@pytest.mark.parametrize(
    "name, nproc, overrides",
    [("fsdp4", 4, ("--training.local_batch_size", "1")), ("tp4", 4, (TP, "4"))],
)
def test_tp_checkpoint_resumes_at_another_degree(runs, tmp_path, name, nproc, overrides):
    dump, stdout = resume(runs, tmp_path, "tp2_fsdp2", name, nproc, *overrides)
    # the loaded weights, gathered on the new layout, are bitwise the saved ones
    digest = saved_digest(runs["tp2_fsdp2"][0] / "checkpoint" / "step-3")
    assert f"loaded weights digest {digest}" in stdout
    assert close(losses(dump), losses(runs["tp2_fsdp2"][0]), [4, 5])


def test_one_rank_checkpoint_resumes_under_tp(runs, tmp_path):
    dump, stdout = resume(runs, tmp_path, "ref", "ref-to-tp", 4, TP, "2")
    assert (
        f"loaded weights digest {saved_digest(runs['ref'][0] / 'checkpoint' / 'step-3')}" in stdout
    )
    assert close(losses(dump), losses(runs["ref"][0]), [4, 5])


def test_hf_export_and_generation_read_a_tp_checkpoint(runs, tmp_path):
    tp_ckpt = runs["tp2_fsdp2"][0] / "checkpoint" / "step-3"
    ref_ckpt = runs["ref"][0] / "checkpoint" / "step-3"
    tp, ref = load_tensors(tp_ckpt), load_tensors(ref_ckpt)
    python, env = fork_python()
    for key in (k for k in ref if ".model." in k):  # the full tensors, as one rank saved them
        assert (tp[key] - ref[key]).abs().max() <= 1e-5, key

    def generated(ckpt):
        proc = subprocess.run(
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
        )
        return proc.stdout

    assert generated(tp_ckpt) == generated(ref_ckpt)
    subprocess.run(
        [python, "-m", "trainer.convert", "to-hf", str(tp_ckpt), str(tmp_path / "hf")],
        cwd=REPO,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    from safetensors.torch import load_file

    hf = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        hf.update(load_file(f))
    assert (hf["lm_head.weight"] == tp["model_optim.model.output.weight"]).all()
    assert (hf["model.embed_tokens.weight"] == tp["model_optim.model.tok_embeddings.weight"]).all()


def test_loss_parallel_never_holds_the_full_vocabulary():
    proc = torchrun(REPO / "tests/scripts/tp_probe.py", nproc=2, fork=True)
    assert proc.stdout.count("tp probe ok") == 2 * 9, proc.stdout


@pytest.mark.parametrize(
    "world, overrides, needle",
    [
        (4, [TP, "3"], "tensor_parallel_degree = 3 does not divide world size 4; valid: 1, 2, 4"),
        (
            8,
            [TP, "8"],
            "does not divide model.flavor 'debugmodel' n_kv_heads = 4; valid tp "
            "degrees for this model: 1, 2, 4",
        ),
        (
            16,
            [TP, "16", "--model.flavor", "llama3.2-3B"],
            "does not divide model.flavor 'llama3.2-3B' n_heads = 24",
        ),
        (
            4,
            [TP, "4", "--model.vocab_size", "8190"],
            "does not divide the vocab (model.vocab_size) = 8190",
        ),
        (
            4,
            [TP, "4", "--training.seq_len", "66"],
            "training.seq_len = 66 is not a multiple of parallelism.tensor_parallel_degree = 4",
        ),
        (
            4,
            [TP, "2", "--parallelism.data_parallel_shard_degree", "4"],
            "multiply to 8, but the world size is 4",
        ),
        (
            4,
            [TP, "2", "--parallelism.enable_async_tensor_parallel", "true"],
            "enable_async_tensor_parallel = true needs CUDA, but this run computes on cpu",
        ),
        (
            4,
            [
                TP,
                "2",
                "--parallelism.enable_async_tensor_parallel",
                "true",
                "--training.device",
                "cuda",
            ],
            "needs compile.enable = true",
        ),
        (
            4,
            ["--parallelism.enable_async_tensor_parallel", "true"],
            "needs parallelism.tensor_parallel_degree > 1",
        ),
    ],
)
def test_impossible_tp_settings_are_one_config_error(world, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(["--training.device", "cpu", *overrides]).validate(world)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_a_tp_error_stops_run_train_before_any_rank_starts(tmp_path):
    proc = run_train(tmp_path / "bad", TP, "3", nproc=4, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "config error: parallelism.tensor_parallel_degree = 3 does not divide world size 4; "
        "valid: 1, 2, 4"
    ]
