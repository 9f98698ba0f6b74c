"""DeepSeek-V3's training recipe as keys (docs/moe.md, docs/deepseek.md): the complementary
sequence-wise balance loss (`moe.seq_aux_loss_weight`), the bias update speed's and the MTP
loss weight's schedules, and multi-token prediction within documents on every layout.

In one process: the loss against the report's formula (eq. 17-20) computed by hand in a plain
loop; its gradient on the router logits has both signs (the raw-score aux loss's has one);
the schedules' step functions. Through run_train.sh (configs/debug_dsv3.toml with 2 MTP
depths, fp32, block_causal with document positions on a store of short documents, so every
window packs several; the sequence-wise loss and both schedules on; 4 steps): CP 2 x EP 2 and
TP 2 (sequence parallel) give one rank's losses, MTP losses, aux loss and gradient norms;
PP 2 x CP 2 (the sequence-wise loss off: refused under pp) one rank's first-step losses;
the schedules' values change at their step in TensorBoard, and the balancing bias stops.
"""

import pytest
import torch

from tests.data_fixtures import tokenizer_path  # noqa: F401
from tests.helpers import REPO, run_train, scalars
from tests.test_doc_mask_e2e import short_docs_store  # noqa: F401
from trainer.models.common.moe import expert_counts, sequence_balance_loss
from trainer.models.config import Model as ModelConfig
from trainer.models.config import MoE as MoEConfig


def by_hand(scores: list[list[float]], chosen: list[list[int]], batch: int) -> float:
    """The report's eq. 17-20 (without alpha), a plain loop; the mean over sequences."""
    n_experts, k = len(scores[0]), len(chosen[0])
    seq_len = len(scores) // batch
    total = 0.0
    for b in range(batch):
        rows = range(b * seq_len, (b + 1) * seq_len)
        for i in range(n_experts):
            f = n_experts / (k * seq_len) * sum(1 for t in rows if i in chosen[t])
            p = sum(scores[t][i] / sum(scores[t]) for t in rows) / seq_len
            total += f * p
    return total / batch


def routed(batch=3, seq_len=7, n_experts=8, k=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch * seq_len, n_experts, generator=gen, dtype=torch.float64)
    logits.requires_grad_(True)
    scores = logits.sigmoid()
    bias = 0.05 * torch.randn(n_experts, generator=gen, dtype=torch.float64)  # choice only
    chosen = (scores + bias).topk(k, dim=-1).indices
    return logits, scores, chosen


def test_the_sequence_wise_loss_is_the_reports_formula():
    _, scores, chosen = routed()
    got = sequence_balance_loss(scores, chosen, 3, 8).detach()
    want = by_hand(scores.tolist(), chosen.tolist(), 3)
    assert abs(float(got) - want) < 1e-12, (float(got), want)
    # not the microbatch-wide balance: one sequence of all 21 tokens differs
    assert abs(float(sequence_balance_loss(scores, chosen, 1, 8).detach()) - want) > 1e-3


def test_its_router_gradient_has_both_signs_unlike_the_raw_score_aux_loss():
    logits, scores, chosen = routed(batch=4, seq_len=32, n_experts=16, k=4, seed=1)
    (grad,) = torch.autograd.grad(
        sequence_balance_loss(scores, chosen, 4, 16), logits, retain_graph=True
    )
    positive = float((grad > 0).double().mean())
    assert 0.2 < positive < 0.8, positive
    # moe.aux_loss_weight's loss: E x sum_i f_i P_i with raw sigmoid scores
    counts = expert_counts(chosen.reshape(-1), 16).double()
    raw = 16 * (counts / (128 * 4) * scores.mean(0)).sum()
    (grad,) = torch.autograd.grad(raw, logits)
    assert bool((grad >= 0).all()), "every raw-score gradient has the same sign"


def test_the_schedules_are_functions_of_the_step():
    model = ModelConfig(
        mtp_layers=1, mtp_loss_weight=0.3, mtp_loss_weight_until_step=10, mtp_loss_weight_later=0.1
    )
    assert [model.mtp_weight_at(s) for s in (1, 10, 11, 500)] == [0.3, 0.3, 0.1, 0.1]
    assert ModelConfig(mtp_layers=1).mtp_weight_at(10**6) == 0.3  # default: no change
    moe = MoEConfig(load_balance_coeff=1e-3, load_balance_coeff_until_step=10)
    assert [moe.balance_coeff_at(s) for s in (1, 10, 11)] == [1e-3, 1e-3, 0.0]
    assert MoEConfig().balance_coeff_at(10**6) == 1e-3


# ------------------------------------------------------------------------------ end to end

CONFIG = str(REPO / "configs" / "debug_dsv3.toml")
EP, CP = "--parallelism.expert_parallel_degree", "--parallelism.context_parallel_degree"
# the debug DeepSeek-V3's first 3 blocks (dense + 2 MoE) and 2 MTP modules: 4 MoE blocks
COMMON = (
    "--model.n_layers",
    "3",
    "--training.seq_len",
    "64",
    "--training.local_batch_size",
    "2",
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
    "--training.steps",
    "4",
    "--validation.enable",
    "false",
    "--checkpoint.enable",
    "false",
    "--data.dataset",
    "json",
    "--model.attn_mask_type",
    "block_causal",
    "--model.positions",
    "document",
    "--model.mtp_layers",
    "2",
    "--model.mtp_loss_weight_until_step",
    "2",
    "--moe.load_balance_coeff_until_step",
    "2",
)
SEQ_AUX = ("--moe.seq_aux_loss_weight", "0.01")
LAYOUTS = {  # name: (ranks, overrides)
    "ref": (
        1,
        (
            EP,
            "1",
            *SEQ_AUX,
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
            "--checkpoint.keep_latest_k",
            "0",
        ),
    ),
    "cp2_ep2": (4, (EP, "2", CP, "2", *SEQ_AUX)),
    "tp2": (2, (EP, "1", "--parallelism.tensor_parallel_degree", "2", *SEQ_AUX)),
    "pp2_cp2": (4, (EP, "1", CP, "2", "--parallelism.pipeline_parallel_degree", "2")),
}
TAGS = ("loss_metrics/global_avg_loss", "loss_metrics/mtp_loss", "grad_norm", "moe/aux_loss")


