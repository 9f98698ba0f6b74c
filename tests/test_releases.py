"""The released config.json files (tests/data/releases/, each with its source in SOURCES.md), as
users download them:

- each fits the flavor the docs say loads it: the import's config check passes, and the
  tensors transformers builds from that config.json (on the meta device, its layers cut to a
  few of each kind) are by name and shape the ones our import reads and our export writes;
- the released Qwen3-Next, Qwen3.5, DeepSeek-V3 and Kimi K2 configs, shrunk by one rule (every
  width and count small, every setting that changes the computation kept: RoPE and YaRN,
  norms, routing, layer pattern), make a folder of random weights whose import gives
  transformers' logits from the same folder, in fp32.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.helpers import REPO
from trainer.models.build import build_model
from trainer.models.flavors import FLAVORS, model_args

transformers = pytest.importorskip("transformers")

RELEASES = REPO / "tests" / "data" / "releases"
# release folder -> (our flavor, blocks kept for the shape check)
FLAVOR_OF = {
    "llama-3.1-8b": ("llama3.1-8B", 2),
    "llama-3.2-1b": ("llama3.2-1B", 2),
    "qwen3-30b-a3b": ("qwen3-30b-a3b", 2),
    "deepseek-v3": ("deepseek-v3-671b", 4),  # 3 dense blocks, then MoE
    "kimi-k2-instruct-0711": ("kimi-k2", 2),
    "qwen3-next-80b-a3b-thinking": ("qwen3-next-80b-a3b", 4),  # 3 DeltaNet, 1 attention
    "qwen3.5-35b-a3b": ("qwen3.5-35b-a3b", 4),
}


def released(name: str) -> dict:
    return json.loads((RELEASES / name / "config.json").read_text())


def text_of(cfg: dict) -> dict:
    """The text model's config (Qwen3.5's release wraps it with a vision tower's)."""
    return cfg.get("text_config", cfg)


def hf_model_class(cfg: dict):
    t = text_of(cfg)
    kind = t["model_type"]
    if kind == "qwen3_5_moe_text":
        return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM
    if "DeepseekV3ForCausalLM" in cfg.get("architectures", []):  # Kimi K2: its own model_type
        return transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM
    auto = transformers.AutoConfig.for_model(kind).__class__
    return auto, transformers.AutoModelForCausalLM


def build_theirs(cfg: dict):
    config_cls, model_cls = hf_model_class(cfg)
    t = {k: v for k, v in text_of(cfg).items() if k not in ("architectures", "auto_map")}
    if config_cls is transformers.DeepseekV3Config:  # Kimi K2's remote code is DeepSeek-V3's
        t["model_type"] = "deepseek_v3"
    config = config_cls.from_dict(t)
    if model_cls is transformers.AutoModelForCausalLM:
        return model_cls.from_config(config)
    return model_cls(config)


def saved_form(model) -> dict:
    """The tensors of `model` as save_pretrained writes them (transformers 5 holds the experts
    fused in memory and writes them one per expert, as the releases are)."""
    from transformers.modeling_utils import (
        remove_tied_weights_from_state_dict,
        revert_weight_conversion,
    )

    return revert_weight_conversion(
        model, remove_tied_weights_from_state_dict(model.state_dict(), model)
    )


def cut(cfg: dict, blocks: int) -> dict:
    """The release's config with its first `blocks` layers (a release's layer_types too)."""
    cfg = json.loads(json.dumps(cfg))
    t = text_of(cfg)
    t["num_hidden_layers"] = blocks
    if "layer_types" in t:
        t["layer_types"] = t["layer_types"][:blocks]
    t["num_nextn_predict_layers"] = 0
    return cfg


def our_release_tensors(name: str, args) -> dict[str, tuple]:
    """The names and shapes our export writes for `args` (what our import reads)."""
    from trainer.hf.mapping import export_shapes, hf_tensors

    if args.hybrid is not None:
        from trainer.models.qwen3_next.hf import hybrid_shapes, to_release

        family = text_of(released(name))["model_type"]
        meta = {k: torch.empty(s, device="meta") for k, s in hybrid_shapes(args).items()}
        out = to_release(meta, args, "qwen3_5_moe_text" if "3_5" in family else "qwen3_next")
    else:
        out = {}
        for key, shape in export_shapes(args).items():
            out.update(hf_tensors(key, torch.empty(shape, device="meta"), args))
    return {k: tuple(v.shape) for k, v in out.items()}


