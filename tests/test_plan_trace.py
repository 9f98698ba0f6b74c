"""The traced dry run (trainer/plan/trace.py): the real step at the real shapes on fake
tensors and a fake process group, in this process."""

import math
import subprocess

import pytest
import torch

from tests.helpers import REPO, fork_python
from trainer.config.job import load_config
from trainer.plan.memory import memory_plan
from trainer.plan.trace import trace_scoring, trace_step

VOCAB = 128256  # the 8B flavor's


def logits_like(allocations, vocab: int, chunk: int):
    """Allocations with the vocabulary as their last dim for more than one chunk of tokens
    (weights and their gradients are [vocab, dim]: the vocabulary first)."""
    return [
        a
        for a in allocations
        if a.shape and a.shape[-1] == vocab and math.prod(a.shape[:-1]) > chunk
    ]


def test_8b_validation_and_eval_score_a_chunk_at_a_time_below_trainings_peak():
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "llama3_8b.toml"),
            "--validation.local_batch_size",
            "8",
            "--eval.local_batch_size",
            "8",
        ]
    )
    chunk = cfg.training.loss_chunk_size
    train = trace_step(cfg, 8, keep_all=True)
    assert logits_like(train.allocations, VOCAB, chunk) == []
    states = train.categories["optimizer_state"]
    for kind in ("validation", "eval"):
        r = trace_scoring(cfg, 8, kind)
        # 8 x 8192 tokens scored; the logits exist one chunk of tokens at a time
        assert any(a.shape == (chunk, VOCAB) for a in r.allocations), kind
        assert logits_like(r.allocations, VOCAB, chunk) == [], kind
        assert r.peak + states <= train.peak, (kind, r.peak, states, train.peak)
    # the step's real shapes: the 8B plan and the trace agree within 10%
    plan = memory_plan(cfg, 8)["total"]
    assert abs(plan / train.peak - 1) <= 0.10, (plan, train.peak)
    # the sharded fp32 parameters, as the plan counts them (+ the RoPE tables: buffers)
    params = memory_plan(cfg, 8)["parameters"]
    assert params <= train.categories["parameters"] <= params * 1.01


