"""Context parallelism (trainer/parallel/context_parallel.py) on CPU ranks: gloo, fp32, the
debug model's heads at dim 64, two of its blocks (debugmodel-narrow, model.n_layers 2), seq 512.

Through run_train.sh on 4 ranks, 5 steps of 2 sequences: CP 2 x FSDP 2, CP 4 (with full AC, 2
microbatches and per-microbatch gradient sync) and CP 2 x TP 2 give the 1-rank losses and
gradient norms within 1e-4, with `causal`; CP 2 x FSDP 2, CP 4 and PP 2 x CP 2 also with
`block_causal` and document positions on short documents (several per window). A checkpoint saved at
CP 2 x FSDP 2 resumes on 1 rank and at CP 4 with the uninterrupted run's losses. Under forkrun
(tests/scripts/cp_probe.py): the attention against one process, and the leak test (no gradient
crosses documents, on either cp rank). The head-tail split's balance is counted, and bad
settings are one line each.
"""

import pytest

from tests.data_fixtures import stdlib_texts, tokenizer_path  # noqa: F401
from tests.helpers import REPO, SYNTHETIC, losses, run_train, scalars, stopped_after_save, torchrun
from tests.test_doc_mask_e2e import short_docs_store  # noqa: F401
from trainer.config.job import load_config
from trainer.errors import ConfigError
from trainer.parallel.context_parallel import attention_pairs, contiguous_index, head_tail_index

CP = "--parallelism.context_parallel_degree"
# the debug model's heads at dim 64, two of its blocks (debugmodel-narrow): what these runs check
# (each block's attention over the cp ranks' shares) is in every block alike
COMMON = (
    "--training.device",
    "cpu",
    "--model.flavor",
    "debugmodel-narrow",
    "--model.n_layers",
    "2",
    "--training.seq_len",
    "512",
    "--training.local_batch_size",
    "1",
    "--training.global_batch_size",
    "2",
    "--training.mixed_precision_param",
    "float32",
    "--metrics.log_freq",
    "1",
    "--lr_scheduler.warmup_steps",
    "2",
    "--lr_scheduler.min_lr_factor",
    "1.0",
    "--training.steps",
    "5",
    "--validation.enable",
    "false",
)
CAUSAL = (
    *SYNTHETIC,
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
)
DOCS = (
    "--data.dataset",
    "json",
    "--model.attn_mask_type",
    "block_causal",
    "--model.positions",
    "document",
    "--checkpoint.enable",
    "false",
    # validated at step 5: under CP (not PP) each cp rank scores its share
    "--validation.enable",
    "true",
    "--validation.freq",
    "5",
    "--validation.steps",
    "2",
    "--validation.local_batch_size",
    "2",
)
LAYOUTS = {  # name: (ranks, overrides)
    "ref": (1, ()),
    "cp2_fsdp2": (4, (CP, "2")),
    "cp4": (
        4,
        (
            CP,
            "4",
            "--activation_checkpoint.mode",
            "full",
            "--training.gradient_accumulation_sync",
            "every",
        ),
    ),
    "cp2_tp2": (4, (CP, "2", "--parallelism.tensor_parallel_degree", "2")),
}
DOC_LAYOUTS = {
    "ref": (1, ()),
    "cp2_fsdp2": (4, (CP, "2")),
    "cp4": (4, (CP, "4")),
    # PP 2 x CP 2: the stages attend over their cp rank's share (2 microbatches)
    "pp2_cp2": (
        4,
        (
            CP,
            "2",
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--training.local_batch_size",
            "2",
        ),
    ),
}


def close(a: dict, b: dict, tol=1e-4) -> bool:
    return sorted(a) == sorted(b) and all(abs(a[s] - b[s]) <= tol * max(1.0, abs(b[s])) for s in b)


def same_training(ref, got, steps=range(1, 6)) -> None:
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == list(steps), (tag, have)
        assert close(have, {s: want[s] for s in steps}), (tag, have, want)


@pytest.fixture(scope="module")
def causal_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cp")
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        proc = run_train(root / name, *COMMON, *CAUSAL, *overrides, nproc=nproc)
        out[name] = (root / name, proc.stdout)
    return out


