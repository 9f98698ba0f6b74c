"""A doctored checkpoint never runs its code: resume, initial_load_path, trainer.generate and
trainer.convert refuse it with one line (or skip it, on resume), and no payload runs."""

import json
import os
import pickle
import shutil
import subprocess

import pytest
import torch

from tests.helpers import BASE_FP32, REPO, fork_python, losses, run_train
from trainer.checkpoint import integrity, safe_load
from trainer.data.store import file_blake2b


class _Payload:
    """Unpickles to `eval(expr)`: writes the marker file, then returns what `expr` returns."""

    def __init__(self, expr: str):
        self.expr = expr

    def __reduce__(self):
        return eval, (self.expr,)


def marker_expr(marker, then: str = "None") -> str:
    return f"(open({str(marker)!r}, 'w').close(), {then})[1]"


def plant_payload_only(folder, marker) -> None:
    """A step folder whose `.metadata` is nothing but a payload."""
    with open(os.path.join(folder, ".metadata"), "wb") as fh:
        pickle.dump(_Payload(marker_expr(marker)), fh)


def plant_payload_then_metadata(folder, marker) -> None:
    """A real step folder whose `.metadata` runs a payload and then returns the real metadata,
    with its manifest re-hashed to match (a forgery the manifest cannot catch)."""
    path = os.path.join(folder, ".metadata")
    real = open(path, "rb").read()
    with open(path, "wb") as fh:
        pickle.dump(_Payload(marker_expr(marker, f"__import__('pickle').loads({real!r})")), fh)
    manifest_path = os.path.join(folder, integrity.MANIFEST)
    if os.path.exists(manifest_path):
        manifest = json.load(open(manifest_path))
        manifest["files"][".metadata"] = {
            "bytes": os.path.getsize(path),
            "blake2b": file_blake2b(path),
        }
        json.dump(manifest, open(manifest_path, "w"))


def test_the_payloads_do_run_under_plain_pickle(tmp_path):
    """The planted files are real attacks: DCP's own reader runs them (and the second still
    returns usable metadata)."""
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(4.0), "lr": 0.5}, checkpoint_id=str(folder), no_dist=True)
    plant_payload_then_metadata(folder, tmp_path / "marker")
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    assert (tmp_path / "marker").exists() and "w" in meta.state_dict_metadata


def test_safe_load_reads_a_real_checkpoint_and_refuses_payloads(tmp_path):
    import torch.distributed.checkpoint as dcp

    folder = str(tmp_path / "ckpt")
    saved = {
        "w": torch.arange(6.0).reshape(2, 3),
        "lr": 0.25,
        "name": "adamw",
        "betas": (0.9, 0.95),
    }
    dcp.save(saved, checkpoint_id=folder, no_dist=True)
    state = {"w": torch.zeros(2, 3), "lr": 0.0, "name": "", "betas": (0.0, 0.0)}
    safe_load.load(state, folder, no_dist=True)
    assert torch.equal(state["w"], saved["w"])
    assert (state["lr"], state["name"], tuple(state["betas"])) == (0.25, "adamw", (0.9, 0.95))

    marker = tmp_path / "marker"
    plant_payload_then_metadata(folder, marker)
    with pytest.raises(safe_load.UntrustedCheckpoint, match=r"\.metadata names builtins\.eval"):
        safe_load.read_metadata(folder)
    problem = integrity.check_share(folder, 0, "sizes", 0, 1)
    assert problem.startswith("untrusted: .metadata names builtins.eval"), problem
    plant_payload_only(folder, marker)
    with pytest.raises(safe_load.UntrustedCheckpoint, match="checkpoint.allow_pickle"):
        safe_load.load(state, folder, no_dist=True)
    assert not marker.exists()
    with pytest.raises(AttributeError):  # the opt-out is plain pickle: the payload runs
        safe_load.read_metadata(folder, allow_pickle=True)
    assert marker.exists()


def test_byte_entries_load_weights_only(tmp_path):
    """A byte entry (a Python value in the checkpoint) that would run code is refused."""
    import io

    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    marker = tmp_path / "marker"
    buf = io.BytesIO()
    torch.save(_Payload(marker_expr(marker, "1.0")), buf)
    buf.seek(0)
    planner = safe_load.SafeLoadPlanner(path="ckpt")
    planner.set_up_planner({"lr": 0.0}, None, True)
    item = ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex("lr"),
        dest_offsets=(),
        storage_index=MetadataIndex("lr"),
        storage_offsets=(),
        lengths=(),
    )
    with pytest.raises(safe_load.UntrustedCheckpoint, match="the entry lr"):
        planner.load_bytes(item, buf)
    assert not marker.exists()


@pytest.fixture(scope="module")
def doctored(tmp_path_factory):
    """A 2-rank run with checkpoints at steps 2 and 4; then step-4 doctored (payload, then the
    real metadata, forged manifest) and a payload-only step-6 planted beside them."""
    root = tmp_path_factory.mktemp("untrusted")
    run = root / "run"
    run_train(
        run,
        *BASE_FP32,
        "--training.steps",
        "4",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
    )
    ckpt = run / "checkpoint"
    shutil.copytree(ckpt / "step-4", root / "clean-step-4")
    plant_payload_then_metadata(ckpt / "step-4", root / "marker")
    (ckpt / "step-6").mkdir()
    shutil.copy(ckpt / "step-2" / "__0_0.distcp", ckpt / "step-6")
    plant_payload_only(ckpt / "step-6", root / "marker")
    return root


def test_resume_skips_doctored_checkpoints(doctored):
    run = doctored / "run"
    proc = run_train(
        run,
        *BASE_FP32,
        "--training.steps",
        "6",
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "0",
    )
    assert not (doctored / "marker").exists()
    assert "resuming from the newest intact one, step-2" in proc.stdout, proc.stdout
    assert "untrusted: .metadata names builtins.eval" in proc.stdout
    assert max(losses(run)) == 6


def test_initial_load_generate_and_convert_refuse_doctored_folders(doctored):
    bad = doctored / "bad-step-4"  # a resume may have replaced the run's own step-4
    shutil.copytree(doctored / "clean-step-4", bad)
    plant_payload_then_metadata(bad, doctored / "marker")
    proc = run_train(
        doctored / "fresh",
        *BASE_FP32,
        "--training.steps",
        "1",
        "--checkpoint.initial_load_path",
        str(bad),
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    lines = [x for x in proc.stderr.splitlines() if "checkpoint error:" in x]
    assert len(lines) == 1 and "builtins.eval" in lines[0] and "allow_pickle" in lines[0], (
        proc.stderr
    )
    python, env = fork_python()
    config = str(doctored / "run" / "config.toml")
    for cmd in (
        ["trainer.generate", "--checkpoint", str(bad), "--config", config],
        ["trainer.convert", "to-hf", str(bad), str(doctored / "hf"), "--config", config],
    ):
        p = subprocess.run(
            [python, "-m", *cmd], cwd=REPO, env=env, text=True, capture_output=True, timeout=120
        )
        assert p.returncode == 2, (cmd, p.stderr)
        assert p.stderr.strip().count("\n") == 0 and "builtins.eval" in p.stderr, p.stderr
    assert not (doctored / "marker").exists()