def test_cli_trace_prints_the_trace_beside_the_plan():
    import json

    python, env = fork_python()
    out = subprocess.run(
        [
            python,
            "-m",
            "trainer.plan",
            "--config",
            str(REPO / "configs" / "debug_model.toml"),
            "--ngpu",
            "2",
            "--trace",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "traced dry run: one training step of rank 0 of 2 on fake tensors" in text
    assert "agreement: the plan is within 10% of the trace" in text, text
    assert "trace verdict: FITS" in text
    assert "work: rank 0 computes " in text
    # --json: the same report as one JSON object on stdout and nothing else, under PP too
    # (the traced ranks' forked processes log the pipeline's startup line: to stderr)
    out = subprocess.run(
        [
            python,
            "-m",
            "trainer.plan",
            "--config",
            str(REPO / "configs" / "debug_model.toml"),
            "--ngpu",
            "2",
            "--trace",
            "--json",
            "--parallelism.pipeline_parallel_degree",
            "2",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    saved = json.loads(out.stdout)
    assert "pipeline: 1F1B, 2 stages over pp 2" in out.stderr, out.stderr
    assert saved["world_size"] == 2 and saved["plan"]["peak_gib"] > 0
    assert set(saved["plan"]["comm_bytes"]) == {
        "tp",
        "cp",
        "dp_shard",
        "dp_replicate",
        "ep",
        "pp",
        "optimizer",
    }  # optimizer: Muon's
    assert saved["plan"]["comm_bytes"]["optimizer"] == 0  # AdamW sends nothing of its own
    assert saved["trace"]["peak_gib"] > 0 and saved["trace"]["comm_bytes"]["pp"] > 0
    # every pp rank traced (the two differ in shape); the head's rank is the busiest, by the
    # split's whole layers (the debug model's head weighs 2.4 layers), not by repeated work
    work = saved["trace"]["work"]
    assert [(r["pp_rank"], r["stands_for"]) for r in work["per_rank"]] == [(0, [0]), (1, [1])]
    assert work["busiest_pp_rank"] == 1
    assert saved["trace"]["flops_per_rank"] / saved["ideal_flops_per_rank"] == work["ratio"]
    assert 1.0 < work["kernel_factor"] < 1.05 and work["recompute_factor"] == 1.0
    assert 1.0 <= work["vs_expected"] <= 1.06, work


def test_a_host_sync_in_the_step_stops_the_trace_at_its_line(monkeypatch):
    """Fake tensors have no values: a step that reads one on the host (what a GPU would wait
    for) is named, with its line, instead of traced."""
    import torch

    from trainer import step
    from trainer.plan.trace import trace_lines

    original = step.TrainStep.optimizer_step

    def syncing(self, grad_norm, cross_entropy):
        if bool(torch.isfinite(grad_norm)):  # the host sync before PR 30's on-device skip
            pass
        return original(self, grad_norm, cross_entropy)

    monkeypatch.setattr(step.TrainStep, "optimizer_step", syncing)
    cfg = load_config(["--job.config_file", str(REPO / "configs" / "debug_model.toml")])
    lines = trace_lines(cfg, 2, {"total": 1}, 80.0, lambda peak: peak)
    assert lines[0].startswith(
        "traced dry run stopped: the step reads a device value on the "
        "host (a host sync, aten._local_scalar_dense.default) at "
    ), lines


def test_flex_attention_is_not_traced_on_a_cpu():
    """FlexAttention (block_causal on GPUs) only compiles for CUDA: the trace says so in one
    line instead of running it (its eager fallback on fake tensors crashes the process)."""
    from trainer.plan.trace import untraceable

    debug = ["--job.config_file", str(REPO / "configs" / "debug_model.toml")]
    assert untraceable(load_config(debug)) is None
    assert "FlexAttention" in untraceable(
        load_config([*debug, "--model.attn_mask_type", "block_causal"])
    )
    assert (
        untraceable(
            load_config(
                [
                    *debug,
                    "--model.attn_mask_type",
                    "block_causal",
                    "--model.attn_implementation",
                    "sdpa",
                ]
            )
        )
        is None
    )


def test_moe_with_ep_is_traced_at_qwen3_30b_a3b_shapes():
    """configs/qwen3_30b_a3b.toml (EP 8 x FSDP 8, 8 GPUs): the real MoE step runs on fake
    tensors (counts without bincount, all-to-all splits at perfect balance), fits an H100 and
    agrees with the plan; the routed copies (top 8 of each token) are there, and no
    [tokens, experts x hidden] buffer of all experts is."""
    cfg = load_config(["--job.config_file", str(REPO / "configs" / "qwen3_30b_a3b.toml")])
    r = trace_step(cfg, 8, keep_all=True)
    plan = memory_plan(cfg, 8)
    assert abs(plan["total"] / r.peak - 1) <= 0.10, (plan["total"], r.peak)
    assert r.peak < 70 * 2**30  # + the reserve: fits 79.6 GiB (README)
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    routed = [a for a in r.allocations if a.shape == (tokens * 8, 2048)]
    assert routed, "no routed-token buffers in the trace"
    assert not [a for a in r.allocations if a.shape and a.shape[-1] == 128 * 768]


def test_a_capacity_factor_is_traced_at_its_static_rows():
    """capacity 0.5 at EP 2: each MoE layer routes min(pairs, E x capacity) rows, a shape
    known before the data (no host sync); the dropless step routes every pair."""
    from trainer.plan.trace import untraceable

    moe = [
        "--job.config_file",
        str(REPO / "configs" / "debug_moe.toml"),
        "--parallelism.expert_parallel_degree",
        "2",
    ]
    capped = load_config([*moe, "--moe.capacity_factor", "0.5"])
    assert untraceable(capped) is None
    from trainer.plan.memory import plan_args, resolve_vocab

    args = plan_args(capped, resolve_vocab(capped)[0])
    pairs = capped.training.local_batch_size * capped.training.seq_len * args.moe.top_k
    shapes = [
        {a.shape for a in trace_step(cfg, 2, keep_all=True).allocations}
        for cfg in (load_config(moe), capped)
    ]
    for got, rows in zip(
        shapes, (pairs, pairs // 2), strict=True
    ):  # the experts' hidden activations
        assert (rows, args.moe.hidden_dim) in got and (
            pairs + pairs // 2 - rows,
            args.moe.hidden_dim,
        ) not in got
    assert (pairs, args.dim) in shapes[0] and (pairs, args.dim) not in shapes[1]  # routed


def test_the_work_line_sets_each_rank_against_its_share():
    """The trace counts rank 0's matmul and attention FLOPs on its local shards (TP's DTensor
    ops by their local shapes): the 8B on 8 GPUs and the 70B at TP 8 x FSDP 8 do their even
    share (times full AC's recompute for the 70B); a rank doing twice its share is warned.
    Each at the real widths, shards and sequence, on 4 of its blocks (model.n_layers): a
    rank's share is a per-block property, the ideal count follows the traced model."""
    from trainer.plan.work import expected_ratio, work_lines

    for config, world in (("llama3_8b.toml", 8), ("llama3_70b.toml", 64)):
        cfg = load_config(
            ["--job.config_file", str(REPO / "configs" / config), "--model.n_layers", "4"]
        )
        r = trace_step(cfg, world)
        ratio = r.flops / r.ideal_flops
        assert 0.98 <= ratio / expected_ratio(cfg) <= 1.02, (config, ratio)
        assert not [x for x in work_lines(cfg, [(0, r.flops, r.ideal_flops)], 1) if "warning" in x]
    # the 70B's full AC, measured: ~1.25x (not 4/3) x the attention backward's ~1.02x (its
    # 80 blocks: at 4 the head's share is larger, ~1.22x)
    assert (
        1.22
        <= expected_ratio(
            load_config(["--job.config_file", str(REPO / "configs" / "llama3_70b.toml")])
        )
        <= 1.30
    )
    lines = work_lines(cfg, [(0, 2.9 * r.ideal_flops, r.ideal_flops)], 1)
    assert (
        f"warning: rank 0 does {2.9 / expected_ratio(cfg):.2f}x its share of the model's "
        "work" in lines[-1]
    ), lines


def test_the_recompute_factor_is_measured_on_a_block():
    """Full AC on one debug block at seq 64, counted on fake tensors: torch's checkpoint
    recomputes the block's forward up to its last matmul (w2's output is not needed for the
    backward), so the extra FLOPs equal a hand count of wq, wk, wv, wo, w1, w3 and the
    attention's two products; the block's factor lies between 1 and 1.5 (4/3 would be the
    whole forward again)."""
    from trainer.plan.memory import plan_args, resolve_vocab
    from trainer.plan.work import count_block, measure_factors

    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "debug_model.toml"),
            "--training.seq_len",
            "64",
            "--activation_checkpoint.mode",
            "full",
        ]
    )
    a = plan_args(cfg, resolve_vocab(cfg)[0])
    t = 64
    rest, bare, wrapped = (
        count_block(cfg, a, layer, mode) * t
        for layer, mode in ((None, "none"), (0, "none"), (0, "full"))
    )
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    matmuls = 2 * t * (a.dim * (q + 2 * kv) + q * a.dim + 2 * a.dim * a.hidden_dim)
    scores_and_values = 2 * (2 * a.n_heads * t * t * a.head_dim)
    assert wrapped - bare == matmuls + scores_and_values
    factor = (wrapped - rest) / (bare - rest)
    assert 1.0 < factor < 1.5
    f = measure_factors(cfg)  # every debug block is of one kind: the model's factor is close
    assert f.blocks[(False, "attention")][1] / f.blocks[(False, "attention")][0] == pytest.approx(
        factor
    )
    assert 1.0 < f.recompute < factor


def depth(config: str) -> list[str]:
    """The first blocks of the debug configs' models that every per-block formula meets: 2 of
    the dense model's 6; of the MoE model's 4, the dense block 0 and 2 MoE blocks."""
    return ["--model.n_layers", "3" if config.endswith("debug_moe.toml") else "2"]


def test_the_trace_counts_what_rank_0_sends_per_mesh_dimension_as_the_plan_does():
    """The collectives of the traced step (FSDP's, DTensor's, the all-to-all) booked by mesh
    dimension and scaled to the optimizer step equal the plan's formulas (trainer/plan/
    comm.py) for FSDP, TP, HSDP with accumulation, CP under 'hsdp_reduce_scatter' and EP x TP
    (MoE): a collective repeated or missed on either side shows."""
    from trainer.plan.comm import comm_volume

    debug, moe = (
        str(REPO / "configs" / "debug_model.toml"),
        str(REPO / "configs" / "debug_moe.toml"),
    )
    cases = [
        (debug, []),
        (debug, ["--parallelism.tensor_parallel_degree", "2"]),
        (
            debug,
            [
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--training.global_batch_size",
                "64",
            ],
        ),
        (
            debug,
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--training.global_batch_size",
                "64",
                "--training.gradient_accumulation_sync",
                "hsdp_reduce_scatter",
            ],
        ),
        (
            moe,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.global_batch_size",
                "32",
                "--training.gradient_accumulation_sync",
                "every",
            ],
        ),
    ]
    import multiprocessing

    # 2 dense blocks, or the dense block and 2 MoE blocks: the formulas go per block
    configs = [
        load_config(["--job.config_file", config, *extra, *depth(config)])
        for config, extra in cases
    ]
    # a process per world: DTensor's caches outlive a destroyed fake world's groups
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        results = pool.starmap(trace_step, [(cfg, 8) for cfg in configs], chunksize=1)
    for (_config, extra), cfg, r in zip(cases, configs, results, strict=True):
        traced, plan = r.comm_bytes, comm_volume(cfg, 8)
        for dim in ("tp", "cp", "dp_shard", "dp_replicate", "ep"):
            want = plan[f"comm_{dim}"]
            assert abs(traced[dim] - want) <= 0.01 * want + 2**12, (extra, dim, traced, want)
        assert sum(traced.values()) > 0


