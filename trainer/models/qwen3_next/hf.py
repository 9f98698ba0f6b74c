"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5's MoE text model (Qwen3_5MoeForCausalLM)
between this trainer (trainer/models/qwen3_next.py) and the releases' tensors and config.json.

Most tensors are renamed (`LAYER`, `TOP`). The releases fuse what we keep apart:
- Qwen3-Next's `linear_attn.in_proj_qkvz` holds, per key head, its q rows, k rows, then the v
  and z rows of its value heads; `in_proj_ba` per key head its value heads' b then a rows.
- Qwen3.5's `in_proj_qkv` is [q; k; v] (all heads each), with in_proj_z, _b, _a apart.
- Both: `linear_attn.conv1d.weight` [q; k; v channels, 1, K] (ours: conv_q, conv_k, conv_v).
- Experts: one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, what save_pretrained
  writes) or stacked (`mlp.experts.gate_up_proj` [E, 2 I, dim], `down_proj`): both are read;
  ours are stacked w1, w3 [E, I, dim], w2 [E, dim, I].
Qwen3.5's multimodal checkpoints put the text model under `model.language_model.`: read too.

MTP: the releases hold one module under `mtp.` (num_nextn_predict_layers = 1; transformers
skips it): `pre_fc_norm_embedding`, `pre_fc_norm_hidden`, `fc` [dim, 2 dim] (applied to
[norm(emb); norm(h)]), `layers.0` (a full-attention decoder layer with the MoE, its tensors
named as a main layer's), `norm`, every norm zero-centred as the model's; ours is `mtp.0.`
(`MTP_OWN`, its block as a layer). Read where the folder has it and model.mtp_layers = 1,
written back under the same names.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from trainer.errors import ConfigError
from trainer.models.args import ModelArgs, MoEArgs
from trainer.models.common.rope import YarnScaling, yarn_from_config, yarn_keys, yarn_to_config
from trainer.models.qwen3_next.args import FULL, HybridArgs

# ours (under `layers.{i}.`) -> the release's (under `model.layers.{i}.`)
LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "linear_attention.A_log": "linear_attn.A_log",
    "linear_attention.dt_bias": "linear_attn.dt_bias",
    "linear_attention.norm.weight": "linear_attn.norm.weight",
    "linear_attention.wo.weight": "linear_attn.out_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",
    "feed_forward.shared_expert.w1.weight": "mlp.shared_expert.gate_proj.weight",
    "feed_forward.shared_expert.w2.weight": "mlp.shared_expert.down_proj.weight",
    "feed_forward.shared_expert.w3.weight": "mlp.shared_expert.up_proj.weight",
    "feed_forward.shared_expert_gate.weight": "mlp.shared_expert_gate.weight",
}
TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# The MTP module's own tensors: ours (under `mtp.0.`) -> the release's; its block `mtp.0.block.`
# is the release's `mtp.layers.0.`, mapped as a layer's
MTP_OWN = {
    "embed_norm.weight": "mtp.pre_fc_norm_embedding.weight",
    "hidden_norm.weight": "mtp.pre_fc_norm_hidden.weight",
    "proj.weight": "mtp.fc.weight",
    "norm.weight": "mtp.norm.weight",
}
MTP_BLOCK = ("mtp.0.block.", "mtp.layers.0.")  # ours, the release's
_DELTA = ("wq", "wk", "wv", "wz", "wb", "wa")
_CONV = ("conv_q", "conv_k", "conv_v")
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}


def _rope(cfg: dict) -> tuple[dict, YarnScaling | None]:
    """(rope_theta and partial_rotary_factor, the YaRN if any) of a config.json: transformers
    5's `rope_parameters`, or the releases' top-level keys with the legacy `rope_scaling` (the
    model cards' YaRN edit adds it there)."""
    rope = cfg.get("rope_parameters") or {
        "rope_theta": cfg.get("rope_theta", 10000.0),
        "partial_rotary_factor": cfg.get("partial_rotary_factor", 0.25),
    }
    scaling = cfg.get("rope_scaling") or rope
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return rope, None
    if kind != "yarn" or scaling.get("attention_factor") is not None:
        raise ConfigError(
            f"config.json RoPE scaling {scaling}: only plain RoPE and YaRN (without an "
            "explicit attention_factor) are supported for Qwen3-Next / Qwen3.5"
        )
    return rope, yarn_from_config(scaling, cfg["max_position_embeddings"])


