"""Mixture of experts (trainer/models/common/moe.py).

In one process: grouped GEMMs equal the per-expert loop and a token-by-token reference, a
skewed router still computes every token (dropless) with gradients to every input, a capacity
factor drops and counts the overflow, the balancing bias moves toward balance, the flavors
have their released sizes, and Qwen3MoeForCausalLM round-trips with transformers (equal
logits both ways). Through run_train.sh, debugmodel-moe-narrow (its layout at dim 64) with
aux and router z-losses: FSDP 2
and 2 replicas give the 1-rank losses, gradient norms and expert loads, the balancing bias
moves alike everywhere and is in the checkpoint, and a resume is bitwise."""

import dataclasses
import json
import re

import pytest
import torch

from tests.helpers import REPO, SYNTHETIC, scalars
from trainer.config.job import load_config
from trainer.models.args import MoEArgs
from trainer.models.common.moe import MoE, capacity, update_expert_bias
from trainer.models.flavors import FLAVORS

DIM = 32


def moe_layer(**kw) -> MoE:
    torch.manual_seed(0)
    layer = MoE(DIM, MoEArgs(**{"n_experts": 4, "top_k": 2, "hidden_dim": 16, **kw}))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    for b in layer.buffers():
        b.zero_()
    return layer


def reference(layer: MoE, x: torch.Tensor, drop: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: sum over the chosen experts of weight x SwiGLU expert(x)."""
    flat = x.reshape(-1, DIM)
    weights, chosen, _, _ = layer.router(flat)
    e = layer.experts
    out = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        for j in range(chosen.shape[1]):
            if drop is not None and drop[t * chosen.shape[1] + j]:
                continue
            k = chosen[t, j]
            h = torch.nn.functional.silu(flat[t] @ e.w1[k].t()) * (flat[t] @ e.w3[k].t())
            out[t] += weights[t, j] * (h @ e.w2[k].t())
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize("grouped", [True, False])
def test_experts_equal_the_token_by_token_reference(grouped):
    layer = moe_layer(n_shared_experts=1)
    layer.experts.grouped = grouped
    x = torch.randn(2, 5, DIM, requires_grad=True)
    got = layer(x)
    want = reference(layer, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    (g1,) = torch.autograd.grad(got.square().sum(), x)
    (g2,) = torch.autograd.grad(want.square().sum(), x)
    torch.testing.assert_close(g1, g2, rtol=1e-5, atol=1e-5)


def test_dropless_under_a_skewed_router():
    """Every token sent to experts 0 and 1: all of them computed, gradients to every token."""
    layer = moe_layer()
    layer.router.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    x = torch.randn(3, 8, DIM, requires_grad=True)
    y = layer(x)
    stats = layer.take_stats()
    assert stats["tokens_per_expert"].tolist() == [24, 24, 0, 0]
    assert stats["dropped"].item() == 0
    torch.testing.assert_close(y, reference(layer, x), rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(y.sum(), x)
    assert bool((grad.reshape(-1, DIM).abs().sum(-1) > 0).all())


def test_capacity_drops_the_overflow_in_token_order():
    layer = moe_layer(capacity_factor=0.5)
    layer.router.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    x = torch.randn(1, 8, DIM)
    cap = capacity(layer.moe, 8)  # ceil(0.5 x 8 x 2 / 4) = 2 pairs per expert
    assert cap == 2
    y = layer(x)
    stats = layer.take_stats()
    assert stats["dropped"].item() == 16 - 2 * cap and stats["routed"].item() == 16
    # the first two tokens keep both their experts; the others get nothing routed
    drop = torch.tensor([t >= 2 for t in range(8) for _ in range(2)])
    torch.testing.assert_close(y, reference(layer, x, drop), rtol=1e-5, atol=1e-5)
    assert y[0, 2:].abs().max() == 0


@pytest.mark.parametrize("grouped", [True, False])
def test_capacity_drops_exactly_with_gradients(grouped):
    """A random router over capacity 0.75: the kept pairs equal the reference's, gradients
    included (the rows past the kept ones are masked in and out of the experts)."""
    layer = moe_layer(capacity_factor=0.75)
    layer.experts.grouped = grouped
    layer.router.expert_bias.copy_(torch.tensor([1.0, 0.5, 0.0, 0.0]))
    x = torch.randn(2, 12, DIM, requires_grad=True)
    flat = x.reshape(-1, DIM)
    chosen = layer.router(flat)[1].reshape(-1)
    seen, drop = [0] * 4, []
    for e in chosen.tolist():  # token order: an expert keeps its first `capacity` pairs
        drop.append(seen[e] >= capacity(layer.moe, 24))
        seen[e] += 1
    assert 0 < sum(drop) < len(drop)
    got, want = layer(x), reference(layer, x, torch.tensor(drop))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    params = [x, *layer.experts.parameters(), layer.router.gate.weight]
    g1 = torch.autograd.grad(got.square().sum(), params)
    g2 = torch.autograd.grad(want.square().sum(), params)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_capacity_has_no_data_dependent_shape():
    """No shape depends on the routing (a boolean index would: on a GPU a host sync per MoE
    layer, and fake tensors, as the traced dry run uses, refuse it)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    layer = moe_layer(capacity_factor=1.25).to(torch.bfloat16)  # the grouped GEMM's meta
    with FakeTensorMode(allow_non_fake_inputs=True):  # function takes bf16 only
        y = layer(torch.randn(2, 16, DIM, dtype=torch.bfloat16))
    assert y.shape == (2, 16, DIM)


def test_the_balancing_bias_moves_toward_balance():
    layer = moe_layer()
    update_expert_bias([layer], [torch.tensor([10.0, 0.0, 2.0, 4.0])], coeff=1e-3)
    assert layer.router.expert_bias.tolist() == pytest.approx([-1e-3, 1e-3, 1e-3, 0.0])  # mean 4


def test_a_skipped_step_leaves_the_balancing_bias():
    """The bias moves after an optimizer step only: not when the step was skipped (a spike, a
    non-finite norm), whether the host knows it (False) or only the device (a flag tensor,
    the fused optimizer's skip), as a skipped step leaves the weights."""
    from trainer.models.common.moe import balance_experts, moe_layers

    _, model = random_moe("debugmodel-moe")
    model.train()  # loads are counted in training only
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))

    def biases(stepped):
        with torch.no_grad():
            model(tokens)  # the step's loads
        balance_experts(model, n_layers=4, coeff=1e-3, device="cpu", stepped=stepped)
        return torch.stack([m.router.expert_bias.clone() for m in moe_layers(model).values()])

    start = biases(False)
    assert start.abs().max() == 0
    assert torch.equal(biases(torch.tensor(False)), start)
    moved = biases(torch.tensor(True))
    assert moved.abs().max() == pytest.approx(1e-3)  # each moved by +-coeff (or 0 at the mean)
    assert (biases(True) - moved).abs().max() == pytest.approx(1e-3)  # the host's True too