def test_pipeline_configs_are_traced_stage_by_stage():
    """PP 2 (x CP 2): each pp rank traced on its own, its in-flight microbatches held; CP
    really on under PP: half the activations per rank; the stages' p2p sends counted."""
    from trainer.plan.trace import trace_lines, trace_ranks

    base = [
        "--job.config_file",
        str(REPO / "configs" / "debug_model.toml"),
        "--parallelism.pipeline_parallel_degree",
        "2",
    ]
    pp = trace_ranks(load_config(base), 2)
    both = trace_ranks(load_config([*base, "--parallelism.context_parallel_degree", "2"]), 4)
    assert [r.pp_rank for r in pp] == [0, 1] == [r.pp_rank for r in both]
    ratios = [
        b.categories["activations"] / a.categories["activations"]
        for a, b in zip(pp, both, strict=True)
    ]
    # every stage's activations halve (the head's weight gradient, which the chunked loss
    # makes in the forward, is booked as a gradient: it has the weight's size at any cp)
    assert all(0.45 <= r <= 0.55 for r in ratios), ratios
    for alone, with_cp in zip(pp, both, strict=True):
        assert alone.comm_bytes["pp"] > 0 and with_cp.comm_bytes["cp"] > 0
    # the head's stage does more of the model's work than an even share, the embedding's less
    assert pp[0].flops < pp[0].ideal_flops and pp[1].ideal_flops < pp[1].flops
    cfg = load_config(base)
    lines = trace_lines(cfg, 2, memory_plan(cfg, 2), 80.0, lambda peak: peak)
    assert lines[0].startswith("traced dry run: one training step of pp ranks 0, 1"), lines
    assert any(
        x.startswith("    per traced pp rank, x its share (the split's model FLOPs): rank 0 0.")
        for x in lines
    ), lines
    assert lines[-1].startswith("trace verdict: FITS"), lines