def args_from_config(cfg: dict, **overrides) -> ModelArgs:
    """Our args from a release's config.json (the text config of a multimodal Qwen3.5)."""
    cfg = cfg.get("text_config", cfg)
    kind = cfg.get("model_type")
    if kind not in ARCHITECTURES:
        raise ConfigError(
            f"config.json model_type {kind!r}: expected one of {', '.join(ARCHITECTURES)}"
        )
    rope, scaling = _rope(cfg)
    if cfg.get("mlp_only_layers"):
        raise ConfigError(
            f"config.json mlp_only_layers {cfg.get('mlp_only_layers')}: dense-only layers "
            "among the MoE layers are not supported"
        )
    hybrid = HybridArgs(
        # the releases name only full_attention_interval; transformers builds the list from it
        layer_types=tuple(cfg.get("layer_types") or ()),
        full_attention_interval=cfg.get("full_attention_interval", 4),
        partial_rotary_factor=rope.get("partial_rotary_factor", 0.25),
        linear_k_heads=cfg["linear_num_key_heads"],
        linear_v_heads=cfg["linear_num_value_heads"],
        linear_k_head_dim=cfg["linear_key_head_dim"],
        linear_v_head_dim=cfg["linear_value_head_dim"],
        conv_kernel=cfg["linear_conv_kernel_dim"],
        shared_expert_hidden=cfg.get("shared_expert_intermediate_size", 0),
    )
    moe = (
        MoEArgs(
            n_experts=cfg["num_experts"],
            top_k=cfg["num_experts_per_tok"],
            hidden_dim=cfg["moe_intermediate_size"],
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            sparse_step=cfg.get("decoder_sparse_step", 1),
        )
        if cfg.get("num_experts")
        else None
    )
    fields = dict(
        dim=cfg["hidden_size"],
        n_layers=cfg["num_hidden_layers"],
        n_heads=cfg["num_attention_heads"],
        n_kv_heads=cfg["num_key_value_heads"],
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg["rms_norm_eps"],
        rope_theta=rope["rope_theta"],
        rope_scaling=scaling,
        max_seq_len=cfg["max_position_embeddings"],
        tie_word_embeddings=cfg.get("tie_word_embeddings", False),
        explicit_head_dim=cfg.get("head_dim") or 0,
        explicit_hidden_dim=cfg.get("intermediate_size") or 0,
        qk_norm=True,
        moe=moe,
        hybrid=hybrid,
    )
    return ModelArgs(**{**fields, **overrides})


def _groups(args: ModelArgs) -> tuple[int, list[int], list[int]]:
    """(key heads, the row split of one key head's in_proj_qkvz group, of its in_proj_ba)."""
    h = args.hybrid
    r = h.linear_v_heads // h.linear_k_heads
    dk, dv = h.linear_k_head_dim, h.linear_v_head_dim
    return h.linear_k_heads, [dk, dk, r * dv, r * dv], [r, r]