def test_sigmoid_scores_and_unnormalised_weights():
    layer = moe_layer(score_func="sigmoid", norm_topk_prob=False, route_scale=2.5)
    weights, chosen, probs, _ = layer.router(torch.randn(6, DIM))
    torch.testing.assert_close(weights, 2.5 * probs.gather(-1, chosen))


def test_top_1_with_normalised_weights_weighs_one():
    """norm_topk_prob with top_k = 1 gives the chosen expert weight 1, as transformers'
    Qwen3-MoE router does (an exported top-1 model then routes and weighs alike)."""
    layer = moe_layer(top_k=1)
    weights, _, probs, _ = layer.router(torch.randn(6, DIM))
    assert torch.equal(weights, torch.ones_like(weights)) and probs.max() < 1


def test_flavor_sizes():
    qwen = FLAVORS["qwen3-30b-a3b"]
    assert round(qwen.num_params() / 1e9, 1) == 30.5
    assert qwen.num_params(active=True) / 1e9 == pytest.approx(3.35, abs=0.01)  # "A3B": 3.3B
    moe = FLAVORS["debugmodel-moe"]
    assert [moe.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    step = dataclasses.replace(moe.moe, first_dense_layers=0, sparse_step=2)
    assert [step.is_moe_layer(i) for i in range(4)] == [False, True, False, True]


def random_moe(flavor: str, vocab: int = 512):
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    args = model_args(flavor, vocab_size=vocab, max_seq_len=32)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    perturb_norms(model)
    return args, model.eval()


def perturb_norms(model) -> None:
    """Norm weights away from their init of ones, as training leaves them: a layout error in
    a norm (Qwen3's per-head q/k norms follow the RoPE permutation) cannot hide behind 1s."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)


def test_qwen3_moe_round_trip_with_transformers(tmp_path):
    """Ours -> a Qwen3MoeForCausalLM folder that transformers loads with no code of ours and
    whose logits equal ours; a random Qwen3MoeForCausalLM saved by transformers -> ours, the
    same logits."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from trainer.config.job import JobConfig
    from trainer.hf.export import write_hf_folder
    from trainer.hf.load import load_hf

    args, ours = random_moe("debugmodel-moe")
    cfg = JobConfig()
    cfg.data.dataset = "synthetic"
    sd = ours.state_dict()
    write_hf_folder(
        str(tmp_path / "out"),
        args,
        lambda names: {n: sd[n] for n in names},
        cfg,
        dtype="float32",
        log=lambda _: None,
    )
    theirs = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() < 1e-4

    config = Qwen3MoeConfig(
        **{
            k: v
            for k, v in theirs.config.to_dict().items()
            if k not in ("architectures", "transformers_version")
        }
    )
    torch.manual_seed(1)
    fresh = Qwen3MoeForCausalLM(config).eval()
    perturb_norms(fresh)
    fresh.save_pretrained(tmp_path / "in")
    _, loaded = random_moe("debugmodel-moe")
    load_hf(loaded, str(tmp_path / "in"), flavor="debugmodel-moe")
    with torch.no_grad():
        assert (loaded(tokens) - fresh(tokens).logits).abs().max().item() < 1e-4


def test_one_expert_round_trips_with_transformers(tmp_path):
    """moe.num_experts = 1: its [1, ...] experts export as expert 0 and import back (the
    import took the one Hugging Face tensor for an unstacked parameter and refused it)."""
    from transformers import Qwen3MoeForCausalLM

    from trainer.config.job import JobConfig
    from trainer.hf.export import write_hf_folder
    from trainer.hf.load import load_hf
    from trainer.models.build import build_model

    args, _ = random_moe("debugmodel-moe")
    args = dataclasses.replace(args, moe=dataclasses.replace(args.moe, n_experts=1, top_k=1))
    models = []
    for seed in (0, 1):
        model = build_model(args)
        model.to_empty(device="cpu")
        model.init_weights(seed)
        models.append(model.eval())
    cfg = JobConfig()
    cfg.data.dataset = "synthetic"
    sd = models[0].state_dict()
    write_hf_folder(
        str(tmp_path),
        args,
        lambda names: {n: sd[n] for n in names},
        cfg,
        dtype="float32",
        log=lambda _: None,
    )
    load_hf(models[1], str(tmp_path), flavor="debugmodel-moe")
    theirs = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = theirs(tokens).logits
        for model in models:
            assert (model(tokens) - want).abs().max().item() < 1e-4


def test_another_architecture_is_one_config_error(tmp_path):
    from trainer.errors import ConfigError
    from trainer.hf.mapping import check_hf_config

    args, _ = random_moe("debugmodel-moe")
    with pytest.raises(
        ConfigError,
        match="holds a 'llama' model .* but model.flavor 'debugmodel-moe' is 'qwen3_moe'",
    ):
        check_hf_config(
            {"model_type": "llama", "architectures": ["LlamaForCausalLM"]},
            args,
            str(tmp_path),
            "debugmodel-moe",
        )
    # the same architecture with another top-k (no tensor shape shows it) is refused too
    with pytest.raises(ConfigError, match="num_experts_per_tok is 4 there and 2 here"):
        check_hf_config(
            {
                "model_type": "qwen3_moe",
                "rms_norm_eps": 1e-6,
                "rope_theta": 5e5,
                "num_experts_per_tok": 4,
                "norm_topk_prob": True,
            },
            args,
            str(tmp_path),
            "debugmodel-moe",
        )


# ------------------------------------------------------------------------------ end to end

# debugmodel-moe's layout at dim 64, its first 3 blocks (the dense block 0, then 2 MoE blocks:
# a bias, load or gradient of one MoE layer applied to another still shows): what these runs
# check does not depend on the width or on more blocks alike
NARROW = "debugmodel-moe-narrow"
COMMON = (
    "--training.device",
    "cpu",
    "--model.flavor",
    NARROW,
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
    *SYNTHETIC,
    "--training.steps",
    "5",
    "--moe.aux_loss_weight",
    "1e-2",
    "--moe.router_z_loss_weight",
    "1e-3",
    "--checkpoint.enable",
    "true",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from tests.helpers import run_train

    root = tmp_path_factory.mktemp("moe")
    # Every run saves step 5 (the biases, routers and experts compared with ref's); step 3 only
    # where a resume starts from it (ref, fsdp2, ep2_fsdp2, tp2_ep4); ref_no_aux saves nothing.
    resumed_from = {"ref", "fsdp2", "ep2_fsdp2", "tp2_ep4"}
    for name, nproc, extra in (
        ("ref", 1, ()),
        ("fsdp2", 2, ()),
        ("hsdp", 2, (REPLICAS, "2")),
        ("ep2_fsdp2", 4, (EP, "2")),
        ("ep4", 4, (EP, "4")),
        ("hsdp2_ep2", 4, (EP, "2", REPLICAS, "2")),
        # the ep group takes in the tp ranks (trainer/parallel/
        # dims.py): ep = the tp group, efsdp 2; ep = 2 dp_shard x 2 tp
        ("tp2_ep2", 4, (EP, "2", TP, "2")),
        ("tp2_ep4", 4, (EP, "4", TP, "2")),
        ("ep2_ac", 2, (EP, "2", *OP_AC, "--training.gradient_accumulation_sync", "every")),
        # each cp rank routes its sequence shard; the aux statistics
        # summed over cp (x tp), the experts sharded over efsdp x cp
        ("cp2_ep2", 4, (EP, "2", CP, "2")),
        ("cp2_tp2", 4, (CP, "2", "--parallelism.tensor_parallel_degree", "2")),
        # stage 0 of the pp run holds only the dense layer 0
        ("ref_no_aux", 1, NO_AUX),
        (
            "pp2_dense_stage",
            2,
            (*NO_AUX, PP, "2", SPLIT, "layers.1", "--checkpoint.last_save_in_hf", "true"),
        ),
    ):
        saves = (
            (() if name in resumed_from else ("--checkpoint.interval", "5"))
            if name != "ref_no_aux"
            else ("--checkpoint.enable", "false")
        )
        run_train(root / name, *COMMON, *extra, *saves, nproc=nproc)
    return root


LOSS = "loss_metrics/global_avg_loss"
# pp: no aux losses; and no balancing bias, so the PP run's checkpoint exports exactly
NO_AUX = (
    "--moe.aux_loss_weight",
    "0",
    "--moe.router_z_loss_weight",
    "0",
    "--moe.load_balance_coeff",
    "0",
)
PP = "--parallelism.pipeline_parallel_degree"
SPLIT = "--parallelism.pipeline_parallel_split_points"


EP = "--parallelism.expert_parallel_degree"
TP = "--parallelism.tensor_parallel_degree"
CP = "--parallelism.context_parallel_degree"
REPLICAS = "--parallelism.data_parallel_replicate_degree"
OP_AC = (
    "--activation_checkpoint.mode",
    "selective",
    "--activation_checkpoint.selective_ac_option",
    "op",
)


@pytest.mark.parametrize(
    "name",
    [
        "fsdp2",
        "hsdp",
        "ep2_fsdp2",
        "ep4",
        "hsdp2_ep2",
        "tp2_ep2",
        "tp2_ep4",
        "ep2_ac",
        "cp2_ep2",
        "cp2_tp2",
    ],
)
def test_moe_trains_as_one_rank_with_balancing_and_aux_losses(moe_runs, name):
    """FSDP 2, 2 replicas, and on 4 ranks EP 2 x FSDP 2, EP 4, HSDP 2 x EP 2, TP 2 x EP 2 and
    TP 2 x EP 4 (attention and the dense block tensor parallel, each tp rank routing its own
    tokens to the experts split over ep = ep_dp x tp), and EP 2 on 2
    ranks with op-level activation checkpointing and a gradient sync every microbatch (the aux
    losses back-propagate inside the recompute): the 1-rank
    losses, gradient norms and expert loads; the balancing bias moved (the loads are summed over
    the ranks before the update, so it moves alike)."""
    from tests.helpers import scalars
    from trainer.checkpoint.safe_load import load_tensors

    ref, got = moe_runs / "ref", moe_runs / name
    for tag in (
        "loss_metrics/global_avg_loss",
        "grad_norm",
        "moe/layer_1/load_imbalance",
        "moe/layer_2/dropped_fraction",
        "moe/aux_loss",
    ):  # aux: the dp ranks' mean
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == [1, 2, 3, 4, 5], (tag, have)
        assert all(abs(have[s] - want[s]) <= 1e-4 * max(1.0, abs(want[s])) for s in want), tag
    assert scalars(ref, "moe/layer_1/load_imbalance")[1] > 1.0
    key = "model_optim.model.layers.2.feed_forward.router.expert_bias"
    mine, theirs = (load_tensors(run / "checkpoint" / "step-5") for run in (got, ref))
    assert mine[key].abs().max() > 0
    torch.testing.assert_close(mine[key], theirs[key])
    # The routers, whose gradients carry the aux losses: AdamW magnifies a mis-scaled aux
    # gradient (an aux over cp ranks counted 1/cp: 16% off after 5 steps) that the losses
    # and gradient norms show only at 1e-5.
    routers = [k for k in theirs if k.startswith("model_optim.model.") and "router.gate" in k]
    assert routers
    for k in routers:
        torch.testing.assert_close(mine[k], theirs[k], rtol=1e-4, atol=1e-4 * theirs[k].abs().max())


def test_a_pipeline_stage_without_moe_layers_trains_as_one_rank(moe_runs):
    """PP 2 with stage 0 = the embedding and the dense layer 0 (no MoE layer): that stage still
    joins the loads' all-reduce (it hung there), and the run equals one rank's."""
    from tests.helpers import scalars

    ref, got = scalars(moe_runs / "ref_no_aux", LOSS), scalars(moe_runs / "pp2_dense_stage", LOSS)
    assert sorted(got) == [1, 2, 3, 4, 5]
    assert all(abs(got[s] - ref[s]) <= 1e-4 for s in ref), (got, ref)
    # last_save_in_hf gathered every stage, the balancing biases with them (it crashed)
    hf = json.loads((moe_runs / "pp2_dense_stage" / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3MoeForCausalLM"] and hf["num_experts"] == 8
    for layer in (1, 2):
        tag = f"moe/layer_{layer}/load_imbalance"
        assert scalars(moe_runs / "pp2_dense_stage", tag) == pytest.approx(
            scalars(moe_runs / "ref_no_aux", tag), abs=1e-4
        )


def test_qk_norms_train_as_one_rank_under_tp(moe_runs):
    """Qwen3's per-head q/k norms under TP 2: their gradient sums over every head (each tp rank
    holds half the heads), so the trained weights equal one rank's, not a per-rank drift."""
    from trainer.checkpoint.safe_load import load_tensors

    got = load_tensors(moe_runs / "tp2_ep2" / "checkpoint" / "step-5")
    ref = load_tensors(moe_runs / "ref" / "checkpoint" / "step-5")
    keys = [k for k in ref if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(keys) == 6  # 3 blocks x (q, k)
    for key in keys:
        assert (ref[key] - 1).abs().max() > 1e-3  # trained away from the init
        torch.testing.assert_close(got[key], ref[key], atol=2e-6, rtol=0)


def test_a_step_skipped_on_a_spike_leaves_the_balancing_bias(tmp_path):
    """on_spike = "skip" at step 4 on 1 rank: between the checkpoints of steps 3 and 5 the
    bias made one move of at most coeff (step 5's), not two (it moved at the skipped step)."""
    from tests.helpers import run_train
    from trainer.checkpoint.safe_load import load_tensors

    run_train(
        tmp_path,
        *COMMON,
        "--moe.load_balance_coeff",
        "1e-3",
        "--checkpoint.interval",
        "1",
        "--training.spike_window",
        "2",
        "--training.on_spike",
        "skip",
        nproc=1,
        env={"TRAINER_TEST_SPIKE_LOSS": "0:4:20"},
    )
    assert scalars(tmp_path, "loss_metrics/skipped_steps") == {4: 1.0}
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [
        "step-1",
        "step-2",
        "step-3",
        "step-5",
    ]
    before, after = (load_tensors(tmp_path / "checkpoint" / f"step-{s}") for s in (3, 5))
    keys = [k for k in before if k.endswith("router.expert_bias")]
    assert len(keys) == 2
    moves = [(after[k] - before[k]).abs().max().item() for k in keys]
    assert 0 < max(moves) <= 1e-3 + 1e-9, moves


def test_moe_resumes_bitwise_with_its_bias(moe_runs, tmp_path):
    from tests.helpers import losses, run_train, stopped_after_save

    dump = stopped_after_save(moe_runs / "fsdp2", tmp_path / "resumed", 5)
    out = run_train(dump, *COMMON, nproc=2).stdout
    assert "resumed from" in out and "step-3" in out
    assert losses(dump) == {s: v for s, v in losses(moe_runs / "fsdp2").items() if s > 3}


def test_experts_are_saved_whole_under_ep(moe_runs):
    """Each layer's experts are one full [E, ...] tensor in the checkpoint, whatever the ep."""
    from trainer.checkpoint.safe_load import load_tensors

    saved = load_tensors(moe_runs / "ep2_fsdp2" / "checkpoint" / "step-5")
    ref = load_tensors(moe_runs / "ref" / "checkpoint" / "step-5")
    args = FLAVORS[NARROW]
    experts, width, dim = args.moe.n_experts, args.moe.hidden_dim, args.dim  # 8, 96, 64
    for name in ("w1", "w2", "w3"):
        key = f"model_optim.model.layers.2.feed_forward.experts.{name}"
        assert (
            saved[key].shape
            == ref[key].shape
            == ((experts, width, dim) if name != "w2" else (experts, dim, width))
        )
        torch.testing.assert_close(saved[key], ref[key], atol=1e-4, rtol=0)


def test_a_trained_checkpoint_exports_to_transformers(moe_runs, tmp_path, capsys):
    """Trained under PP 2 without the balancing bias, checkpointed, converted on one process
    (`trainer.convert to-hf`): transformers' Qwen3MoeForCausalLM loads it with no code of
    ours and its logits equal ours. A run trained with the bias (EP 2 x FSDP 2) converts too,
    saying in one line that the bias is left out."""
    from transformers import Qwen3MoeForCausalLM

    from tests.test_hf import convert, max_diff, trainer_model
    from trainer.convert import dcp_fetch, saved_shapes

    ckpt = moe_runs / "pp2_dense_stage" / "checkpoint" / "step-5"
    convert(ckpt, tmp_path / "hf", "--dtype", "float32")
    assert "balancing bias" not in capsys.readouterr().out
    shapes = saved_shapes(str(ckpt))
    ours = trainer_model(NARROW, dcp_fetch(str(ckpt), shapes)(list(shapes)), 64)
    theirs = Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    tokens = torch.randint(
        0, theirs.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0)
    )
    assert max_diff(ours, theirs, tokens) < 1e-4

    convert(moe_runs / "ep2_fsdp2" / "checkpoint" / "step-5", tmp_path / "hf_bias")
    out = capsys.readouterr().out
    assert "warning: the experts' balancing bias (moe.load_balance_coeff; largest |bias| " in out, (
        out
    )
    assert Qwen3MoeForCausalLM.from_pretrained(tmp_path / "hf_bias").config.num_experts == 8


@pytest.mark.parametrize(
    "name, nproc, extra", [("ep4", 4, (EP, "4")), ("fsdp4", 4, ()), ("one_rank", 1, ())]
)
def test_an_ep_checkpoint_resumes_at_another_layout(moe_runs, tmp_path, name, nproc, extra):
    """Saved at EP 2 x FSDP 2 (step 3), resumed at EP 4, at FSDP 4 without ep and on 1 rank:
    the loaded weights and balancing biases are the saved ones (digest), and steps 4-5
    continue the uninterrupted run."""
    from tests.helpers import losses, run_train, stopped_after_save
    from tests.test_tp import saved_digest

    src = moe_runs / "ep2_fsdp2"
    dump = stopped_after_save(src, tmp_path / name, 5)
    out = run_train(
        dump, *COMMON, *extra, nproc=nproc, env={"TRAINER_DEBUG_WEIGHT_DIGEST": "1"}
    ).stdout
    assert "resumed from" in out and "step-3" in out
    digest = saved_digest(src / "checkpoint" / "step-3")
    assert f"loaded weights digest {digest}" in out
    want, have = losses(src), losses(dump)
    assert sorted(have) == [4, 5]
    assert all(abs(have[s] - want[s]) <= 1e-4 for s in have), (have, want)


def test_ep_is_dropless_under_a_skewed_router():
    """Every token routed to experts 0 and 1, both on ep rank 0 of 2: every token's output,
    input gradient and expert gradient equal the local computation with all experts; and so
    under a capacity factor (the static padding rows stay home)."""
    from tests.helpers import torchrun

    out = torchrun(REPO / "tests" / "scripts" / "ep_skew_probe.py", nproc=2, fork=True).stdout
    results = {r["rank"]: r for r in map(json.loads, re.findall(r"result (\{.*?\})", out))}
    assert sorted(results) == [0, 1], out
    for r in results.values():
        assert r["loads"] == [r["tokens"]] * 2 + [0] * 6  # counted before dispatch, top 2
        assert r["out_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6, r
        assert r["tokens_without_grad"] == 0, r
    assert results[0]["expert_grad_norm"] > 0 and results[1]["expert_grad_norm"] == 0
    assert results[0]["expert_grad_diff"] <= 1e-6 * results[0]["expert_grad_norm"]
    # capacity 1.0: 12 of each rank's 96 pairs per expert kept; padding rows never sent
    for r in results.values():
        assert r["capacity_dropped"] == 96 - 2 * 12, r
        assert r["capacity_out_diff"] <= 1e-6 and r["capacity_grad_diff"] <= 1e-6, r
        assert r["capacity_expert_grad_diff"] <= 1e-6 * max(1.0, r["capacity_expert_grad_norm"])


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ("--model.flavor", "debugmodel", "--moe.capacity_factor", "1.25"),
            "moe.capacity_factor is set, but model.flavor 'debugmodel' has no experts; MoE "
            "flavors: debugmodel-moe, debugmodel-moe-narrow, debugmodel-moe-shared, qwen3-30b-a3b",
        ),
        (
            ("--model.flavor", "debugmodel", EP, "2"),
            "parallelism.expert_parallel_degree = 2 is set, but model.flavor 'debugmodel' has no "
            "experts",
        ),
        (
            ("--model.flavor", "debugmodel-moe", "--moe.num_experts", "6", EP, "4"),
            "parallelism.expert_parallel_degree = 4 does not divide the 6 experts of model.flavor "
            "'debugmodel-moe'; valid: 1, 2, 3, 6",
        ),
        (
            ("--model.flavor", "debugmodel-moe", EP, "8"),
            "parallelism.expert_parallel_degree = 8 does not divide dp_shard = 4",
        ),
        (
            ("--model.flavor", "debugmodel-moe", EP, "4", REPLICAS, "2"),
            "parallelism.expert_parallel_degree = 4 does not divide dp_shard = 2 (world size 4, "
            "parallelism.data_parallel_replicate_degree = 2): the expert-parallel ranks are "
            "borrowed from dp_shard; valid: 1, 2",
        ),
        (
            ("--model.flavor", "debugmodel-moe-shared", "--checkpoint.last_save_in_hf", "true"),
            "checkpoint.last_save_in_hf = true, but no Hugging Face architecture holds "
            "model.flavor 'debugmodel-moe-shared': this MoE flavor (shared experts, sigmoid "
            "scores or a routed scale: DeepSeek's router, whose Hugging "
            "Face architecture (DeepseekV3ForCausalLM) also needs MLA",
        ),
        (
            ("--moe.load_balance_coeff", "0.01"),
            "moe.load_balance_coeff is set, but model.flavor 'debugmodel' has no experts",
        ),
        (
            ("--model.flavor", "debugmodel-moe", "--moe.top_k", "9"),
            "moe.top_k = 9 is above the 8 experts of model.flavor 'debugmodel-moe'; valid: 1 to 8",
        ),
    ],
)
def test_bad_moe_settings_are_one_line(args, needle):
    from trainer.config.job import load_config
    from trainer.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(needle)):
        load_config(["--training.device", "cpu", *args]).validate(4)


def test_the_plan_counts_experts_routed_tokens_and_the_all_to_all():
    """configs/qwen3_30b_a3b.toml on 8 GPUs: with EP 8 a rank holds as many expert bytes as
    under FSDP 8 (E / dp_shard experts) but gathers 1/8 of them, pays the all-to-all instead,
    and fits an H100."""
    from trainer.config.job import load_config
    from trainer.plan.comm import comm_volume
    from trainer.plan.memory import memory_plan

    def cfg(ep: int):
        return load_config(
            ["--job.config_file", str(REPO / "configs" / "qwen3_30b_a3b.toml"), EP, str(ep)]
        )

    with_ep, without = memory_plan(cfg(8), 8), memory_plan(cfg(1), 8)
    assert with_ep["parameters"] == without["parameters"]
    assert with_ep["fsdp_block"] < without["fsdp_block"] / 4  # the experts are most of a block
    assert with_ep["total"] < 70 * 2**30  # + the reserve: fits 79.6 GiB (README)
    a2a, none = comm_volume(cfg(8), 8), comm_volume(cfg(1), 8)
    assert none["comm_ep"] == 0.0
    # 8 microbatches x 48 MoE layers x there-and-back x (forward, backward, and the full-AC
    # recompute's dispatch only: half a there-and-back) x top 8 copies of 2 x 4096 tokens x
    # dim 2048 x bf16 x 7/8 leaving the rank
    assert a2a["comm_ep"] == pytest.approx(8 * 48 * 2 * 2.5 * 8 * 8192 * 2048 * 2 * 7 / 8)
    assert a2a["comm_dp_shard"] < none["comm_dp_shard"] / 4


def test_the_experts_are_gathered_before_the_dispatch():
    """EP 2 x FSDP 2 (tests/scripts/ep_prefetch_probe.py): each block prefetches its experts'
    all-gather, so it is issued before the dispatch's all-to-all and the host sync on its split
    sizes; without the prefetch it came after (the probe fails). And with 3 experts per ep rank
    over efsdp 2, FSDP shards the experts' width instead of padding dim 0 (no padded row)."""
    from tests.helpers import REPO, torchrun

    proc = torchrun(REPO / "tests/scripts/ep_prefetch_probe.py", nproc=4, fork=True)
    assert proc.stdout.count("ep prefetch probe ok") == 4, proc.stdout + proc.stderr
    assert proc.stdout.count("expert shard probe ok: (Shard(dim=1), Shard(dim=0))") == 4, (
        proc.stdout + proc.stderr
    )


def test_under_tp_each_rank_routes_only_its_sequence_shard():
    """Qwen3-30B-A3B at TP 2 x EP 4 x FSDP 2 (16 GPUs), traced at its widths, shards and
    sequence through its first 24 of 48 blocks (each block routes alike; half the trace's CPU):
    rank 0 routes the top 8 of its half of the microbatch's tokens, not of all of them (every
    tp rank once ran the whole MoE layer), and the plan still agrees with the trace (at 24
    blocks: 4.9% apart; 12 blocks: 8.8%, the plan's fixed share growing as the blocks' share
    shrinks; all 48 under EP 8: tests/test_plan_trace.py)."""
    from trainer.plan.memory import memory_plan
    from trainer.plan.trace import trace_step

    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "qwen3_30b_a3b.toml"),
            "--parallelism.tensor_parallel_degree",
            "2",
            "--parallelism.expert_parallel_degree",
            "4",
            "--training.local_batch_size",
            "1",
            "--model.n_layers",
            "24",
        ]
    )
    r = trace_step(cfg, 16, keep_all=True)
    tokens = cfg.training.seq_len
    shapes = {a.shape for a in r.allocations}
    assert (tokens // 2 * 8, 2048) in shapes  # the routed copies of this rank's shard
    assert (tokens * 8, 2048) not in shapes  # never the whole sequence's
    # its FLOPs are its share (full AC's recompute aside): a whole MoE layer on every tp rank
    # made it about 2x (the dry run's work line, trainer/plan/work.py)
    assert r.flops / r.ideal_flops <= 1.1 * 4 / 3, (r.flops, r.ideal_flops)
    plan = memory_plan(cfg, 16)
    assert abs(plan["total"] / r.peak - 1) <= 0.10, (plan["total"], r.peak)


@pytest.mark.parametrize("name", ["tp2_ep2", "tp2_ep4"])
def test_moe_under_tp_trains_every_tensor_as_one_rank(moe_runs, name):
    """TP 2 x EP 2 (ep = the tp group) and TP 2 x EP 4 (ep = 2 dp_shard x 2 tp ranks): each tp
    rank computes its tokens' share of the router's gradient, summed over tp once a step, and
    sends its tokens to the experts split over ep x tp, whose gradients the all-to-all's
    backward brings whole (divided by dp, not summed over tp). Every parameter and AdamW
    moment after 5 steps equals one rank's: a missing router sum, experts summed over tp
    too, or a divisor off by tp (the experts' moments 2x or 4x off; AdamW's update hides that
    from the losses) all fail here."""
    from trainer.checkpoint.safe_load import load_tensors

    got = load_tensors(moe_runs / name / "checkpoint" / "step-5")
    ref = load_tensors(moe_runs / "ref" / "checkpoint" / "step-5")
    keys = [k for k in ref if torch.is_floating_point(ref[k])]
    assert (
        sum(k.endswith(("experts.w1", "experts.w1.exp_avg", "experts.w1.exp_avg_sq")) for k in keys)
        == 6
    )  # 2 MoE blocks x (the weight, 2 moments)
    for key in keys:
        torch.testing.assert_close(
            got[key], ref[key], rtol=0, atol=1e-4 * ref[key].abs().max().item(), msg=key
        )


@pytest.mark.parametrize("src, dst", [("tp2_ep4", "one"), ("ref", "tp2_ep4")])
def test_checkpoints_move_between_one_rank_and_tp2_ep4(moe_runs, tmp_path, src, dst):
    """DCP reshards the experts between whole [E, ...] tensors on one rank and 1/4 of them per
    rank over ep = dp_shard x tp: each layout resumes the other's step 3 with the
    uninterrupted run's losses at steps 4 and 5."""
    import shutil

    from tests.helpers import run_train

    shutil.copytree(moe_runs / src, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-5")
    shutil.rmtree(tmp_path / "run" / "tb")
    extra, nproc = ((), 1) if dst == "one" else ((EP, "4", TP, "2"), 4)
    out = run_train(tmp_path / "run", *COMMON, *extra, nproc=nproc).stdout
    assert "(step 3)" in out, out
    want, got = scalars(moe_runs / "ref", LOSS), scalars(tmp_path / "run", LOSS)
    assert sorted(got) == [4, 5], got
    assert all(abs(got[s] - want[s]) <= 1e-4 * abs(want[s]) for s in got), (got, want)
