"""DeepSeek-V3's architecture (docs/deepseek.md): multi-head latent attention, group-limited
routing, multi-token prediction, DeepseekV3ForCausalLM in and out.

In one process: the routing rule, a random tiny DeepseekV3ForCausalLM saved by transformers
(MLA with and without a query latent, 2 expert groups, a shared expert, a first dense layer,
a non-zero score-correction bias) imports with transformers' logits, one training step (loss,
gradients, AdamW) equals transformers', the flavor sizes, the traced dry run of the 671B and
Kimi K2 configs. Through run_train.sh (configs/debug_dsv3.toml, fp32, block_causal on the
stdlib corpus, one MTP module, 5 steps): EP 2 x FSDP 2, TP 2 x FSDP 2, CP 2 x EP 2 and PP 2 x
FSDP 2 give the 1-rank losses, MTP losses and gradient norms; the EP run's export (its MTP
module as layer 4) loads in transformers with our logits; its checkpoint resumes at EP 4 and
on one rank; bad settings are one line each.
"""

import dataclasses
import json
import math
import subprocess

import pytest
import torch

from tests.helpers import REPO, fork_python, losses, run_train, scalars, stopped_after_save
from trainer.errors import ConfigError
from trainer.models.args import MoEArgs
from trainer.models.build import build_model
from trainer.models.common.moe import choose
from trainer.models.common.rope import YarnScaling
from trainer.models.flavors import FLAVORS, model_args

CONFIG = str(REPO / "configs" / "debug_dsv3.toml")


def test_group_limited_routing_picks_within_the_best_groups():
    """4 experts in 2 groups, 1 group kept: group {2, 3} has the larger sum of its two best
    scores (0.5 + 0.5 > 0.9 + 0.0), so the top 2 are experts 2 and 3, not expert 0 (0.9)."""
    moe = MoEArgs(n_experts=4, top_k=2, n_group=2, topk_group=1)
    scores = torch.tensor([[0.9, 0.0, 0.5, 0.5]])
    assert sorted(choose(scores, moe)[0].tolist()) == [2, 3]
    plain = dataclasses.replace(moe, n_group=1, topk_group=1)
    assert sorted(choose(scores, plain)[0].tolist()) == [0, 2]


def test_flavor_sizes():
    """As released: DeepSeek-V3 671B with 37B active (no MTP), Kimi K2 1.03T with 32.9B active,
    Moonlight 16B with 2.9B active."""
    for name, total, active in (
        ("deepseek-v3-671b", 671.0, 37.6),
        ("kimi-k2", 1026.4, 32.9),
        ("deepseek-v3-16b", 15.96, 2.91),
    ):
        a = FLAVORS[name]
        assert a.num_params() / 1e9 == pytest.approx(total, abs=0.1), name
        assert a.num_params(active=True) / 1e9 == pytest.approx(active, abs=0.1), name


def hf_config(args, vocab: int, q_lora: int):
    from transformers import DeepseekV3Config

    m, moe = args.mla, args.moe
    return DeepseekV3Config(
        vocab_size=vocab,
        hidden_size=args.dim,
        intermediate_size=args.hidden_dim,
        moe_intermediate_size=moe.hidden_dim,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_heads,
        n_shared_experts=moe.n_shared_experts,
        n_routed_experts=moe.n_experts,
        routed_scaling_factor=moe.route_scale,
        kv_lora_rank=m.kv_lora_rank,
        q_lora_rank=q_lora or None,
        qk_rope_head_dim=m.qk_rope_head_dim,
        v_head_dim=m.v_head_dim,
        qk_nope_head_dim=m.qk_nope_head_dim,
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        num_experts_per_tok=moe.top_k,
        first_k_dense_replace=moe.first_dense_layers,
        norm_topk_prob=True,
        max_position_embeddings=64,
        rms_norm_eps=args.norm_eps,
        rope_theta=args.rope_theta,
        rope_scaling=hf_config_json(args)["rope_scaling"],
    )


def hf_config_json(args):
    from trainer.hf.mapping import hf_config as ours

    return ours(args, dtype="float32", bos_id=None, eos_id=None)


