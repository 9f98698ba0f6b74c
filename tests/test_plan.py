"""The memory plan against memory actually allocated on CPU.

Resident figures (parameters, gradients, AdamW state) must equal, byte for byte, the sharded
tensors of real FSDP and HSDP ranks built by the trainer's own `parallelize`. Activations and
the step's peak are checked against torch's MemTracker / FSDPMemTracker, which count every
tensor the allocator holds (CPU peak RSS is useless for this: glibc keeps freed memory and
the interpreter's own allocations swamp a small model's). The tracker sees tensors, so this
checks the plan's arithmetic; the CUDA allocator's overheads (context, fragmentation: the
plan's reserve) can only be checked on a GPU, with benchmarks/training/bench_train.py.
"""

import json
import re

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO, probe_cases_argv, torchrun
from trainer.config.job import load_config
from trainer.models.args import ModelArgs
from trainer.models.build import build_model
from trainer.parallel.parallelize import apply_ac
from trainer.plan.activations import head_saved
from trainer.plan.comm import comm_volume
from trainer.plan.memory import (
    FP32,
    GIB,
    GPUS,
    accumulation_sync_note,
    block_split,
    blocks_activations,
    device_need,
    fsdp_groups,
    loss_region,
    memory_plan,
    plan_args,
    shard_numel,
    split_bytes,
)
from trainer.plan.report import main

PROBE = REPO / "tests" / "scripts" / "plan_probe.py"
# Vocab 8195 is odd: the embedding and output rows split 2049 x 3 / 2048 over 4 shards, so the
# uneven-shard rule (rank 0 holds ceil(rows / shard), FSDP2 pads the others) is exercised.
# bf16 compute, as on the GPUs the plan is for ("auto" would be float32 on some CPUs).
SMALL = [
    "--data.dataset",
    "synthetic",
    "--model.vocab_size",
    "8195",
    "--training.mixed_precision_param",
    "bfloat16",
    "--training.global_batch_size",
    "-1",
    "--training.local_batch_size",
    "2",
]


NPROC = 4
CASES = {
    "fsdp": ["--training.seq_len", "64", "--training.loss", "eager"],
    # The chunked loss (the default), 128 tokens in chunks of 48, 48 and 32.
    "hsdp": [
        "--training.seq_len",
        "64",
        "--training.loss_chunk_size",
        "48",
        "--parallelism.data_parallel_replicate_degree",
        "2",
    ],
}


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """{case: (plan, [per-rank measurements])}: both cases in one 4-rank launch."""
    out = tmp_path_factory.mktemp("plan")
    argv = probe_cases_argv(CASES, *SMALL)
    torchrun(PROBE, str(out), *argv, nproc=NPROC, timeout=240, fork=True)
    result = {}
    for name, overrides in CASES.items():
        ranks = [json.loads((out / name / f"rank{r}.json").read_text()) for r in range(NPROC)]
        result[name] = memory_plan(load_config([*SMALL, *overrides]), NPROC), ranks
    return result


def check_resident(plan: dict, ranks: list[dict]) -> None:
    """Rank 0 holds exactly the plan; other ranks' shards are at most that, and FSDP2 pads the
    storage of parameters and gradients to rank 0's size (AdamW's states are not padded)."""
    r0 = ranks[0]
    for key, name in (
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer", "optimizer_state"),
    ):
        assert r0[key]["local"] == plan[name], key
        assert r0[key]["storage"] == plan[name], key
        for r in ranks[1:]:
            assert r[key]["local"] <= plan[name], key
    for r in ranks:
        assert r["params"]["storage"] == r["grads"]["storage"] == plan["parameters"]


def check_peak(plan: dict, ranks: list[dict]) -> None:
    """The planned peak is within [-1%, +10%] of the tracked peak of the second step (when
    AdamW's state exists). The plan errs high on purpose: it counts a reduce-scatter in flight
    that CPU's synchronous gloo never has."""
    for r in ranks:
        measured = r["tracker"]["step_peak"]["Total"]
        assert 0.99 * measured <= plan["total"] <= 1.10 * measured, (plan["total"], measured)


