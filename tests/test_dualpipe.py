"""DualPipeV's overlapped forward/backward (trainer/parallel/dualpipe.py, lanes.py): what the
layout allows, a gloo probe that sees a backward's collectives in flight while another
microbatch's forward computes, and real training runs that equal the same schedule without the
overlap and one rank."""

import json
from types import SimpleNamespace

import pytest

from tests.helpers import REPO, SYNTHETIC
from trainer.parallel.pipeline import _SAME_RANK_STAGES

# DualPipeV is a V schedule: torch 2.11 cannot run those over gloo (check_torch refuses them in
# one line there; the GPU machines' torch runs them on nccl), so its launches need torch >= 2.12.
needs_v_on_gloo = pytest.mark.skipif(
    not _SAME_RANK_STAGES,
    reason="V schedules over gloo need torch >= 2.12 (this torch: "
    "trainer/parallel/pipeline.py check_torch refuses them)",
)

PROBE = REPO / "tests" / "scripts" / "dualpipe_probe.py"


def _cfg(**par):
    base = dict(
        pipeline_parallel_overlap=True,
        tensor_parallel_degree=1,
        context_parallel_degree=1,
        expert_parallel_degree=1,
    )
    return SimpleNamespace(parallelism=SimpleNamespace(**{**base, **par}))


def test_the_layout_decides_the_overlap_in_one_line():
    """Overlapped where the stages' collectives have lanes; else forward then backward, with
    the reason on the startup line (the same on every rank: from the config and the code)."""
    from trainer.parallel.dualpipe import plan_overlap

    class Runtime:  # torch >= 2.9's _PipelineScheduleRuntime has it
        def register_custom_function(self, kind, fn):
            pass

    on, line = plan_overlap(_cfg(expert_parallel_degree=2), Runtime())
    assert on and "DualPipeV overlaps the ep all-to-alls" in line
    assert plan_overlap(_cfg(), Runtime())[0]  # dense: forward beside backward
    for par, needle in (
        (dict(tensor_parallel_degree=2), "under tp 2 have no backward lane"),
        (dict(context_parallel_degree=2, tensor_parallel_degree=2), "under tp 2, cp 2 have no"),
        (dict(pipeline_parallel_overlap=False), "(parallelism.pipeline_parallel_overlap = false)"),
    ):
        on, line = plan_overlap(_cfg(**par), Runtime())
        assert not on and "run forward then backward" in line and needle in line, line
    on, line = plan_overlap(_cfg(), object())
    assert not on and "cannot register an OVERLAP_F_B function" in line
    on, line = plan_overlap(_cfg(expert_parallel_degree=2), Runtime(), device_type="cuda")
    assert not on and "run forward then backward on CUDA" in line


@pytest.fixture(scope="module")
def probe():
    from tests.helpers import torchrun

    out = torchrun(PROBE, nproc=4, fork=True).stdout
    results = [
        json.loads(line[len("result ") :])
        for line in out.splitlines()
        if line.startswith("result ")
    ]
    assert len(results) == 4, out
    return results


@needs_v_on_gloo
def test_overlap_equals_the_schedule_run_one_action_after_the_other(probe):
    """Bitwise the same losses (6 on the pp rank with the last stage) and weight gradients."""
    for r in probe:
        assert r["equal"], r
        assert r["n_losses"] == (6 if r["pp_rank"] == 0 else 0)
        assert r["grad_norm"] > 0


@needs_v_on_gloo
def test_a_backward_collective_is_in_flight_while_a_forward_computes(probe):
    """On every rank a backward collective (other thread, twin group) was in flight while a
    forward matmul ran; run one action after the other, never. The probe's handshake pins
    the two threads' order, so a descheduled thread on a loaded machine cannot read as no
    overlap; a pair run one after the other cannot complete it (a planted join right after
    the backward thread's start fails this test)."""
    for r in probe:
        assert r["in_flight_s"]["sequential"] == 0, r
        assert r["in_flight_s"]["overlap"] > 0, r
        # the forward lane keeps the ep group, the backward lane its twin
        assert r["groups"]["overlap"] == {"forward": ["own"], "backward": ["twin"]}, r
        assert r["groups"]["sequential"] == {"forward": ["own"]}, r


# ------------------------------------------------------------------ training runs (torchrun)

PP_EP = (
    "--parallelism.pipeline_parallel_degree",
    "2",
    "--parallelism.expert_parallel_degree",
    "2",
    "--parallelism.pipeline_parallel_schedule",
    "DualPipeV",
    # stages [embedding, layer 0] [1] [2] [3, head]: MoE layers on both pp ranks
    "--parallelism.pipeline_parallel_split_points",
    "layers.1,layers.2,layers.3",
)
COMMON = (
    "--model.flavor",
    "debugmodel-moe-narrow",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "4",
    "--training.global_batch_size",
    "8",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.min_lr_factor",
    "1.0",
    *SYNTHETIC,
    "--training.steps",
    "3",
    "--checkpoint.enable",
    "false",  # read through TensorBoard: no final save (~1 s each)
    "--moe.aux_loss_weight",
    "0",
    "--moe.router_z_loss_weight",
    "0",
)  # pp: none


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.helpers import run_train

    root = tmp_path_factory.mktemp("dualpipe")
    logs = {}
    for name, nproc, extra in (
        ("ref", 1, ()),
        ("sequential", 4, (*PP_EP, "--parallelism.pipeline_parallel_overlap", "false")),
        ("overlap", 4, PP_EP),
    ):
        proc = run_train(root / name, *COMMON, *extra, nproc=nproc)
        logs[name] = proc.stdout + proc.stderr
    return root, logs


@needs_v_on_gloo
def test_dualpipe_with_ep_overlapped_trains_as_without_and_as_one_rank(runs):
    """PP 2 x EP 2 on 4 ranks, DualPipeV with its overlapped actions on two threads (the ep
    all-to-alls of the backward on twin groups): the losses and gradient norms of the same
    schedule run one action after the other, and of one rank, within 1e-4."""
    from tests.helpers import scalars

    root, logs = runs
    assert "DualPipeV overlaps the ep all-to-alls" in logs["overlap"], logs["overlap"][-3000:]
    assert "parallelism.pipeline_parallel_overlap = false" in logs["sequential"]
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        ref, seq, over = (scalars(root / name, tag) for name in ("ref", "sequential", "overlap"))
        assert sorted(over) == [1, 2, 3], (tag, over)
        for s in ref:
            assert abs(over[s] - seq[s]) <= 1e-4 * max(1.0, abs(seq[s])), (tag, s, over, seq)
            assert abs(over[s] - ref[s]) <= 1e-4 * max(1.0, abs(ref[s])), (tag, s, over, ref)