# YaRN over 16 original positions (the test's 48 tokens reach past them), with mscale and
# mscale_all_dim apart (DeepSeek-V2-Lite's kind): cos/sin and the softmax both scaled
YARN = YarnScaling(
    factor=4.0, original_max_position_embeddings=16, mscale=1.0, mscale_all_dim=0.707
)


def random_pair(tmp_path, q_lora: int = 32, yarn=None):
    """(transformers' DeepseekV3ForCausalLM with random weights: norms away from 1, a non-zero
    e_score_correction_bias; saved by transformers and loaded into ours through
    checkpoint.initial_load_in_hf's code, ours)."""
    from transformers import DeepseekV3ForCausalLM

    from trainer.hf.load import load_hf

    torch.manual_seed(0)
    args = model_args("debugmodel-dsv3", vocab_size=256, max_seq_len=64)
    args = dataclasses.replace(
        args, mla=dataclasses.replace(args.mla, q_lora_rank=q_lora), rope_scaling=yarn
    )
    theirs = DeepseekV3ForCausalLM(hf_config(args, 256, q_lora)).float()
    if yarn is not None:  # transformers took the scaling: its table differs from plain RoPE
        assert theirs.model.rotary_emb.rope_type == "yarn"
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.05)
        for name, b in theirs.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    theirs.save_pretrained(tmp_path)
    ours = build_model(args)
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    load_hf(ours, str(tmp_path), flavor="debugmodel-dsv3", log=lambda line: None)
    return theirs, ours


@pytest.mark.parametrize("q_lora, yarn", [(32, None), (0, None), (32, YARN)])
def test_a_transformers_model_imports_with_its_logits(tmp_path, q_lora, yarn):
    """Random weights, saved by transformers, loaded through checkpoint.initial_load_in_hf's
    code: logits within 1e-4; also with YaRN-scaled RoPE (as DeepSeek-V3 and Kimi K2 are
    released)."""
    theirs, ours = random_pair(tmp_path, q_lora, yarn)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (theirs.eval()(tokens).logits - ours.eval()(tokens)).abs().max().item()
    assert diff < 1e-4, diff
    bias = ours.layers["2"].feed_forward.router.expert_bias
    assert bias.abs().max() > 0  # the routing bias came in


def theirs_of(name: str, tensors: dict, args):
    """transformers' tensor (parameter or gradient) for our parameter `name`: its stacked
    experts are gate_up_proj [E, 2 I, D] (gate rows first) and down_proj [E, D, I]."""
    from trainer.hf.mapping import hf_name

    if ".feed_forward.experts." in name:
        layer, w = name.split(".")[1], name.rsplit(".", 1)[1]
        prefix = f"model.layers.{layer}.mlp.experts."
        if w == "w2":
            return tensors[prefix + "down_proj"]
        gate_up = tensors[prefix + "gate_up_proj"]
        inter = args.moe.hidden_dim
        return gate_up[:, :inter] if w == "w1" else gate_up[:, inter:]
    return tensors[hf_name(name, args)]