def test_fsdp_four_ranks(probes):
    plan, ranks = probes["fsdp"]
    assert ranks[-1]["params"]["local"] < plan["parameters"]  # the uneven shard is shorter
    check_resident(plan, ranks)
    check_peak(plan, ranks)


def test_hsdp_two_by_two(probes):
    plan, ranks = probes["hsdp"]
    check_resident(plan, ranks)
    check_peak(plan, ranks)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize(
    "mode, option, matmuls",
    [
        ("none", "2", "all"),
        ("full", "2", "all"),
        ("selective", "2", "all"),
        ("selective", "3", "all"),
        ("selective", "op", "all"),
        ("selective", "op", "every_other"),
    ],
)
def test_activations_match_saved_tensors(mode, option, matmuls, dtype):
    """What forward leaves alive for backward (the plan's activations, plus the logits and
    the fp32 log-probabilities train.py's loss keeps), measured within 0.5%. A small GQA
    model with 3 blocks keeps it fast; the formulas are per shape, not per flavor."""
    from torch.distributed._tools.mem_tracker import MemTracker

    args = ModelArgs(
        dim=64, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=512, multiple_of=32, max_seq_len=64
    )
    batch, tokens = 2, 2 * args.max_seq_len
    cfg = load_config(
        [
            "--activation_checkpoint.mode",
            mode,
            "--activation_checkpoint.selective_ac_option",
            option,
            "--activation_checkpoint.selective_op_matmuls",
            matmuls,
        ]
    )
    p = torch.finfo(getattr(torch, dtype)).bits // 8
    model = build_model(args)
    model.to_empty(device="cpu")
    if mode != "none":
        apply_ac(model, mode, option, matmuls)
    for param in model.parameters():  # what FSDP's mixed precision computes with
        param.data = param.data.to(getattr(torch, dtype)).normal_(0, 0.02)
    inputs = torch.randint(0, args.vocab_size, (batch, args.max_seq_len))
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), inputs.flatten())
        snap = tracker.get_tracker_snapshot("current")[torch.device("cpu")]
    assert loss.grad_fn is not None  # the graph, and what it saved, was alive when measured
    measured = next(v for k, v in snap.items() if getattr(k, "value", "") == "Activation")
    expected = (
        blocks_activations(cfg, args, p, tokens)
        + head_saved(args, p) * tokens
        + (p + 4) * args.vocab_size * tokens
    )
    assert abs(expected / measured - 1) < 0.005, (expected, measured)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["--config", str(REPO / "configs" / "debug_model.toml"), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_verdicts(capsys):
    code, out, _ = run_cli(capsys, "--ngpu", "2")
    assert code == 0 and "verdict: FITS" in out and "tokens/s per device" in out
    assert "from [data] vocab_size of the stdlib tokenizer" in out
    code, out, _ = run_cli(
        capsys,
        "--ngpu",
        "1",
        "--model.flavor",
        "70B",
        "--data.dataset",
        "synthetic",
        "--model.vocab_size",
        "128256",
        "--training.global_batch_size",
        "-1",
    )
    assert code == 0 and "verdict: DOES NOT FIT" in out and "from [model] vocab_size" in out


def test_cli_config_errors_are_one_line(capsys):
    code, out, err = run_cli(capsys, "--ngpu", "2", "--training.seq_lenx", "3")
    assert code == 2 and err.strip().count("\n") == 0
    assert err.startswith("config error: unknown key 'training.seq_lenx'")
    code, _, err = run_cli(
        capsys,
        "--ngpu",
        "3",  # global batch 8 does not split 3 ways
        "--training.global_batch_size",
        "8",
    )
    assert code == 2 and err.startswith("config error: training.global_batch_size")
    # the plan's own flags: out of range (0 GiB was taken as "not given"), or argparse's
    for flags, line in (
        (["--gpu-mem-gib", "0"], "--gpu-mem-gib = 0 is out of range"),
        (["--mfu", "2"], "--mfu = 2 is out of range: it must be > 0 and <= 1"),
        (["--host-gib", "-1"], "--host-gib = -1 is out of range"),
        (["--gpu", "v100"], "python -m trainer.plan: argument --gpu: invalid"),
    ):
        try:
            code, _, err = run_cli(capsys, "--ngpu", "2", *flags)
        except SystemExit as e:  # argparse's error, one line
            code, err = e.code, capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith(f"config error: {line}")


def test_hsdp_shards_over_dp_shard_only():
    """HSDP replicates over dp_replicate: per-device bytes depend only on the shard degree."""
    base = ["--data.dataset", "synthetic", "--training.global_batch_size", "-1"]
    fsdp = memory_plan(load_config(base), 4)
    hsdp = memory_plan(load_config([*base, "--parallelism.data_parallel_replicate_degree", "2"]), 8)
    assert hsdp["parameters"] == fsdp["parameters"] and hsdp["total"] == fsdp["total"]


# --------------------------------------------------------------------------- tensor parallel
# Pure arithmetic on the plan (no ranks): the TP runtime is checked by its own tests.


BASE_8B = [
    "--job.config_file",
    str(REPO / "configs" / "llama3_8b.toml"),
    "--training.global_batch_size",
    "-1",
]
TP = "--parallelism.tensor_parallel_degree"


def test_tp_shards_matmul_weights_by_tp():
    """Per rank, TP 8 x dp_shard 8 holds 1/8 of FSDP-only-over-8's matmul weights, embedding
    and head, exactly; the RMSNorm weights (replicated over tp) are the same."""
    cfg = load_config(BASE_8B)
    a = plan_args(cfg, cfg.model.vocab_size)
    for key, shapes in fsdp_groups(a, 1).items():
        for full, part in zip(shapes, fsdp_groups(a, 8)[key], strict=True):
            ratio = 1 if len(full) == 1 else 8
            assert shard_numel(full, 8) == ratio * shard_numel(part, 8), (key, full, part)
    fsdp = memory_plan(cfg, 8)["parameters"]
    tp = memory_plan(load_config([*BASE_8B, TP, "8"]), 64)["parameters"]
    norms = FP32 * (2 * a.n_layers + 1) * (a.dim // 8)
    assert tp - norms == (fsdp - norms) // 8
    # ... and about what FSDP alone over all 64 ranks holds (it differs only by the norms).
    assert abs(tp / memory_plan(cfg, 64)["parameters"] - 1) < 0.001


def test_sp_activations_by_hand():
    """Sequence parallel: under full AC the blocks keep their sequence-sharded inputs, 1/tp;
    without AC the norms shrink by tp, the gathered inputs of wq/wk/wv and w1/w3 (2 p dim per
    token) do not, and all attention and FFN tensors shrink by tp."""
    cfg = load_config([*BASE_8B, "--activation_checkpoint.mode", "full"])
    a, p, tokens = plan_args(cfg, 128256), 2, 8192
    assert blocks_activations(cfg, a, p, tokens, tp=4) * 4 == blocks_activations(cfg, a, p, tokens)
    sp1, whole1 = block_split(a, p)
    sp4, whole4 = block_split(a, p, 4)
    assert sp4 == sp1 == 2 * (4 + p) * a.dim
    assert whole4 - 2 * p * a.dim == (whole1 - 2 * p * a.dim) // 4
    assert split_bytes((sp4, whole4), tokens, 4) == sp4 * tokens // 4 + whole4 * tokens
    # The 8B shape without AC: 5.1x less per rank at TP 8 (not 8x: the gathered inputs).
    none = [*BASE_8B, "--activation_checkpoint.mode", "none"]
    ratio = (
        memory_plan(load_config(none), 8)["activations"]
        / memory_plan(load_config([*none, TP, "8"]), 64)["activations"]
    )
    assert 5.0 < ratio < 5.2, ratio


@pytest.mark.parametrize("loss", ["eager", "chunked"])
def test_loss_parallel_logits_are_one_tp_th(loss):
    """Loss parallel: every rank's logits (eager) or chunk and fp32 dW (chunked) cover 1/tp of
    the vocab; disable_loss_parallel holds the full vocab plus the all-gathered head weight."""
    cfg = load_config([*BASE_8B, "--training.loss", loss])
    a, p, tokens = plan_args(cfg, 128256), 2, 8192
    gathered = loss_region(cfg, a, p, tokens, 8, loss_parallel=False)
    full = loss_region(cfg, a, p, tokens)
    parallel = loss_region(cfg, a, p, tokens, 8)
    assert gathered["at_loss"] == full["at_loss"] + p * a.vocab_size * a.dim
    dh = 0 if loss == "eager" else p * tokens * a.dim  # the head input's gradient: all tokens
    assert parallel["at_loss"] - dh == (full["at_loss"] - dh) // 8


def test_comm_is_zero_on_unused_dims():
    fsdp = comm_volume(load_config(BASE_8B), 8)
    assert fsdp["comm_tp"] == 0 and fsdp["comm_dp_replicate"] == 0 and fsdp["comm_dp_shard"] > 0
    tp_only = comm_volume(load_config([*BASE_8B, TP, "8"]), 8)  # dp_shard = 1
    assert tp_only["comm_dp_shard"] == 0 and tp_only["comm_tp"] > 0


def test_tp_volume_by_hand():
    """A 2-layer, dim-64 model, tp 2, 2 x 32 tokens, no AC, bf16: X = 2 bytes x 64 tokens x
    64 = 8192 bytes; each rank sends half of it in each of 8 per layer + 4 (embedding, head)
    collectives; loss parallel all-reduces 3 fp32 per token; the 5 norm weights' gradients
    are all-reduced."""
    cfg = load_config(
        [
            *SMALL,
            "--model.flavor",
            "debugmodel-tiny",
            "--model.vocab_size",
            "8192",
            "--training.seq_len",
            "32",
            "--activation_checkpoint.mode",
            "none",
            TP,
            "2",
        ]
    )
    c = comm_volume(cfg, 2)
    acts = (8 * 2 + 4) * 0.5 * 8192
    loss = 3 * 2 * 0.5 * 4 * 64
    norms = 2 * 0.5 * 2 * 5 * 64
    assert c["comm_tp"] == acts + loss + norms == 83328
    assert c["comm_dp_shard"] == 0 == c["comm_dp_replicate"]
    # Full AC replays each block's 4 forward collectives in backward.
    full = comm_volume(
        load_config(
            [
                *SMALL,
                "--model.flavor",
                "debugmodel-tiny",
                "--model.vocab_size",
                "8192",
                "--training.seq_len",
                "32",
                "--activation_checkpoint.mode",
                "full",
                TP,
                "2",
            ]
        ),
        2,
    )
    assert full["comm_tp"] - c["comm_tp"] == 2 * 4 * 0.5 * 8192


def test_fsdp_volume_by_hand():
    """FSDP over 4 and HSDP 2 x 2 of the same model, one microbatch, reshard 'default', bf16
    params and fp32 reduce: forward gathers all groups, backward all but the head, one
    reduce-scatter; HSDP all-reduces the fp32 gradient shard across the 2 replicas."""
    cfg = load_config(
        [
            *SMALL,
            "--model.flavor",
            "debugmodel-tiny",
            "--training.mixed_precision_reduce",
            "float32",
        ]
    )
    a = plan_args(cfg, 8195)
    groups = fsdp_groups(a)
    g = {k: sum(4 * shard_numel(s, 4) for s in v) for k, v in groups.items()}  # gathered
    total = sum(g.values())
    expected = 0.75 * (2 * total + 2 * (total - g["head"])) + 0.75 * 4 * total
    assert comm_volume(cfg, 4)["comm_dp_shard"] == pytest.approx(expected)
    hsdp = load_config(
        [
            *SMALL,
            "--model.flavor",
            "debugmodel-tiny",
            "--training.mixed_precision_reduce",
            "float32",
            "--parallelism.data_parallel_replicate_degree",
            "2",
        ]
    )
    shard = sum(shard_numel(s, 2) for v in groups.values() for s in v)
    assert comm_volume(hsdp, 4)["comm_dp_replicate"] == 2 * 0.5 * 4 * shard


def test_70b_config_tp8_fits_and_fsdp_only():
    """configs/llama3_70b.toml on 64 H100s (TP 8 x FSDP 8, 1 x 8192 tokens per GPU) fits
    80 GiB. FSDP alone over 64 with the same tokens per GPU fits as well (the numbers say so:
    ~47 vs ~39 GiB, with the sharded gradients held across the microbatches) but sends ~9x more over
    dp_shard, which crosses nodes; on 16 GPUs neither FSDP alone nor TP 2 x FSDP 8 fits (16 bytes of
    state per parameter: 70 GB per GPU), on 32 TP 2 x FSDP 16 does."""
    cfg70 = ["--job.config_file", str(REPO / "configs" / "llama3_70b.toml")]
    h100 = GPUS["h100"].memory_gib * GIB
    tp8 = load_config(cfg70)
    assert tp8.parallelism.tensor_parallel_degree == 8
    tp_need = device_need(memory_plan(tp8, 64)["total"])
    assert tp_need <= h100 and 35 * GIB < tp_need < 40 * GIB
    fsdp = load_config([*cfg70, TP, "1", "--training.local_batch_size", "1"])
    fsdp_need = device_need(memory_plan(fsdp, 64)["total"])
    assert tp_need < fsdp_need <= h100 and 44 * GIB < fsdp_need < 49 * GIB
    ratio = comm_volume(fsdp, 64)["comm_dp_shard"] / comm_volume(tp8, 64)["comm_dp_shard"]
    assert 8.5 < ratio < 9.5, ratio
    assert device_need(memory_plan(fsdp, 16)["total"]) > h100
    tp2 = load_config([*cfg70, TP, "2", "--training.local_batch_size", "2"])
    assert device_need(memory_plan(tp2, 16)["total"]) > h100  # 70 GB of sharded state alone
    assert device_need(memory_plan(tp2, 32)["total"]) <= h100


def test_cli_reports_tp_comm_and_per_device_throughput(capsys):
    """The report names the TP mesh, prints the three volumes, and keeps tokens/s per device:
    at the same tokens per GPU, TP 8 and FSDP alone need the same time per step."""
    cfg70 = [
        "--config",
        str(REPO / "configs" / "llama3_70b.toml"),
        "--ngpu",
        "8",
        "--nnodes",
        "8",
        "--host-gib",
        "2048",
    ]
    assert main(cfg70) == 0
    tp8 = capsys.readouterr().out
    assert "x TP 8 (sequence parallel, loss parallel)" in tp8 and "verdict: FITS" in tp8
    assert "tp (sequence-parallel activations" in tp8 and "dp_replicate (HSDP" in tp8
    assert "per dp rank of 8 devices" in tp8
    assert main([*cfg70, TP, "1", "--training.local_batch_size", "1"]) == 0
    fsdp = capsys.readouterr().out
    step = [re.search(r"([\d.]+) s per optimizer step", out).group(1) for out in (tp8, fsdp)]
    assert step[0] == step[1] == "79.7"


def test_accumulation_sync_last_warns_where_every_fits(capsys):
    """8B on 8 H100s, 16 microbatches: 'last' holds the unsharded fp32 gradients (29.9 GiB)
    and does not fit where 'every' does: one warning line from the plan (and from run_train.sh's
    check on GPU nodes); none for 'every' or a single microbatch."""
    cfg8b = ["--job.config_file", str(REPO / "configs" / "llama3_8b.toml")]
    last = load_config([*cfg8b, "--training.gradient_accumulation_sync", "last"])
    note = accumulation_sync_note(last, 8, GPUS["h100"].memory_gib)
    assert note.startswith(
        "warning: training.gradient_accumulation_sync = 'last' holds 29.9 "
        "GiB of unsharded gradients across 16 microbatches"
    ), note
    assert accumulation_sync_note(load_config(cfg8b), 8, GPUS["h100"].memory_gib) is None
    one = load_config(
        [
            *cfg8b,
            "--training.gradient_accumulation_sync",
            "last",
            "--training.global_batch_size",
            "8",
        ]
    )
    assert accumulation_sync_note(one, 8, GPUS["h100"].memory_gib) is None
    code = main(
        [
            "--config",
            str(REPO / "configs" / "llama3_8b.toml"),
            "--ngpu",
            "8",
            "--host-gib",
            "2048",
            "--training.gradient_accumulation_sync",
            "last",
        ]
    )
    assert code == 0 and note in capsys.readouterr().out