@pytest.mark.parametrize("name", ["cp2_fsdp2", "cp4", "cp2_tp2"])
def test_causal_layouts_train_as_one_rank(causal_runs, name):
    dump, stdout = causal_runs[name]
    same_training(causal_runs["ref"][0], dump)
    assert "head-tail split, K/V all-gathered" in stdout  # the mesh line
    assert "context parallel: cp " in stdout and "SDPA with one [local, global] mask" in stdout


def test_checkpoint_resumes_on_one_rank_and_at_cp4(causal_runs, tmp_path):
    """Saved at CP 2 x FSDP 2 after step 3: on 1 rank and at CP 4, steps 4-5 are the
    uninterrupted run's."""
    saved = causal_runs["cp2_fsdp2"][0]
    for name, nproc, overrides in (("one", 1, ()), ("cp4", 4, (CP, "4"))):
        dump = stopped_after_save(saved, tmp_path / name, 5)
        out = run_train(dump, *COMMON, *CAUSAL, *overrides, nproc=nproc).stdout
        assert "resumed from" in out and "step-3" in out, out[-2000:]
        have, want = losses(dump), losses(causal_runs["ref"][0])
        assert sorted(have) == [4, 5] and close(have, {s: want[s] for s in (4, 5)}), (have, want)


@pytest.fixture(scope="module")
def doc_runs(short_docs_store, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("cp_docs")
    out = {}
    for name, (nproc, overrides) in DOC_LAYOUTS.items():
        proc = run_train(
            root / name,
            *COMMON,
            *DOCS,
            "--data.store_path",
            short_docs_store,
            *overrides,
            nproc=nproc,
        )
        out[name] = (root / name, proc.stdout)
    return out


@pytest.mark.needs_datasets
@pytest.mark.parametrize("name", ["cp2_fsdp2", "cp4", "pp2_cp2"])
def test_block_causal_with_document_positions_trains_as_one_rank(doc_runs, name):
    assert "context parallel: cp " in doc_runs[name][1]  # on, under PP too
    assert "by global position and document" in doc_runs[name][1]
    same_training(doc_runs["ref"][0], doc_runs[name][0])
    tag = "validation_metrics/loss"
    got = scalars(doc_runs[name][0], tag)
    assert sorted(got) == [5] and close(got, scalars(doc_runs["ref"][0], tag)), got
    assert "; each cp rank scores its share of every sequence" in doc_runs[name][1]  # PP too


def test_no_gradient_crosses_documents_and_attention_equals_one_process():
    proc = torchrun(REPO / "tests" / "scripts" / "cp_probe.py", nproc=2, fork=True)
    assert "cp probe ok causal" in proc.stdout and "cp probe ok block_causal" in proc.stdout


@pytest.mark.parametrize("seq,cp", [(512, 2), (512, 4), (4096, 8), (131072, 16)])
def test_head_tail_split_balances_attention_work(seq, cp):
    """Counted (query, key) pairs per rank: the head-tail split is within 10% (here: equal),
    the contiguous split is not (its last rank does ~2cp-1 times the first one's work)."""
    head_tail = [attention_pairs(head_tail_index(seq, cp, r)) for r in range(cp)]
    contiguous = [attention_pairs(contiguous_index(seq, cp, r)) for r in range(cp)]
    assert sum(head_tail) == sum(contiguous) == seq * (seq + 1) // 2
    assert max(head_tail) <= 1.10 * min(head_tail)
    assert max(contiguous) > 2 * min(contiguous)
    covered = sorted(int(i) for r in range(cp) for i in head_tail_index(seq, cp, r))
    assert covered == list(range(seq))


@pytest.mark.parametrize(
    "overrides,world,message",
    [
        (
            [CP, "3"],
            4,
            "config error: parallelism.context_parallel_degree = 3 does not divide world "
            "size 4; valid: 1, 2, 4",
        ),
        (
            [CP, "2", "--training.seq_len", "102"],
            2,
            "config error: training.seq_len = 102 does not cut into 2 x "
            "parallelism.context_parallel_degree = 4 head-tail chunks: it must be a multiple of 4 "
            "(e.g. 100)",
        ),
        (
            [CP, "2", "--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "102"],
            4,
            "config error: training.seq_len = 102 does not cut into 2 x "
            "parallelism.context_parallel_degree = 4 head-tail chunks x "
            "parallelism.tensor_parallel_degree = 2 (sequence parallel): it must be a multiple of "
            "8 (e.g. 96)",
        ),
        (
            [
                CP,
                "2",
                "--model.attn_mask_type",
                "block_causal",
                "--model.attn_implementation",
                "per_document",
            ],
            2,
            "config error: model.attn_implementation = 'per_document' cannot run "
            "under parallelism.context_parallel_degree = 2",
        ),
    ],
)
def test_impossible_settings_are_one_line(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides).resolve(world)
    assert f"config error: {err.value}".startswith(message), str(err.value)


def test_bad_cp_is_refused_before_any_rank_starts(tmp_path):
    proc = run_train(
        tmp_path / "out", "--training.device", "cpu", CP, "3", nproc=2, check=False, timeout=60
    )
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == [
        "config error: parallelism.context_parallel_degree = 3 does not divide "
        "world size 2; valid: 1, 2"
    ], proc.stderr


def test_plan_divides_activations_by_cp_and_counts_the_kv_all_gather():
    """8B at 32k tokens on 8 ranks, full AC: at cp 8 the parameters are sharded over the same
    8 ranks as FSDP 8, the activations are 1/8 (beyond the mask tables), the top block's
    recompute adds the gathered K/V of one layer, and cp sends (7/8) x KV per layer in the
    forward and the recompute, and twice that in backward (the gradients reduce-scattered in
    fp32)."""
    from trainer.plan.comm import comm_volume
    from trainer.plan.memory import memory_plan

    def plan(cp: int):
        cfg = load_config(
            [
                "--job.config_file",
                str(REPO / "configs" / "llama3_8b_128k.toml"),
                "--training.seq_len",
                "32768",
                "--training.global_batch_size",
                str(8 // cp),
                CP,
                str(cp),
            ]
        )
        return memory_plan(cfg, 8), comm_volume(cfg, 8)

    (one, comm1), (eight, comm8) = plan(1), plan(8)
    assert eight["parameters"] == one["parameters"] and eight["cp_kv"] == 0  # full AC
    assert (eight["activations"] - eight["attention_inputs"]) * 8 == one["activations"] - one[
        "attention_inputs"
    ]
    kv = 2 * 2 * 32768 * 8 * 128  # K and V, bf16, 8 KV heads of 128, the whole sequence
    assert comm1["comm_cp"] == 0 and comm8["comm_cp"] == 7 / 8 * kv * (1 + 2 + 1) * 32
    assert eight["ac_recompute"] * 8 - kv * 8 == one["ac_recompute"]


@pytest.mark.parametrize("documents", [False, True])
def test_flex_mask_mod_is_the_sdpa_mask(documents):
    """CUDA's FlexAttention mask (its mask_mod, materialised element by element on the CPU)
    allows exactly the (query, key) pairs of the CPU path's SDPA mask, on every cp rank."""
    import torch
    from torch.nn.attention.flex_attention import create_mask

    from trainer.parallel.context_parallel import ContextAttention, mask_mod

    seq, cp = 64, 4
    docs = torch.tensor([[0] * 7 + [1] * 30 + [2] * 27, [0] * 40 + [1] * 24]) if documents else None
    natural = torch.argsort(torch.cat([head_tail_index(seq, cp, r) for r in range(cp)]))
    for rank in range(cp):
        index = head_tail_index(seq, cp, rank)
        sdpa = ContextAttention(None, index, natural, docs, "sdpa").mask
        flex = create_mask(
            mask_mod(index, docs),
            None if docs is None else 2,
            None,
            index.numel(),
            seq,
            device="cpu",
        )
        assert torch.equal(flex, sdpa.expand_as(flex)), rank
