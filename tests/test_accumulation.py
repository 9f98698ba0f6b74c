"""Gradient accumulation and mixed precision, on the real FSDP2/HSDP stack (4 gloo ranks).

The probe script runs one optimizer step of the trainer's own pieces per case and records FSDP's
collectives per microbatch, so these tests see what is communicated, not just the result. All
cases run in one torchrun launch (one process group, a fresh model per case).
"""

import json

import pytest
import torch

from tests.helpers import REPO, SYNTHETIC, probe_cases_argv, torchrun

PROBE = REPO / "tests/scripts/accum_probe.py"
HSDP = [
    "--parallelism.data_parallel_replicate_degree",
    "2",
    *SYNTHETIC,
    "--model.flavor",
    "debugmodel-tiny",
    "--training.seq_len",
    "32",
    "--training.global_batch_size",
    "16",
]
# Adam's first update is ~lr * sign(g): an eps above the rounding noise of near-zero gradients
# keeps the parameter comparison meaningful (the gradients are compared directly too).
FP32 = ["--training.mixed_precision_param", "float32", "--optimizer.eps", "1e-4"]
MODES = ["last", "every", "hsdp_reduce_scatter"]
CASES = {
    "one": [*FP32, "--training.local_batch_size", "4"],
    **{
        mode: [
            *FP32,
            "--training.local_batch_size",
            "1",
            "--training.gradient_accumulation_sync",
            mode,
        ]
        for mode in MODES
    },
    "bf16": [
        "--training.local_batch_size",
        "2",
        "--training.mixed_precision_param",
        "bfloat16",
        "--training.mixed_precision_reduce",
        "float32",
    ],
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{case: (probe info with its grads, full parameters after the step)}."""
    out = tmp_path_factory.mktemp("accum")
    argv = probe_cases_argv(CASES, *HSDP)
    torchrun(PROBE, str(out), *argv, nproc=4, fork=True)
    result = {}
    for name in CASES:
        info = json.loads((out / name / "probe.json").read_text())
        info["grads"] = torch.load(out / name / "grads.pt")
        result[name] = info, torch.load(out / name / "params.pt")
    return result


def kinds(calls):
    return sorted({name for name, _ in calls})


@pytest.mark.parametrize("mode", MODES)
def test_four_microbatches_equal_one_big_batch(probes, mode):
    info_one, params_one = probes["one"]
    assert info_one["accum"] == 1
    info, params = probes[mode]
    assert info["accum"] == 4
    assert params.keys() == params_one.keys()
    for name, grad in info["grads"].items():
        torch.testing.assert_close(
            grad,
            info_one["grads"][name],
            rtol=1e-4,
            atol=1e-7,
            msg=f"{mode}: grad of {name} differs",
        )
    for name in params:
        torch.testing.assert_close(
            params[name], params_one[name], rtol=1e-5, atol=1e-6, msg=f"{mode}: {name} differs"
        )
    micro, last = info["per_micro"][:-1], info["per_micro"][-1]
    assert any(n.startswith("reduce_scatter") for n in kinds(last))
    if mode == "last":  # nothing is communicated until the last microbatch
        assert all(calls == [] for calls in micro), micro
        assert info["grads_present"] == [False, False, False, True]
    elif mode == "every":  # reduce-scatter and the cross-replica all-reduce every time
        for calls in micro:
            assert "all_reduce" in kinds(calls)
            assert any(n.startswith("reduce_scatter") for n in kinds(calls))
        assert all(info["grads_present"])
    else:  # reduce-scatter every time, all-reduce across replicas only on the last
        for calls in micro:
            assert kinds(calls) and "all_reduce" not in kinds(calls)
        assert "all_reduce" in kinds(last)


def test_bf16_compute_with_fp32_reduction(probes):
    info, params = probes["bf16"]
    assert info["forward_dtypes"] == ["torch.bfloat16"]  # unsharded compute params
    reduce_dtypes = {d for calls in info["per_micro"] for _, d in calls}
    assert reduce_dtypes == {"torch.float32"}  # gradient reduction
    assert info["grad_dtypes"] == ["torch.float32"]  # sharded master grads
    assert all(p.dtype == torch.float32 for p in params.values())  # sharded master params