@pytest.mark.parametrize("name", sorted(FLAVOR_OF))
def test_each_release_fits_its_flavor_by_settings_names_and_shapes(name, tmp_path):
    from trainer.hf.mapping import check_hf_config

    flavor, blocks = FLAVOR_OF[name]
    cfg = released(name)
    t = text_of(cfg)
    args = model_args(flavor, vocab_size=t["vocab_size"], n_layers=blocks, mtp_layers=0)
    if args.hybrid is not None:
        from trainer.models.qwen3_next.hf import check_release_config

        check_release_config(cfg, FLAVORS[flavor], str(tmp_path), flavor)
    else:
        check_hf_config(cfg, FLAVORS[flavor], str(tmp_path), flavor)
    with torch.device("meta"):
        theirs = build_theirs(cut(cfg, blocks))
    want = {k: tuple(v.shape) for k, v in saved_form(theirs).items() if "rotary_emb" not in k}
    got = our_release_tensors(name, args)
    assert sorted(got) == sorted(want), set(got) ^ set(want)
    assert got == want


# ----------------------------------------------------------------- logits on a shrunk release

SMALL = dict(hidden_size=64, vocab_size=256, num_attention_heads=4, intermediate_size=96)
SMALL_MLA = dict(
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
)
SMALL_HYBRID = dict(
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)


def shrink(cfg: dict) -> dict:
    """The rule: widths and counts small; the first 4 layers (a hybrid's pattern holds one full
    attention layer in them; DeepSeek-V3 keeps 1 dense and 3 MoE layers); expert groups kept
    as groups of 2 where the release has groups; RoPE, YaRN, norms and routing as released."""
    cfg = cut(cfg, 4)
    t = text_of(cfg)
    t.update(SMALL)
    if "kv_lora_rank" in t:
        t.update(SMALL_MLA)
        t["first_k_dense_replace"] = 1
        if t["n_group"] > 1:
            t["n_group"], t["topk_group"] = 4, 2
    else:
        t.update(SMALL_HYBRID)
    return cfg


def shrink_args(args):
    """Our flavor under the same rule (for the families whose import takes a flavor)."""
    m, moe = args.mla, args.moe
    grouped = moe.n_group > 1
    return dataclasses.replace(
        args,
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=256,
        explicit_hidden_dim=96,
        mtp_layers=0,
        mla=dataclasses.replace(
            m,
            q_lora_rank=48,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        ),
        moe=dataclasses.replace(
            moe,
            n_experts=8,
            top_k=2,
            hidden_dim=32,
            first_dense_layers=1,
            n_group=4 if grouped else 1,
            topk_group=2 if grouped else 1,
        ),
    )


def randomise(model) -> None:
    with torch.no_grad():  # norms away from 1, a balancing bias away from 0: every one counts
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if name.endswith("norm.weight") else p.normal_(0, 0.05)
            if "A_log" in name or "dt_bias" in name or "layernorm" in name:
                p.uniform_(-0.5, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)


@pytest.mark.parametrize(
    "name",
    ["qwen3-next-80b-a3b-thinking", "qwen3.5-35b-a3b", "deepseek-v3", "kimi-k2-instruct-0711"],
)
def test_a_shrunk_release_imports_with_transformers_logits(name, tmp_path):
    from trainer.hf.load import load_hf

    torch.manual_seed(0)
    cfg = shrink(released(name))
    theirs = build_theirs(cfg).float()
    randomise(theirs)
    theirs.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(text_of(cfg)))  # as released, not as saved
    flavor, _ = FLAVOR_OF[name]
    if FLAVORS[flavor].hybrid is not None:
        from trainer.models.qwen3_next.hf import args_from_config

        args = args_from_config(cfg)
    else:
        args = shrink_args(model_args(flavor, vocab_size=256, max_seq_len=64))
    ours = build_model(dataclasses.replace(args, max_seq_len=64))
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    load_hf(ours, str(tmp_path), flavor=flavor, log=lambda line: None)
    tokens = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = theirs.eval()(tokens).logits
        got = ours.eval()(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
