"""Activation checkpointing and torch.compile: they change how, never what, the model computes."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import BASE_FP32, losses, run_train
from trainer.models.build import build_model
from trainer.models.flavors import model_args
from trainer.parallel.parallelize import apply_ac


def count_block_forwards(mode: str, option: str = "2") -> int:
    """Forward executions of the blocks' attention in one forward+backward (recompute included)."""
    model = build_model(model_args("debugmodel", max_seq_len=16))
    model.to_empty(device="cpu")
    model.init_weights(0)
    if mode != "none":
        apply_ac(model, mode, option)
    calls = []
    for block in model.layers.values():
        block.attention.wq.register_forward_hook(lambda *_: calls.append(1))
    tokens = torch.randint(0, 8192, (2, 16))
    logits = model(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    return len(calls)


@pytest.mark.parametrize(
    "mode, option, expected",
    [
        ("none", "2", 6),
        ("full", "2", 12),
        ("selective", "2", 9),
        ("selective", "3", 8),
        ("selective", "op", 12),
    ],
)
def test_ac_recomputes_the_chosen_blocks(mode, option, expected):
    # 6 blocks: full recomputes all, every-2nd recomputes 3, every-3rd 2; op-level reruns every
    # block's forward but replays the saved matmul outputs instead of recomputing them.
    assert count_block_forwards(mode, option) == expected


def test_ac_and_compile_train_to_the_same_losses(tmp_path):
    common = [*BASE_FP32, "--training.steps", "3", "--checkpoint.enable", "false"]
    variants = {
        "plain": [],
        "ac_full": ["--activation_checkpoint.mode", "full"],
        "ac_every_2nd": ["--activation_checkpoint.mode", "selective"],
        "compile_ac_op": [
            "--compile.enable",
            "true",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ],
        "compile_autotune": [
            "--compile.enable",
            "true",
            "--compile.mode",
            "max-autotune-no-cudagraphs",
        ],
    }
    for name, extra in variants.items():
        run_train(tmp_path / name, *common, *extra, nproc=1, timeout=600)
    ref = losses(tmp_path / "plain")
    assert sorted(ref) == [1, 2, 3]
    for name in variants:
        got = losses(tmp_path / name)
        for step in ref:
            assert got[step] == pytest.approx(ref[step], rel=1e-5, abs=0), (name, step)