def from_release(tensors: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """A release's state dict (either family, experts per expert or stacked) -> ours."""
    ours = {}
    for part in release_parts(tensors, args):
        ours.update(part)
    return ours


def release_parts(tensors: Mapping[str, torch.Tensor], args: ModelArgs):
    """Ours from a release's tensors (a mapping read on demand: `in` and `[]`), the top
    tensors, then a layer at a time (an import holds one layer's tensors at once)."""
    hf = _Text(tensors)
    yield {name: hf[key] for name, key in TOP.items() if key in hf}
    for i in range(args.n_layers):
        yield _layer_from_release(hf, f"model.layers.{i}.", f"layers.{i}.", i, args)
    if args.mtp_layers and has_mtp(hf):  # the MTP module: block n_layers
        ours = _layer_from_release(hf, MTP_BLOCK[1], MTP_BLOCK[0], args.n_layers, args)
        yield {**ours, **{f"mtp.0.{n}": hf[key] for n, key in MTP_OWN.items()}}


def has_mtp(tensors) -> bool:
    """Whether a release's tensors (`in`) hold its MTP module."""
    return MTP_OWN["proj.weight"] in tensors


def _layer_from_release(hf, pre: str, out: str, block: int, args: ModelArgs) -> dict:
    """Ours (under `out`) of block `block`, from the release's layer under `pre`."""
    ours = {out + name: hf[pre + key] for name, key in LAYER.items() if pre + key in hf}
    if args.hybrid_layer_type(block) != FULL:
        ours.update(
            {
                out + "linear_attention." + n: t
                for n, t in _delta_from_release(hf, pre + "linear_attn.", args).items()
            }
        )
    if args.is_moe_layer(block):
        ours.update(
            {
                out + "feed_forward.experts." + w: t
                for w, t in _experts_from_release(hf, pre + "mlp.experts.", args).items()
            }
        )
        # the releases route by the scores alone: our balancing bias at zero
        ours[out + "feed_forward.router.expert_bias"] = torch.zeros(args.moe.n_experts)
    return ours


class _Text:
    """A release's tensors with Qwen3.5's multimodal prefix (`model.language_model.`) read
    as the text model's `model.`."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self.tensors = tensors

    def _key(self, key: str) -> str:
        other = re.sub(r"^model\.", "model.language_model.", key)
        return key if key in self.tensors or other not in self.tensors else other

    def __contains__(self, key: str) -> bool:
        return self._key(key) in self.tensors

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.tensors[self._key(key)]


def _delta_from_release(hf, pre: str, args: ModelArgs) -> dict[str, torch.Tensor]:
    h = args.hybrid
    keys, values = h.linear_k_heads * h.linear_k_head_dim, h.linear_v_heads * h.linear_v_head_dim
    if pre + "in_proj_qkvz.weight" in hf:  # Qwen3-Next: grouped per key head
        nk, qkvz, ba = _groups(args)
        dim = args.dim
        parts = hf[pre + "in_proj_qkvz.weight"].view(nk, sum(qkvz), dim).split(qkvz, dim=1)
        parts += hf[pre + "in_proj_ba.weight"].view(nk, sum(ba), dim).split(ba, dim=1)
        mats = [p.reshape(-1, dim) for p in parts]
    else:  # Qwen3.5
        mats = list(hf[pre + "in_proj_qkv.weight"].split([keys, keys, values]))
        mats += [hf[pre + f"in_proj_{x}.weight"] for x in "zba"]
    out = {f"{n}.weight": m.contiguous() for n, m in zip(_DELTA, mats, strict=True)}
    conv = hf[pre + "conv1d.weight"].squeeze(1).split([keys, keys, values])
    out.update({n: c.contiguous() for n, c in zip(_CONV, conv, strict=True)})
    return out


def _experts_from_release(hf, pre: str, args: ModelArgs) -> dict[str, torch.Tensor]:
    if pre + "gate_up_proj" in hf:  # stacked: [E, 2 I, dim] = gate rows, then up rows
        w1, w3 = hf[pre + "gate_up_proj"].chunk(2, dim=1)
        return {"w1": w1.contiguous(), "w3": w3.contiguous(), "w2": hf[pre + "down_proj"]}
    e = range(args.moe.n_experts)
    return {
        w: torch.stack([hf[f"{pre}{j}.{proj}.weight"] for j in e]) for w, proj in _EXPERTS.items()
    }


def to_release(
    ours: dict[str, torch.Tensor], args: ModelArgs, family: str = "qwen3_next"
) -> dict[str, torch.Tensor]:
    """Our full state dict -> the release's tensors (`family`: qwen3_next or
    qwen3_5_moe_text), experts one tensor each (what save_pretrained writes)."""
    if family not in ARCHITECTURES:
        raise ConfigError(
            f"Hugging Face family {family!r}: expected one of {', '.join(ARCHITECTURES)}"
        )
    hf = {TOP[n]: t for n, t in ours.items() if n in TOP}
    for i in range(args.n_layers):
        hf.update(_layer_to_release(ours, f"layers.{i}.", f"model.layers.{i}.", i, args, family))
    if args.mtp_layers:  # the release's one MTP module (args.mtp_export_problem: at most 1)
        hf.update(_layer_to_release(ours, *MTP_BLOCK, args.n_layers, args, family))
        hf.update({key: ours[f"mtp.0.{n}"] for n, key in MTP_OWN.items()})
    return hf


def _layer_to_release(ours, mine: str, pre: str, block: int, args: ModelArgs, family: str):
    """The release's tensors (under `pre`) of our block `block` (under `mine`)."""
    hf = {pre + key: ours[mine + n] for n, key in LAYER.items() if mine + n in ours}
    bias = ours.get(mine + "feed_forward.router.expert_bias")
    if bias is not None and bias.any():
        raise ConfigError(
            "moe.load_balance_coeff: the experts' balancing bias is not zero, "
            f"and {ARCHITECTURES[family]} has no place for it ({mine[:-1]})"
        )
    if args.hybrid_layer_type(block) != FULL:
        la = {
            n: ours[f"{mine}linear_attention.{n}"]
            for n in [f"{x}.weight" for x in _DELTA] + list(_CONV)
        }
        hf.update(_delta_to_release(la, pre + "linear_attn.", args, family))
    if args.is_moe_layer(block):
        for w, proj in _EXPERTS.items():
            stacked = ours[f"{mine}feed_forward.experts.{w}"]
            hf.update(
                {f"{pre}mlp.experts.{e}.{proj}.weight": stacked[e] for e in range(stacked.shape[0])}
            )
    return hf