def test_one_training_step_equals_transformers(tmp_path):
    """One step on the same batch, fp32: our training loss (the chunked loss over the summed
    tokens / count) against cross-entropy of transformers' logits; every gradient; then the
    trainer's AdamW (build_optimizer: fused on the CPU) against torch's for-loop AdamW on
    transformers' parameters. eps 1e-4 keeps the first step's g / (|g| + eps) away from the
    sign of near-zero gradients, which rounding could flip."""
    import torch.nn.functional as F

    from trainer.config.job import load_config
    from trainer.models.common.loss import build_loss
    from trainer.optim.optimizer import build_optimizer

    theirs, ours = random_pair(tmp_path)
    theirs.train(), ours.train()
    cfg = load_config(
        ["--job.config_file", CONFIG, "--optimizer.lr", "1e-2", "--optimizer.eps", "1e-4"]
    ).optimizer
    tokens = torch.randint(0, 256, (2, 49), generator=torch.Generator().manual_seed(2))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    loss = ours(inputs, labels, build_loss("chunked", 32)) / labels.numel()
    ref = F.cross_entropy(theirs(inputs).logits.flatten(0, 1), labels.flatten())
    assert abs(loss.item() - ref.item()) < 1e-6, (loss.item(), ref.item())
    loss.backward()
    ref.backward()
    grads = {n: p.grad for n, p in theirs.named_parameters()}
    for name, p in ours.named_parameters():
        want = theirs_of(name, grads, ours.args)
        assert (p.grad - want).abs().max() <= 1e-5 * want.abs().max() + 1e-9, name
    mine = build_optimizer(ours, cfg)
    other = torch.optim.AdamW(
        theirs.parameters(),
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
        foreach=False,
    )
    before = {n: p.detach().clone() for n, p in ours.named_parameters()}
    mine.step(), other.step()
    params = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        want = theirs_of(name, params, ours.args)
        assert (p - want).abs().max() < 1e-3 * cfg.lr, name
        assert (p - before[name]).abs().max() > 1e-3, name  # each tensor moved (lr 1e-2)


