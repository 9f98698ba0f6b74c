"""DeepSeek-V3 (and Kimi K2, Moonlight) between this trainer and Hugging Face's
DeepseekV3ForCausalLM: the names of MLA's projections, the shared experts and the router's
score-correction bias, and config.json.

The layout needs no permutation: DeepSeek released its weights with the RoPE channels in consecutive
pairs (`rope_interleave = true`, transformers' default), the pairs trainer/models/common/layers.py
rotates. A folder with `rope_interleave = false` (rotate-half layout) or RoPE scaled otherwise than
by YaRN (what DeepSeek-V3 and Kimi K2 are released with: trainer/models/common/layers.py) is refused
in one line rather than loaded into different logits. The balancing bias of training
(`moe.load_balance_coeff`) is DeepSeek-V3's `e_score_correction_bias`: it is exported and imported,
so routing is the same on both sides.

Multi-token prediction module k (0-based) is the release's layer `num_hidden_layers + k`
(`num_nextn_predict_layers` of them): `enorm`, `hnorm`, `eh_proj` (applied to [enorm(emb);
hnorm(h)], our MTPModule's order), a decoder block under the usual names, `shared_head.norm`,
and copies of the embedding (`embed_tokens`) and head (`shared_head.head`). transformers'
DeepseekV3ForCausalLM does not build those layers and skips them when it loads.
"""

from __future__ import annotations

import os
import re

from trainer.errors import ConfigError
from trainer.hf.mapping import _LAYER as DECODER_LAYER
from trainer.hf.mapping import DecoderHF, yarn_ratio
from trainer.models.args import ModelArgs