def test_cp_gathers_kv_once_under_op_sac_and_reduces_their_gradients_in_fp32(monkeypatch):
    """CP 2 with op-level AC (bf16 compute): each block all-gathers K and V in the forward
    only (the policy saves them: the recompute does not gather again) and reduce-scatters
    their gradients in fp32 (a bf16 sum would round cp - 1 times)."""
    import trainer.plan.traffic as traffic
    from trainer.health import heartbeat

    seen = []
    original = traffic.Traffic.record

    def record(self, func, args):
        name = func._schema.name
        if "all_gather" in name or "reduce_scatter" in name:
            if traffic._group(args).group_name in recompute.SAVED_GATHER_GROUPS:
                seen.append((name.split("::")[-1], heartbeat._state["phase"], args[0].dtype))
        return original(self, func, args)

    from trainer.parallel import recompute

    monkeypatch.setattr(traffic.Traffic, "record", record)
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "debug_model.toml"),
            "--parallelism.context_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "op",
        ]
    )
    trace_step(cfg, 2)
    layers = 6  # debugmodel
    gathers = [s for s in seen if s[0].startswith("all_gather")]
    scatters = [s for s in seen if s[0].startswith("reduce_scatter")]
    assert len(gathers) == 2 * layers and {p for _, p, _ in gathers} == {"forward"}, seen
    assert {d for *_, d in gathers} == {torch.bfloat16}, seen
    assert len(scatters) == 2 * layers and {d for *_, d in scatters} == {torch.float32}, seen