def test_a_scaled_rope_folder_loads_only_as_yarn_and_only_into_its_flavor(tmp_path):
    from trainer.hf.mapping import check_hf_config

    args = model_args("debugmodel-dsv3")
    cfg = {
        "model_type": "deepseek_v3",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "rope_scaling": {"rope_type": "dynamic", "factor": 4},
    }
    with pytest.raises(ConfigError, match="'dynamic'-scaled"):
        check_hf_config(cfg, args, str(tmp_path), "debugmodel-dsv3")
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 40}  # a flavor without YaRN
    with pytest.raises(ConfigError, match="rope_scaling is .'yarn', 40.0"):
        check_hf_config(cfg, args, str(tmp_path), "debugmodel-dsv3")
    # the released DeepSeek-V3 config.json's RoPE fits the deepseek-v3-671b flavor
    cfg = {
        "model_type": "deepseek_v3",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "max_position_embeddings": 163840,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_experts_per_tok": 8,
        "rope_scaling": {
            "beta_fast": 32,
            "beta_slow": 1,
            "factor": 40,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    }
    check_hf_config(cfg, FLAVORS["deepseek-v3-671b"], str(tmp_path), "deepseek-v3-671b")
    # transformers 4.x would take 65536 / 4096 = 16 as the factor, 5.x 40: refused
    cfg["max_position_embeddings"] = 65536
    with pytest.raises(ConfigError, match="transformers 4.x takes as the factor"):
        check_hf_config(cfg, FLAVORS["deepseek-v3-671b"], str(tmp_path), "deepseek-v3-671b")
    cfg = {
        "model_type": "deepseek_v3",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "rope_interleave": False,
    }
    with pytest.raises(ConfigError, match="rope_interleave = false"):
        check_hf_config(cfg, args, str(tmp_path), "debugmodel-dsv3")


@pytest.mark.parametrize("config, ngpu", [("deepseek_v3_671b", 8), ("kimi_k2", 8)])
def test_the_full_size_configs_are_traced_to_fit_h100s(config, ngpu):
    """The real step of rank 0 of 512 on fake tensors: fits an H100 with the reserve, the plan
    within 10% of the trace (MTP blocks, MLA's replicated latents and the experts' groups
    counted), in well under two minutes."""
    python, env = fork_python()
    out = subprocess.run(
        [
            python,
            "-m",
            "trainer.plan",
            "--config",
            str(REPO / "configs" / f"{config}.toml"),
            "--ngpu",
            str(ngpu),
            "--nnodes",
            "64",
            "--gpu",
            "h100",
            "--host-gib",
            "2048",
            "--trace",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "trace verdict: FITS" in text and "agreement: the plan is within 10%" in text, text
    assert "largest tensor:" in text


# ------------------------------------------------------------------------------ end to end

# the debug DeepSeek-V3's first 3 blocks: its dense block 0 and 2 MoE blocks (+ the MTP module)
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
    "--model.attn_mask_type",
    "block_causal",
    "--training.steps",
    "5",
    "--checkpoint.interval",
    "3",
    "--checkpoint.keep_latest_k",
    "0",
    "--validation.enable",
    "false",
)
EP = "--parallelism.expert_parallel_degree"
LAYOUTS = {  # name: (ranks, overrides); the config's EP 2 is set per layout
    "ref": (1, (EP, "1")),
    "ep2_fsdp2": (4, (EP, "2", "--checkpoint.last_save_in_hf", "true")),
    "tp2_fsdp2": (4, (EP, "1", "--parallelism.tensor_parallel_degree", "2")),
    # CP 2 x EP 2: FSDP over dp_shard 2 x cp 2, the experts split over ep 2 (borrowed from
    # dp_shard) and sharded over efsdp x cp
    "cp2_ep2": (4, (EP, "2", "--parallelism.context_parallel_degree", "2")),
    "pp2_fsdp2": (4, (EP, "1", "--parallelism.pipeline_parallel_degree", "2")),
}
TAGS = ("loss_metrics/global_avg_loss", "loss_metrics/mtp_loss", "grad_norm")


@pytest.fixture(scope="module")
def dsv3_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    out = {}
    for name, (nproc, overrides) in LAYOUTS.items():
        proc = run_train(root / name, *COMMON, *overrides, nproc=nproc, config=CONFIG)
        out[name] = (root / name, proc.stdout)
    return out


def close(have: dict, want: dict, tol=1e-4) -> bool:
    return all(abs(have[s] - want[s]) <= tol * max(1.0, abs(want[s])) for s in want)


@pytest.mark.parametrize("name", ["ep2_fsdp2", "tp2_fsdp2", "cp2_ep2", "pp2_fsdp2"])
def test_each_layout_trains_as_one_rank(dsv3_runs, name):
    ref, got = dsv3_runs["ref"][0], dsv3_runs[name][0]
    for tag in TAGS:
        want, have = scalars(ref, tag), scalars(got, tag)
        assert sorted(have) == [1, 2, 3, 4, 5], (tag, have)
        assert close(have, want), (tag, have, want)
    mtp, main = scalars(ref, TAGS[1]), scalars(ref, TAGS[0])
    assert mtp[5] < mtp[1] and main[5] < main[1]  # both heads learn
    assert mtp != main
    assert "multi-head latent attention (q_lora_rank 32" in dsv3_runs[name][1]


def test_the_export_loads_in_transformers_with_our_logits(dsv3_runs):
    """The EP 2 x FSDP 2 run's last_save_in_hf folder (its balancing bias moved): transformers
    loads it with no code of ours (skipping the MTP module, layer 3), and its logits equal the
    checkpoint's model's; the MTP module is there under the release's names."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from trainer.convert import dcp_fetch, saved_shapes

    dump, stdout = dsv3_runs["ep2_fsdp2"]
    assert "module(s) 0..0 exported as layer(s) 3..3 under the release's names" in stdout
    hf = json.loads((dump / "hf" / "config.json").read_text())
    assert hf["architectures"] == ["DeepseekV3ForCausalLM"] and hf["n_group"] == 2
    assert hf["num_nextn_predict_layers"] == 1
    theirs = AutoModelForCausalLM.from_pretrained(dump / "hf", dtype=torch.float32).eval()
    ckpt = str(dump / "checkpoint" / "step-5")
    shapes = saved_shapes(ckpt)
    state = dcp_fetch(ckpt, shapes)(list(shapes))
    assert max(v.abs().max() for k, v in state.items() if k.endswith("expert_bias")) > 0
    ours = build_model(
        model_args("debugmodel-dsv3", vocab_size=8192, max_seq_len=64, mtp_layers=1, n_layers=3)
    )
    ours.to_empty(device="cpu")
    ours.init_weights(0)  # the RoPE tables
    ours.load_state_dict(state, strict=True)
    tokens = torch.randint(0, 8192, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours.eval()(tokens)).abs().max() < 1e-4
    with safe_open(dump / "hf" / "model.safetensors", "pt") as f:
        assert torch.equal(
            f.get_tensor("model.layers.3.eh_proj.weight"), state["mtp.0.proj.weight"]
        )
        assert torch.equal(
            f.get_tensor("model.layers.3.mlp.experts.7.down_proj.weight"),
            state["mtp.0.block.feed_forward.experts.w2"][7],
        )


@pytest.mark.parametrize("name, nproc, extra", [("ep4", 4, (EP, "4")), ("one_rank", 1, (EP, "1"))])
def test_an_ep_checkpoint_resumes_at_ep4_and_on_one_rank(dsv3_runs, tmp_path, name, nproc, extra):
    src = dsv3_runs["ep2_fsdp2"][0]
    dump = stopped_after_save(src, tmp_path / name, 5)
    out = run_train(dump, *COMMON, *extra, nproc=nproc, config=CONFIG).stdout
    assert "resumed from" in out and "step-3" in out
    for tag in TAGS:
        want, have = scalars(src, tag), scalars(dump, tag)
        assert sorted(have) == [4, 5] and close(have, {s: want[s] for s in (4, 5)}), tag
    assert losses(dump)


@pytest.mark.parametrize(
    "args, needle",
    [
        (("--moe.topk_group", "3"), "moe.topk_group = 3 must be between 1 and moe.n_group = 2"),
        (("--moe.n_group", "3"), "moe.n_group = 3: the 8 experts (moe.num_experts) do not divide"),
        (("--moe.n_group", "4", "--moe.top_k", "3"), "moe.top_k = 3 needs at most moe.topk_group"),
        (("--model.name", "llama3"), "model.flavor = 'debugmodel-dsv3' is a deepseek_v3 model"),
    ],
)
def test_bad_settings_are_one_line(tmp_path, args, needle):
    proc = run_train(tmp_path, *args, config=CONFIG, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("config error: ") and needle in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_mtp_with_an_export_that_cannot_hold_it_is_refused():
    """A Llama or Qwen3-MoE flavor with MTP modules and a Hugging Face export or import:
    refused in one config line that says what the checkpoints keep; a deepseek_v3 flavor
    exports them (as the release's layers num_hidden_layers + k). `trainer.convert to-hf`
    says the same."""
    from trainer.config.job import load_config
    from trainer.hf.mapping import export_problem

    base = [
        "--job.config_file",
        str(REPO / "configs" / "debug_model.toml"),
        "--model.mtp_layers",
        "1",
    ]
    for key in ("last_save_in_hf", "initial_load_in_hf"):
        with pytest.raises(
            ConfigError,
            match=f"checkpoint.{key} = true with model.mtp_layers "
            "= 1, but LlamaForCausalLM has no multi-token prediction modules",
        ):
            load_config(
                [
                    *base,
                    f"--checkpoint.{key}",
                    "true",
                    "--checkpoint.initial_load_path",
                    "/some/hf/folder",
                ]
            )
    load_config(base)  # MTP without Hugging Face: fine
    load_config(["--job.config_file", CONFIG, "--checkpoint.last_save_in_hf", "true"])
    moe = model_args("debugmodel-moe", mtp_layers=1)
    assert "Qwen3MoeForCausalLM has no multi-token" in export_problem(moe)


def test_the_released_yarn_is_the_flavors_and_none_drops_it():
    """deepseek-v3-671b and kimi-k2 carry YaRN as released (so their folders load exactly);
    model.rope_scaling = 'none' trains plain RoPE (DeepSeek pretrained at 4K without it)."""
    from trainer.config.job import load_config
    from trainer.models.common.attention import attention_args
    from trainer.models.common.rope import DEEPSEEK_V3_YARN, KIMI_K2_YARN

    base = ["--job.config_file", str(REPO / "configs" / "kimi_k2.toml")]  # pretrains: none
    for extra, want in (([], None), (["--model.rope_scaling", "flavor"], KIMI_K2_YARN)):
        cfg = load_config([*base, *extra])
        got = model_args(cfg.model.flavor, **attention_args(cfg.model, "cuda")).rope_scaling
        assert got == want
    assert FLAVORS["deepseek-v3-671b"].rope_scaling == DEEPSEEK_V3_YARN
    # the released config.json values (Kimi K2: factor 32, beta_fast and beta_slow 1)
    released = {
        "deepseek-v3-671b": (40.0, 4096, 32.0, 1.0, 1.0, 1.0),
        "kimi-k2": (32.0, 4096, 1.0, 1.0, 1.0, 1.0),
    }
    for flavor, want in released.items():
        y = FLAVORS[flavor].rope_scaling
        assert (
            y.factor,
            y.original_max_position_embeddings,
            y.beta_fast,
            y.beta_slow,
            y.mscale,
            y.mscale_all_dim,
        ) == want, flavor
    assert DEEPSEEK_V3_YARN.softmax_gain == pytest.approx((0.1 * math.log(40) + 1) ** 2)


def test_kimi_k2_0905s_longer_yarn_is_two_keys_and_the_error_says_them(tmp_path):
    """Kimi K2 0905 is K2's architecture with YaRN factor 64 (256K context): its folder is
    refused under the flavor's factor 32 with the keys that fit it, and fits with them."""
    from trainer.config.job import load_config
    from trainer.hf.mapping import check_hf_config
    from trainer.models.common.attention import attention_args

    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "kimi_k2",
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "max_position_embeddings": 262144,
        "first_k_dense_replace": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.827,
        "norm_topk_prob": True,
        "num_experts_per_tok": 8,
        "rope_scaling": {
            "beta_fast": 1.0,
            "beta_slow": 1.0,
            "factor": 64.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096,
            "type": "yarn",
        },
    }
    keys = (
        "model.rope_scaling = 'yarn', model.yarn_factor = 64, "
        "model.yarn_original_max_position_embeddings = 4096"
    )
    with pytest.raises(ConfigError) as e:
        check_hf_config(cfg, FLAVORS["kimi-k2"], str(tmp_path), "kimi-k2")
    assert keys in str(e.value), e.value
    base = ["--job.config_file", str(REPO / "configs" / "kimi_k2.toml")]
    yarn = ["--model.rope_scaling", "yarn", "--model.yarn_factor", "64"]
    job = load_config([*base, *yarn])
    args = model_args(job.model.flavor, **attention_args(job.model, "cuda"))
    assert args.rope_scaling == dataclasses.replace(FLAVORS["kimi-k2"].rope_scaling, factor=64.0)
    check_hf_config(cfg, args, str(tmp_path), "kimi-k2")
    with pytest.raises(ConfigError, match="model.yarn_factor = 64.0 applies only with"):
        load_config([*base, "--model.yarn_factor", "64"])
    with pytest.raises(ConfigError, match="has no YaRN of its own, needs model.yarn_factor"):
        load_config([*base, *yarn, "--model.flavor", "debugmodel-dsv3"])


def test_mla_dims_that_do_not_add_up_are_one_line():
    from trainer.models.deepseek_v3.args import MLAArgs

    for bad in (
        {"qk_rope_head_dim": 7},
        {"kv_lora_rank": 0},
        {"v_head_dim": 0},
        {"q_lora_rank": -1},
    ):
        with pytest.raises(ConfigError, match="model MLA dims do not add up"):
            MLAArgs(**bad).validate()
    MLAArgs(q_lora_rank=0).validate()


def test_cached_generation_equals_the_full_forward():
    """trainer.generate's KV cache under MLA (per-head keys, narrower values): the logits of a
    prompt fed in two pieces equal one full forward's; the MTP module does not take part."""
    from trainer.generate import KVCache, forward_cached

    model = build_model(model_args("debugmodel-dsv3", vocab_size=256, max_seq_len=32, mtp_layers=1))
    model.to_empty(device="cpu")
    model.init_weights(0)
    model.eval()
    tokens = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, 1, 32)
    with torch.no_grad():
        pieces = torch.cat(
            [
                forward_cached(model, tokens[:, :12], cache),
                forward_cached(model, tokens[:, 12:], cache),
            ],
            dim=1,
        )
        assert (pieces - model(tokens)).abs().max() < 1e-5