def _delta_to_release(la, pre: str, args: ModelArgs, family: str):
    q, k, v, z, b, a = (la[f"{x}.weight"] for x in _DELTA)
    conv = torch.cat([la[c] for c in _CONV]).unsqueeze(1)
    if family == "qwen3_5_moe_text":
        return {
            pre + "in_proj_qkv.weight": torch.cat((q, k, v)),
            pre + "in_proj_z.weight": z,
            pre + "in_proj_b.weight": b,
            pre + "in_proj_a.weight": a,
            pre + "conv1d.weight": conv,
        }
    nk, _, _ = _groups(args)
    dim = args.dim
    qkvz = torch.cat([t.reshape(nk, -1, dim) for t in (q, k, v, z)], dim=1).reshape(-1, dim)
    ba = torch.cat([t.reshape(nk, -1, dim) for t in (b, a)], dim=1).reshape(-1, dim)
    return {
        pre + "in_proj_qkvz.weight": qkvz,
        pre + "in_proj_ba.weight": ba,
        pre + "conv1d.weight": conv,
    }


def hybrid_shapes(args: ModelArgs, buffers: bool = False) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes (with `buffers`, the persistent buffers too: the MoE
    balancing biases), from the model built on the meta device."""
    from trainer.models.qwen3_next.model import Qwen3Next

    with torch.device("meta"):
        model = Qwen3Next(args)
    tensors = model.state_dict().items() if buffers else model.named_parameters()
    return {n: tuple(t.shape) for n, t in tensors}


def export_problem(args: ModelArgs) -> str | None:
    """Why Qwen3NextForCausalLM (and its mtp.* tensors) cannot hold this hybrid, or None."""
    if args.mtp_export_problem():
        return args.mtp_export_problem()
    m = args.moe
    if (
        m is None
        or not args.hybrid.shared_expert_hidden
        or not m.hf_exportable
        or m.first_dense_layers
    ):
        return (
            "this hybrid flavor has no Hugging Face class: Qwen3NextForCausalLM needs MoE "
            "layers with a softmax router and a gated shared expert (dense layers only by "
            "decoder_sparse_step)"
        )
    return None


def release_config(args: ModelArgs, *, dtype: str, bos_id, eos_id) -> dict:
    """config.json of a Qwen3NextForCausalLM holding this model."""
    h, m = args.hybrid, args.moe
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": args.rope_theta,
            "partial_rotary_factor": h.partial_rotary_factor,
            **_yarn_parameters(args.rope_scaling),
        },
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "layer_types": [h.layer_type(i) for i in range(args.n_layers)],
        "full_attention_interval": h.full_attention_interval,
        "linear_num_key_heads": h.linear_k_heads,
        "linear_num_value_heads": h.linear_v_heads,
        "linear_key_head_dim": h.linear_k_head_dim,
        "linear_value_head_dim": h.linear_v_head_dim,
        "linear_conv_kernel_dim": h.conv_kernel,
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.hidden_dim,
        "shared_expert_intermediate_size": h.shared_expert_hidden,
        "decoder_sparse_step": m.sparse_step,
        "mlp_only_layers": [],
        "norm_topk_prob": m.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": m.aux_loss_weight,
        "use_cache": True,
        "num_nextn_predict_layers": args.mtp_layers,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }


def _yarn_parameters(s: YarnScaling | None) -> dict:
    return {} if s is None else yarn_to_config(s)


def _shape_of(args: ModelArgs) -> dict:
    """What a release's config.json fixes about the computation (no sequence length)."""
    m, h = args.moe, args.hybrid
    return {
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "rms_norm_eps": float(args.norm_eps),
        "rope_theta": float(args.rope_theta),
        "tie_word_embeddings": args.tie_word_embeddings,
        "layer_types": [h.layer_type(i) for i in range(args.n_layers)],
        "partial_rotary_factor": h.partial_rotary_factor,
        "rope_scaling": args.rope_scaling,
        "linear heads (k, v, d_k, d_v, conv)": (
            h.linear_k_heads,
            h.linear_v_heads,
            h.linear_k_head_dim,
            h.linear_v_head_dim,
            h.conv_kernel,
        ),
        "shared_expert_intermediate_size": h.shared_expert_hidden,
        "experts (n, top-k, width, norm_topk_prob, sparse_step)": m
        and (m.n_experts, m.top_k, m.hidden_dim, m.norm_topk_prob, m.sparse_step),
    }


def check_release_config(cfg: dict, args: ModelArgs, folder: str, flavor: str) -> None:
    """The folder's config.json describes the model of `flavor` (its vocab may differ: the
    tensor shapes say)."""
    theirs, ours = _shape_of(args_from_config(cfg)), _shape_of(args)
    for key, value in theirs.items():
        if value != ours[key]:
            if key == "rope_scaling":
                raise ConfigError(
                    f"{folder}/config.json does not fit the RoPE of this run: its RoPE is "
                    + (f"YaRN ({yarn_keys(value)})" if value else "plain")
                    + f", here {ours[key] or 'plain'}; set "
                    + (yarn_keys(value) if value else "model.rope_scaling = 'none'")
                )
            raise ConfigError(
                f"{folder}/config.json does not fit model.flavor = {flavor!r}: "
                f"{key} is {value} there and {ours[key]} here; choose the flavor "
                "the checkpoint was made with"
            )