@pytest.fixture(scope="module")
def recipe_runs(short_docs_store, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("recipe")
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        proc = run_train(
            root / name,
            *COMMON,
            "--data.store_path",
            short_docs_store,
            *overrides,
            nproc=nproc,
            config=CONFIG,
        )
        out[name] = (root / name, proc.stdout)
    return out


def close(have: dict, want: dict, tol=1e-4, floor=1.0) -> bool:
    return all(abs(have[s] - want[s]) <= tol * max(floor, abs(want[s])) for s in want)


@pytest.mark.needs_datasets
@pytest.mark.parametrize("name", ["cp2_ep2", "tp2"])
def test_each_layout_gives_one_ranks_losses_with_the_sequence_wise_loss(recipe_runs, name):
    ref, got = recipe_runs["ref"][0], recipe_runs[name][0]
    for tag in TAGS[:3]:
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == [1, 2, 3, 4] and close(have, want), (tag, have, want)
    # The sequence-wise loss alone: ~1.0 per MoE layer near balance (4 layers x 0.01), the
    # imbalance in its 4th digit; statistics of half sequences move it by ~1e-3 relative.
    want, have = scalars(ref, TAGS[3]), scalars(got, TAGS[3])
    assert sorted(have) == [1, 2, 3, 4] and close(have, want, tol=1e-5, floor=0.0), (have, want)
    assert all(0.0399 < v < 0.0402 for v in want.values()), want


@pytest.mark.needs_datasets
def test_pipeline_x_context_parallel_gives_one_ranks_mtp_loss(recipe_runs):
    ref, got = recipe_runs["ref"][0], recipe_runs["pp2_cp2"][0]
    for tag in TAGS[:2]:  # the first step's forward: the same weights, the same targets
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == [1, 2, 3, 4] and close({1: have[1]}, {1: want[1]}), tag


@pytest.mark.needs_datasets
def test_the_schedules_change_at_their_step(recipe_runs):
    from trainer.convert import dcp_fetch, saved_shapes

    dump, stdout = recipe_runs["ref"]
    assert "MTP loss weight 0.3 up to step 2, then 0.1" in stdout
    assert "expert bias update speed 0.001 up to step 2, then 0" in stdout
    weight = scalars(dump, "loss_metrics/mtp_loss_weight")  # float32 in the event file
    assert sorted(weight) == [1, 2, 3, 4], weight
    assert close(weight, {1: 0.3, 2: 0.3, 3: 0.1, 4: 0.1}, tol=1e-6), weight
    coeff = scalars(dump, "moe/load_balance_coeff")
    assert close(coeff, {1: 1e-3, 2: 1e-3, 3: 0.0, 4: 0.0}, tol=1e-9), coeff
    bias = {}
    for step in (2, 4):
        ckpt = str(dump / "checkpoint" / f"step-{step}")
        shapes = saved_shapes(ckpt)
        keys = [k for k in shapes if k.endswith("expert_bias")]
        bias[step] = dcp_fetch(ckpt, shapes)(keys)
    assert any(v.abs().max() > 0 for v in bias[2].values())  # moved up to step 2
    assert all(torch.equal(bias[2][k], bias[4][k]) for k in bias[2])  # then not at all


def test_the_layers_sequence_wise_loss_counts_the_plain_top_k_not_the_routed_experts():
    """The report's eq. 18 (and Megatron's) counts each token's top K of its scores; the
    experts it was routed to (biased, group-limited) differ, and do not enter the loss."""
    import types

    from trainer.models.args import MoEArgs
    from trainer.models.common.moe import MoE

    _, scores, chosen = routed(batch=3, seq_len=7, n_experts=8, k=2)
    plain = scores.topk(2, dim=-1).indices
    assert not torch.equal(plain.sort(-1).values, chosen.sort(-1).values)
    layer = types.SimpleNamespace(
        moe=MoEArgs(n_experts=8, top_k=2, seq_aux_loss_weight=1.0),
        token_group=None,
        aux_terms=[],
    )
    got = MoE._aux(layer, scores, scores.logit(), chosen, 3)
    assert float(got) == pytest.approx(by_hand(scores.tolist(), plain.tolist(), 3), abs=1e-12)


def test_router_logits_are_computed_in_fp32_from_bf16_inputs():
    """As DeepSeek-V3's gate: a bf16 matmul would round every logit to bf16 first."""
    from trainer.models.args import MoEArgs
    from trainer.models.common.moe import Router

    torch.manual_seed(0)
    router = Router(256, MoEArgs(n_experts=64, top_k=4)).to(torch.bfloat16)
    x = torch.randn(512, 256, dtype=torch.bfloat16)
    *_, logits = router(x)
    want = x.float() @ router.gate.weight.float().T
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, want, rtol=1e-6, atol=1e-6)
    rounded = router.gate(x).float()
    assert (rounded - want).abs().max() > 1e-3  # what bf16 logits would have been