def test_the_recompute_does_not_exchange_the_expert_counts_again(monkeypatch):
    """Full AC under EP: the recompute replays each MoE layer's counts and split sizes
    (trainer/parallel/recompute.py): the count exchange and its host sync happen once per
    layer per microbatch, in the forward only."""
    import trainer.plan.traffic as traffic
    from trainer.health import heartbeat

    exchanges = []
    original = traffic.Traffic.record

    def record(self, func, args):
        group = traffic._group(args)
        # the counts' exchange (an int64 table), not the rows' legs (the backward sends those)
        if (
            func._schema.name.endswith("alltoall_base_")
            and group.size() == 2
            and args[1].dtype == torch.int64
        ):
            exchanges.append(heartbeat._state["phase"])
        return original(self, func, args)

    monkeypatch.setattr(traffic.Traffic, "record", record)
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "debug_moe.toml"),
            "--parallelism.expert_parallel_degree",
            "2",
            "--activation_checkpoint.mode",
            "full",
        ]
    )
    trace_step(cfg, 8)
    assert exchanges and set(exchanges) == {"forward"}, exchanges


def test_muon_is_traced_with_its_gathers_booked_and_the_plans_owners():
    """Muon on fake worlds (trainer/optim/muon.py, trainer/plan/muon.py): its all-to-alls are
    booked as the optimizer's traffic (none "over other") and equal the plan's bytes within
    5%; this rank's Newton-Schulz FLOPs under the optimizer's owners equal the plan's count
    for it. MoE with experts gathered over efsdp (ep 2 x efsdp 8: FSDP's Shard(1)), EP x TP
    (experts whole where they live, dense matrices over dp_shard x tp), HSDP (a group per
    replica)."""
    import multiprocessing

    from trainer.plan.comm import comm_volume
    from trainer.plan.memory import plan_args, resolve_vocab
    from trainer.plan.muon import ns_loads

    debug, moe = (
        str(REPO / "configs" / "debug_model.toml"),
        str(REPO / "configs" / "debug_moe.toml"),
    )
    muon = ["--optimizer.name", "Muon"]
    cases = [
        (
            moe,
            16,
            ["--parallelism.expert_parallel_degree", "2", "--training.global_batch_size", "128"],
        ),
        (
            moe,
            8,
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.tensor_parallel_degree",
                "2",
                "--training.global_batch_size",
                "32",
            ],
        ),
        (
            debug,
            8,
            [
                "--parallelism.data_parallel_replicate_degree",
                "2",
                "--training.global_batch_size",
                "64",
            ],
        ),
    ]
    configs = [
        load_config(["--job.config_file", c, *muon, *extra, *depth(c)]) for c, _, extra in cases
    ]
    with multiprocessing.get_context("fork").Pool(2, maxtasksperchild=1) as pool:
        results = pool.starmap(
            trace_step,
            [(cfg, w) for cfg, (_, w, _) in zip(configs, cases, strict=True)],
            chunksize=1,
        )
    for (_, world, extra), cfg, r in zip(cases, configs, results, strict=True):
        plan = comm_volume(cfg, world)
        traced = r.comm_bytes
        assert not traced.get("other"), (extra, traced)  # Muon's groups are all known
        want = plan["comm_optimizer"]
        assert want > 0 and abs(traced["optimizer"] - want) <= 0.05 * want, (extra, traced, want)
        pd = cfg.resolve(world)[0]
        loads = ns_loads(cfg, pd, plan_args(cfg, resolve_vocab(cfg)[0]))
        assert r.muon_ns_flops == loads[0], (extra, r.muon_ns_flops, loads[0])
        assert plan["muon_ns_flops"] == max(loads) >= plan["muon_ns_flops_mean"] > 0