MLA_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "feed_forward.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "feed_forward.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "feed_forward.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
    "feed_forward.router.expert_bias": "mlp.gate.e_score_correction_bias",
}
# An MTP module's own parameters (under `mtp.k.`) -> the release's names (under its layer)
MTP_OWN = {
    "embed_norm.weight": "enorm.weight",
    "hidden_norm.weight": "hnorm.weight",
    "proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
# The copies of the main model's tensors that each MTP layer of the release holds
MTP_COPIES = {
    "embed_tokens.weight": "model.embed_tokens.weight",
    "shared_head.head.weight": "lm_head.weight",
}
_MTP_RE = re.compile(r"^mtp\.(\d+)\.(.+)$")


def mtp_layer(args: ModelArgs, k: int) -> int:
    """The release's layer number of MTP module k (0-based)."""
    return args.n_layers + k


def mtp_depth(name: str) -> int | None:
    """k for a parameter under `mtp.k.`, else None."""
    m = _MTP_RE.match(name)
    return None if m is None else int(m.group(1))


def mtp_release_name(name: str, args: ModelArgs) -> str:
    """`mtp.k.block.X` -> `layers.{L + k}.X` (the block, then mapped as a layer's);
    `mtp.k.proj.weight` etc. -> the release's full key; any other name unchanged."""
    m = _MTP_RE.match(name)
    if m is None:
        return name
    layer, rest = mtp_layer(args, int(m.group(1))), m.group(2)
    if rest in MTP_OWN:
        return f"model.layers.{layer}.{MTP_OWN[rest]}"
    if rest.startswith("block."):
        return f"layers.{layer}.{rest[len('block.') :]}"
    raise KeyError(f"no Hugging Face name for parameter {name!r}")


def mtp_copies(hf_key: str, args: ModelArgs) -> list[str]:
    """The keys under which the MTP layers repeat the main model's tensor `hf_key`."""
    depths = args.mtp_layers
    return [
        f"model.layers.{mtp_layer(args, k)}.{copy}"
        for k in range(depths)
        for copy, main in MTP_COPIES.items()
        if main == hf_key
    ]


def mla_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(name under `layers.i.`, shape) of one block's MLA parameters, in model order."""
    m, d, h = args.mla, args.dim, args.n_heads
    q = (
        [
            ("attention.wq_a.weight", (m.q_lora_rank, d)),
            ("attention.q_a_norm.weight", (m.q_lora_rank,)),
            ("attention.wq_b.weight", (h * m.qk_head_dim, m.q_lora_rank)),
        ]
        if m.q_lora_rank
        else [("attention.wq.weight", (h * m.qk_head_dim, d))]
    )
    return q + [
        ("attention.wkv_a.weight", (m.kv_lora_rank + m.qk_rope_head_dim, d)),
        ("attention.kv_a_norm.weight", (m.kv_lora_rank,)),
        ("attention.wkv_b.weight", (h * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)),
        ("attention.wo.weight", (d, h * m.v_head_dim)),
    ]


def shared_expert_shapes(args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    width = args.moe.hidden_dim * args.moe.n_shared_experts
    if not width:
        return []
    return [
        ("feed_forward.shared_experts.w1.weight", (width, args.dim)),
        ("feed_forward.shared_experts.w2.weight", (args.dim, width)),
        ("feed_forward.shared_experts.w3.weight", (width, args.dim)),
    ]


def deepseek_config(args: ModelArgs) -> dict:
    """The DeepseekV3ForCausalLM part of config.json."""
    m, moe = args.mla, args.moe
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "q_lora_rank": m.q_lora_rank or None,
        "kv_lora_rank": m.kv_lora_rank,
        "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim,
        "head_dim": m.qk_rope_head_dim,
        "rope_interleave": True,
        "num_nextn_predict_layers": args.mtp_layers,
    }
    if moe is None:  # dense: every block's FFN is the dense one
        return {
            **cfg,
            "first_k_dense_replace": args.n_layers,
            "n_routed_experts": 1,
            "num_experts_per_tok": 1,
            "n_shared_experts": 0,
            "moe_intermediate_size": 1,
            "n_group": 1,
            "topk_group": 1,
        }
    return {
        **cfg,
        "n_routed_experts": moe.n_experts,
        "num_experts_per_tok": moe.top_k,
        "n_shared_experts": moe.n_shared_experts,
        "moe_intermediate_size": moe.hidden_dim,
        "first_k_dense_replace": moe.first_dense_layers,
        "n_group": moe.n_group,
        "topk_group": moe.topk_group,
        "routed_scaling_factor": moe.route_scale,
        "norm_topk_prob": moe.norm_topk_prob,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def unsupported(cfg: dict) -> str | None:
    """Why a deepseek_v3 config.json cannot be loaded exactly here, or None."""
    rope = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "yarn"):
        return (
            f"its RoPE is {kind!r}-scaled, which this trainer does not implement for MLA "
            "(plain RoPE and YaRN, as DeepSeek-V3 and Kimi K2 are released)"
        )
    ratio = yarn_ratio(rope, cfg) if kind == "yarn" else None
    original = rope.get("original_max_position_embeddings") or 1
    if ratio and rope.get("factor") and abs(ratio - float(rope["factor"])) * original > 0.5:
        return (
            f"its YaRN factor {rope['factor']} is not max_position_embeddings / "
            f"original_max_position_embeddings = {ratio:g}, which transformers 4.x takes "
            "as the factor instead (5.x takes `factor`): the two would build different "
            "models"
        )
    if kind == "yarn" and rope.get("attention_factor") is not None:
        return (
            "its YaRN sets attention_factor, which DeepSeek's releases do not (they set "
            "mscale and mscale_all_dim); this trainer derives the factor from those"
        )
    if cfg.get("rope_interleave", True) is False:
        return (
            "rope_interleave = false (rotate-half RoPE layout); DeepSeek's released "
            "weights and this trainer's use interleaved pairs"
        )
    return None


# What transformers' DeepseekV3Config builds for a key config.json leaves out (5.x; DeepSeek's
# and Moonshot's own configuration_deepseek.py agree on these), so a minimal config.json is
# compared with the model transformers would build, not with this trainer's defaults.
# tests/test_hf_release.py checks the table against transformers.
HF_DEFAULTS = {
    "num_hidden_layers": 61,
    "q_lora_rank": 1536,
    "first_k_dense_replace": 3,
    "n_group": 8,
    "topk_group": 4,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "num_experts_per_tok": 8,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
# config.json model types of the DeepseekV3ForCausalLM architecture: Kimi K2's is its own
# (its remote code is DeepSeek-V3's, named through auto_map)
MODEL_TYPES = ("deepseek_v3", "kimi_k2")
# Kimi K2's tokenizer: tiktoken BPE ranks read by the folder's own tokenization_kimi.py
TIKTOKEN = "tiktoken.model"
TIKTOKEN_NOTE = (
    "{folder}: its tokenizer (tiktoken.model, read by the folder's "
    "tokenization_kimi.py) is not read here, only the weights: to train on its "
    "tokens, convert it to a tokenizer.json (pip install tiktoken; transformers' "
    "convert_slow_tokenizer.TikTokenConverter with the pat_str and special tokens "
    "of tokenization_kimi.py) and set data.tokenizer_path to it"
)


def setting(cfg: dict, key: str):
    """config.json's value of `key`, or transformers' default where it is left out."""
    return cfg[key] if key in cfg else HF_DEFAULTS[key]


def compare(cfg: dict, args: ModelArgs) -> tuple[dict, dict]:
    """(theirs, ours) for the settings that change a DeepSeek-V3 model without changing a
    tensor shape of the blocks we load (and the number of blocks)."""
    moe = args.moe
    get = lambda key: setting(cfg, key)  # noqa: E731
    theirs = {
        "num_hidden_layers": int(get("num_hidden_layers")),
        "q_lora_rank": int(get("q_lora_rank") or 0),
        "first_k_dense_replace": int(get("first_k_dense_replace") or 0),
        "n_group": int(get("n_group") or 1),
        "topk_group": int(get("topk_group") or 1),
        "routed_scaling_factor": float(get("routed_scaling_factor")),
        "norm_topk_prob": bool(get("norm_topk_prob")),
        "num_experts_per_tok": int(get("num_experts_per_tok") or 0),
        "moe_layer_freq": int(cfg.get("moe_layer_freq") or 1),  # DeepSeek's own key
        "scoring_func": cfg.get("scoring_func") or "sigmoid",
    }
    ours = {"num_hidden_layers": args.n_layers, "q_lora_rank": args.mla.q_lora_rank}
    if moe is None:
        keep = ("num_hidden_layers", "q_lora_rank", "first_k_dense_replace")
        return {k: theirs[k] for k in keep}, {**ours, "first_k_dense_replace": args.n_layers}
    ours.update(
        {
            "first_k_dense_replace": moe.first_dense_layers,
            "n_group": moe.n_group,
            "topk_group": moe.topk_group,
            "routed_scaling_factor": float(moe.route_scale),
            "norm_topk_prob": moe.norm_topk_prob,
            "num_experts_per_tok": moe.top_k,
            "moe_layer_freq": moe.sparse_step,
            "scoring_func": moe.score_func,
        }
    )
    return theirs, ours


def mtp_depths(has, args: ModelArgs) -> int:
    """How many of our MTP modules the folder holds (its layers num_hidden_layers + k with an
    `eh_proj`); `has(key)` says whether the folder stores a tensor."""
    k = 0
    proj = MTP_OWN["proj.weight"]
    while k < args.mtp_layers and has(f"model.layers.{mtp_layer(args, k)}.{proj}"):
        k += 1
    return k


def mtp_import_note(has, args: ModelArgs, depths: int) -> str | None:
    """The startup line on where the MTP modules' weights come from (None: no MTP anywhere)."""
    if not args.mtp_layers:
        first = f"model.layers.{mtp_layer(args, 0)}.{MTP_OWN['proj.weight']}"
        return (
            (
                "multi-token prediction: the folder's MTP layer(s) are not loaded "
                "(model.mtp_layers = 0)"
            )
            if has(first)
            else None
        )
    first = mtp_layer(args, 0)
    loaded = (
        f"module(s) 0..{depths - 1} loaded from the folder's layer(s) {first}..{first + depths - 1}"
        if depths
        else "the folder holds none"
    )
    fresh = (
        f"; module(s) {depths}..{args.mtp_layers - 1} start from their seeded init"
        if depths < args.mtp_layers
        else ""
    )
    return f"multi-token prediction (model.mtp_layers = {args.mtp_layers}): {loaded}{fresh}"


def mtp_copy_warnings(hf, args: ModelArgs, depths: int) -> list[str]:
    """One warning line per MTP layer's copy of the embedding or head that differs from the
    main model's (the MTP modules here use the model's own, as DeepSeek-V3 trains them)."""
    lines = []
    for k in range(depths):
        for copy, main in MTP_COPIES.items():
            key = f"model.layers.{mtp_layer(args, k)}.{copy}"
            if not (hf.has(key) and hf.has(main)):
                continue
            a, b = hf.tensor(key), hf.tensor(main)
            diff = "shape" if a.shape != b.shape else max_abs_diff(a, b)
            if diff:
                what = (
                    f"shape {list(a.shape)} against {list(b.shape)}"
                    if diff == "shape"
                    else f"max |difference| {diff:.3g}"
                )
                lines.append(
                    f"warning: {key} differs from {main} ({what}); MTP module {k} "
                    f"uses the model's own {main} (shared, as DeepSeek-V3 trains it)"
                )
    return lines


def max_abs_diff(a, b, rows: int = 4096) -> float:
    """max |a - b| in float32, a block of rows at a time (the tensors are memory-mapped)."""
    return max(
        (
            float((a[i : i + rows].float() - b[i : i + rows].float()).abs().max())
            for i in range(0, a.shape[0], rows)
        ),
        default=0.0,
    )


class DeepSeekHF(DecoderHF):
    """DeepseekV3ForCausalLM's names, layout (no permutation) and config.json, and the MTP
    modules as the release's extra layers."""

    layer_names = {**DECODER_LAYER, **MLA_LAYER}
    exports_buffers = True  # the routing biases: its e_score_correction_bias

    def release_name(self, name: str, args: ModelArgs) -> str:
        return mtp_release_name(name, args)

    def copies(self, hf_key: str, args: ModelArgs) -> list[str]:
        return mtp_copies(hf_key, args)

    def rope_heads(self, name: str, args: ModelArgs) -> int | None:
        return None  # released with our interleaved RoPE pairs

    def attention_shapes(self, args: ModelArgs):
        return mla_shapes(args)

    def shared_expert_shapes(self, args: ModelArgs):
        return shared_expert_shapes(args)

    def mtp_modules(self, args: ModelArgs) -> int:
        return args.mtp_layers

    def config(self, args: ModelArgs) -> dict:
        return deepseek_config(args)

    def architecture(self, args: ModelArgs) -> str:
        return "deepseek_v3"

    def release_kind(self, cfg: dict) -> str:
        kind = cfg.get("model_type", "llama")
        if kind in MODEL_TYPES and "DeepseekV3ForCausalLM" in cfg.get("architectures", []):
            return "deepseek_v3"  # Kimi K2: DeepSeek-V3's architecture under its own type
        return kind

    def check_config(self, cfg: dict, args: ModelArgs, folder: str) -> tuple[dict, dict]:
        why = unsupported(cfg)
        if why:
            raise ConfigError(f"{folder}/config.json cannot be loaded exactly: {why}")
        return compare(cfg, args)

    def import_notes(self, hf, args: ModelArgs, folder: str) -> tuple[int, list[str]]:
        lines = []
        if os.path.isfile(os.path.join(folder, TIKTOKEN)) and not os.path.isfile(
            os.path.join(folder, "tokenizer.json")
        ):
            lines.append(TIKTOKEN_NOTE.format(folder=folder))
        depths = mtp_depths(hf.has, args)
        note = mtp_import_note(hf.has, args, depths)
        return depths, lines + ([note] if note else [])

    def mtp_depth(self, name: str) -> int | None:
        return mtp_depth(name)

    def load_warnings(self, hf, args: ModelArgs, depths: int) -> list[str]:
        return mtp_copy_warnings(hf, args, depths)

    def export_notes(self, args: ModelArgs, fetch) -> list[str]:
        if not args.mtp_layers:
            return []
        first = args.n_layers
        return [
            f"multi-token prediction: module(s) 0..{args.mtp_layers - 1} exported as layer(s) "
            f"{first}..{first + args.mtp_layers - 1} under the release's names "
            f"(num_nextn_predict_layers = {args.mtp_layers}; transformers skips them)"
        ]
