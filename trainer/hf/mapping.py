"""Parameter names and layouts between this trainer's decoder and Hugging Face's LlamaForCausalLM
(Qwen3MoeForCausalLM for a MoE); a family whose release differs adapts `DecoderHF`.

Names: `layers.3.attention.wq.weight` <-> `model.layers.3.self_attn.q_proj.weight`, etc.
Layout: our RoPE rotates consecutive channel pairs (2j, 2j+1) of each head, Hugging Face's
rotates (j, j + head_dim/2). The rows of wq and wk are therefore reordered per head on the way
out (`to_hf`) and back (`from_hf`); the attention scores, and so the model, are unchanged.
"""

from __future__ import annotations

import re

import torch

from trainer.errors import ConfigError
from trainer.models import registry
from trainer.models.args import ModelArgs
from trainer.models.common.rope import YarnScaling, yarn_to_config
from trainer.models.hooks import NO_HF_MOE

_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.router.gate.weight": "mlp.gate.weight",  # Qwen3-MoE's router
}
# Our stacked [E, ...] experts <-> Hugging Face's one tensor per expert (the hub's layout)
_EXPERTS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERTS_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.experts\.(w[123])$")
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
BIAS = "feed_forward.router.expert_bias"  # a MoE layer's balancing bias (a buffer)


class DecoderHF:
    """The plain decoder's Hugging Face adapter: LlamaForCausalLM, and Qwen3MoeForCausalLM for
    a MoE. A family whose release differs subclasses it (its hooks' `hf_adapter`) and
    overrides what differs: names, layouts, the MTP layers, config.json."""

    layer_names = _LAYER
    # whether an export writes the MoE balancing biases (Qwen3-MoE has no place for them)
    exports_buffers = False

    def release_name(self, name: str, args: ModelArgs) -> str:
        """Our name as the release's layer would hold it (the MTP modules' differ)."""
        return name

    def copies(self, hf_key: str, args: ModelArgs) -> list[str]:
        """Further keys under which the release repeats the tensor of `hf_key`."""
        return []

    def rope_heads(self, name: str, args: ModelArgs) -> int | None:
        """Number of heads whose rows are permuted in this parameter, or None. Qwen3's q/k
        norms weigh each of the head_dim features of every head alike: one "head" of head_dim
        entries, permuted as the rows of wq and wk are (else a trained norm meets the wrong
        features)."""
        if name.endswith("attention.wq.weight"):
            return args.n_heads
        if name.endswith("attention.wk.weight"):
            return args.n_kv_heads
        if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
            return 1
        return None

    def attention_shapes(self, args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
        """(name under `layers.i.`, shape) of one block's attention projections."""
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        return [
            ("attention.wq.weight", (q, args.dim)),
            ("attention.wk.weight", (kv, args.dim)),
            ("attention.wv.weight", (kv, args.dim)),
            ("attention.wo.weight", (args.dim, q)),
        ]

    def shared_expert_shapes(self, args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
        """(name under `layers.i.`, shape) of a MoE block's shared experts the release holds."""
        return []

    def mtp_modules(self, args: ModelArgs) -> int:
        """How many MTP modules the release holds (as its layers num_hidden_layers + k)."""
        return 0

    def config(self, args: ModelArgs) -> dict:
        """config.json's keys beyond LlamaForCausalLM's."""
        return moe_config(args) if args.moe is not None else {}

    def architecture(self, args: ModelArgs) -> str:
        """config.json's model_type for this model."""
        return "qwen3_moe" if args.moe is not None else "llama"

    def release_kind(self, cfg: dict) -> str:
        """The model_type a folder's config.json holds, as `architecture` names it."""
        return cfg.get("model_type", "llama")

    def check_config(self, cfg: dict, args: ModelArgs, folder: str) -> tuple[dict, dict]:
        """(theirs, ours) for the settings beyond the shared ones that change the model
        without changing a tensor shape; a ConfigError where the folder cannot load exactly."""
        theirs, ours = {}, {}
        if "num_hidden_layers" in cfg:
            theirs["num_hidden_layers"] = int(cfg["num_hidden_layers"])
            ours["num_hidden_layers"] = args.n_layers
        if args.moe is not None:
            theirs["num_experts_per_tok"] = int(cfg.get("num_experts_per_tok", 8))
            theirs["norm_topk_prob"] = bool(cfg.get("norm_topk_prob", False))
            ours["num_experts_per_tok"] = args.moe.top_k
            ours["norm_topk_prob"] = args.moe.norm_topk_prob
        return theirs, ours

    def import_notes(self, hf, args: ModelArgs, folder: str) -> tuple[int, list[str]]:
        """(how many MTP modules the folder holds, the startup lines about the import)."""
        return 0, []

    def mtp_depth(self, name: str) -> int | None:
        """k for our parameter under MTP module k, else None."""
        return None

    def load_warnings(self, hf, args: ModelArgs, depths: int) -> list[str]:
        """Warning lines once the folder's tensors are read."""
        return []

    def export_notes(self, args: ModelArgs, fetch) -> list[str]:
        """The lines an export prints about what the release cannot hold (`fetch(names)`:
        our full tensors of those names)."""
        buffers = list(buffer_shapes(args))
        note = routing_bias_note(fetch(buffers)) if buffers else None
        return [note] if note else []


def adapter(args: ModelArgs) -> DecoderHF:
    """The Hugging Face adapter of `args`'s family."""
    return registry.hooks(args).hf_adapter() or DecoderHF()


def hf_name(name: str, args: ModelArgs) -> str:
    """Our parameter name -> the Hugging Face state-dict key."""
    if name in _TOP:
        return _TOP[name]
    a = adapter(args)
    name = a.release_name(name, args)
    if name.startswith("model."):
        return name
    m = _LAYER_RE.match(name)
    if m is None or m.group(2) not in a.layer_names:
        raise KeyError(f"no Hugging Face name for parameter {name!r}")
    return f"model.layers.{m.group(1)}.{a.layer_names[m.group(2)]}"


def hf_tensors(name: str, tensor: torch.Tensor, args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full tensor -> its Hugging Face key(s) and tensor(s): one per expert for stacked
    experts, else one (`hf_name`, `to_hf`) and the release's copies of it."""
    a = adapter(args)
    m = _EXPERTS_RE.match(a.release_name(name, args))
    if m is None:
        key = hf_name(name, args)
        out = {key: to_hf(name, tensor, args)}
        names = [key] + (
            ["lm_head.weight"]
            if key == "model.embed_tokens.weight" and args.tie_word_embeddings
            else []
        )
        # safetensors stores no aliases: each copy is its own tensor
        out.update({c: out[key].clone() for n in names for c in a.copies(n, args)})
        return out
    layer, w = m.groups()
    return {
        f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[w]}.weight": tensor[e]
        for e in range(tensor.shape[0])
    }


def stacked_experts(name: str) -> bool:
    """Our parameter `name` stacks the experts ([E, ...]), one Hugging Face tensor each."""
    return name.endswith(tuple(f"feed_forward.experts.{w}" for w in _EXPERTS))


def hf_keys(name: str, args: ModelArgs) -> list[str]:
    """The Hugging Face key(s) our parameter `name` is read from."""
    m = _EXPERTS_RE.match(adapter(args).release_name(name, args))
    if m is None:
        return [hf_name(name, args)]
    layer, w = m.groups()
    return [
        f"model.layers.{layer}.mlp.experts.{e}.{_EXPERTS[w]}.weight"
        for e in range(args.moe.n_experts)
    ]


def from_hf_keys(name: str, tensors: list[torch.Tensor], args: ModelArgs) -> torch.Tensor:
    """The inverse of `hf_tensors`: the experts stacked, or `from_hf` of the one tensor."""
    if stacked_experts(name):
        return torch.stack(tensors)
    return from_hf(name, tensors[0], args)


def to_hf(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Our layout -> Hugging Face's: per head, rows (0, 2, 4, ..., 1, 3, 5, ...) (our RoPE
    rotates interleaved pairs, theirs the two halves of a head)."""
    heads = adapter(args).rope_heads(name, args)
    if heads is None:
        return tensor
    d = args.head_dim
    return tensor.reshape(heads, d // 2, 2, -1).transpose(1, 2).reshape(tensor.shape)


def from_hf(name: str, tensor: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    """Hugging Face's layout -> ours (the inverse of `to_hf`)."""
    heads = adapter(args).rope_heads(name, args)
    if heads is None:
        return tensor
    d = args.head_dim
    return tensor.reshape(heads, 2, d // 2, -1).transpose(1, 2).reshape(tensor.shape)


def param_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes, in model order, without building the model (MTP
    modules where the family's release holds them)."""
    own = registry.hooks(args).hf_param_shapes(args)
    if own is not None:  # the family's own names
        return own
    shapes = {"tok_embeddings.weight": (args.vocab_size, args.dim)}
    for i in range(args.n_layers):
        shapes.update((f"layers.{i}.{key}", shape) for key, shape in block_shapes(i, args))
    shapes["norm.weight"] = (args.dim,)
    if not args.tie_word_embeddings:
        shapes["output.weight"] = (args.vocab_size, args.dim)
    for k in range(adapter(args).mtp_modules(args)):
        shapes.update(mtp_shapes(args, block_shapes(args.n_layers + k, args), k))
    return shapes


def mtp_shapes(args: ModelArgs, block: list[tuple[str, tuple[int, ...]]], k: int):
    """(name, shape) of MTP module k's parameters (trainer/models/common/mtp.py); `block`: its
    block's, under `block.`."""
    d = args.dim
    return [
        (f"mtp.{k}.embed_norm.weight", (d,)),
        (f"mtp.{k}.hidden_norm.weight", (d,)),
        (f"mtp.{k}.proj.weight", (d, 2 * d)),
        *((f"mtp.{k}.block.{n}", s) for n, s in block),
        (f"mtp.{k}.norm.weight", (d,)),
    ]


def block_shapes(i: int, args: ModelArgs) -> list[tuple[str, tuple[int, ...]]]:
    """(name under the block, shape) of block i's parameters."""
    a, h = adapter(args), args.hidden_dim
    attn = [("attention_norm.weight", (args.dim,)), *a.attention_shapes(args)]
    if args.qk_norm:
        attn += [
            ("attention.q_norm.weight", (args.head_dim,)),
            ("attention.k_norm.weight", (args.head_dim,)),
        ]
    if args.is_moe_layer(i):
        e, eh = args.moe.n_experts, args.moe.hidden_dim
        ffn = [
            ("feed_forward.router.gate.weight", (e, args.dim)),
            ("feed_forward.experts.w1", (e, eh, args.dim)),
            ("feed_forward.experts.w2", (e, args.dim, eh)),
            ("feed_forward.experts.w3", (e, eh, args.dim)),
        ] + a.shared_expert_shapes(args)
    else:
        ffn = [
            ("feed_forward.w1.weight", (h, args.dim)),
            ("feed_forward.w2.weight", (args.dim, h)),
            ("feed_forward.w3.weight", (h, args.dim)),
        ]
    return attn + [("ffn_norm.weight", (args.dim,))] + ffn


def buffer_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """The persistent buffers a checkpoint holds besides the parameters: each MoE layer's
    balancing bias, which Qwen3MoeForCausalLM has no place for (see `routing_bias_note`)."""
    mtp = adapter(args).mtp_modules(args)
    return {
        **{
            f"layers.{i}.{BIAS}": (args.moe.n_experts,)
            for i in range(args.n_layers)
            if args.is_moe_layer(i)
        },
        **{
            f"mtp.{k}.block.{BIAS}": (args.moe.n_experts,)
            for k in range(mtp)
            if args.is_moe_layer(args.n_layers + k)
        },
    }


def export_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """What a Hugging Face export writes: the parameters, and the routing biases where the
    release holds them (DeepSeek-V3's `e_score_correction_bias`; Qwen3-MoE has no place)."""
    keep = adapter(args).exports_buffers
    return {**param_shapes(args), **(buffer_shapes(args) if keep else {})}


def routing_bias_note(
    biases: dict[str, torch.Tensor], architecture: str = "Qwen3MoeForCausalLM"
) -> str | None:
    """A warning line when a MoE model to export has a non-zero balancing bias: the exported
    model routes by its scores alone, so its choices of experts can differ from training's."""
    largest = max((float(t.abs().max()) for t in biases.values()), default=0.0)
    if largest == 0.0:
        return None
    return (
        f"warning: the experts' balancing bias (moe.load_balance_coeff; largest |bias| "
        f"{largest:.3g}) is not part of {architecture} and is left out: the exported "
        "model chooses experts by the router's scores alone, which can differ from the "
        "trained model's choices; train with moe.load_balance_coeff = 0 for an exact export"
    )


def hf_config(args: ModelArgs, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json of a LlamaForCausalLM with these args, and what the family's release adds
    (the legacy `rope_scaling` key, which transformers 4.x, 5.x and vLLM all read)."""
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": args.tie_word_embeddings,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype,
    }
    cfg.update(adapter(args).config(args))
    s = args.rope_scaling
    if isinstance(s, YarnScaling):
        cfg["rope_scaling"] = {"type": "yarn", **yarn_to_config(s)}  # (type: transformers 4)
        # exactly original x factor: transformers 4.x takes the factor from this ratio
        cfg["max_position_embeddings"] = round(s.original_max_position_embeddings * s.factor)
    elif s is not None:
        cfg["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": s.factor,
            "low_freq_factor": s.low_freq_factor,
            "high_freq_factor": s.high_freq_factor,
            "original_max_position_embeddings": s.original_max_position_embeddings,
        }
        cfg["max_position_embeddings"] = max(
            args.max_seq_len, s.original_max_position_embeddings * 16
        )
    return cfg


def moe_config(args: ModelArgs) -> dict:
    """The Qwen3MoeForCausalLM part of config.json; a MoE without that architecture's router
    (shared experts, sigmoid scores, a routed scale) has no Hugging Face class to go to."""
    m = args.moe
    if not m.hf_exportable:
        raise ConfigError(NO_HF_MOE)
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "moe_intermediate_size": m.hidden_dim,
        "decoder_sparse_step": m.sparse_step,
        "mlp_only_layers": list(range(m.first_dense_layers)),
        "norm_topk_prob": m.norm_topk_prob,
        "output_router_logits": False,
        "router_aux_loss_coef": m.aux_loss_weight,
        "sliding_window": None,
        "use_sliding_window": False,
    }


def architecture(args: ModelArgs) -> str:
    return adapter(args).architecture(args)


def export_problem(args: ModelArgs) -> str | None:
    """Why no Hugging Face architecture here holds this model, or None (its family says)."""
    return registry.hooks(args).hf_export_problem(args)


def check_hf_config(cfg: dict, args: ModelArgs, folder: str, flavor: str) -> None:
    """Settings that change the model without changing a tensor shape must agree too."""
    kind = adapter(args).release_kind(cfg)
    if kind != architecture(args):
        classes = ", ".join(cfg.get("architectures", []))
        raise ConfigError(
            f"{folder} holds a {kind!r} model ({classes}), but model.flavor "
            f"{flavor!r} is {architecture(args)!r}; choose a flavor of that "
            "architecture"
        )
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    theirs = {  # the defaults of transformers' LlamaConfig, Qwen3MoeConfig, DeepseekV3Config
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "rope_theta": float(cfg.get("rope_theta", scaling.get("rope_theta", 10000.0))),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope_scaling": _scaling_tuple(scaling, cfg),
        "hidden_act": cfg.get("hidden_act", "silu"),
    }
    ours = {
        "tie_word_embeddings": args.tie_word_embeddings,
        "rope_theta": float(args.rope_theta),
        "rms_norm_eps": float(args.norm_eps),
        "hidden_act": "silu",
        "rope_scaling": _our_scaling(args.rope_scaling),
    }
    more = adapter(args).check_config(cfg, args, folder)
    theirs.update(more[0])
    ours.update(more[1])
    for key, value in theirs.items():
        if value != ours[key]:
            raise ConfigError(
                f"{folder}/config.json does not fit model.flavor = {flavor!r}: "
                f"{key} is {value} there and {ours[key]} here; choose the flavor "
                "the checkpoint was made with" + _hint(key, value, ours[key])
            )


def _hint(key: str, theirs, ours) -> str:
    """What else to set when `key` differs, where a [model] key can make it fit."""
    if key == "num_hidden_layers":
        return " (and model.n_layers = 0: all of its blocks)"
    if key != "rope_scaling" or not theirs:
        return ""
    if theirs[0] == "yarn" and (ours is None or ours[0] == "yarn"):
        return (  # the flavor's own YaRN with another factor or context (Kimi K2 0905)
            f", or keep it and set model.rope_scaling = 'yarn', model.yarn_factor = "
            f"{theirs[1]:g}, model.yarn_original_max_position_embeddings = {theirs[2]}"
            if ours is not None and ours[3:] == theirs[3:]
            else " (and model.rope_scaling = 'flavor')"
        )
    return " (and model.rope_scaling = 'flavor')" if ours is None else ""


def yarn_ratio(s: dict, cfg: dict) -> float | None:
    """max_position_embeddings / original_max_position_embeddings, which transformers 4.x
    takes as YaRN's factor whenever the original is given (5.x only where factor is not)."""
    original, longest = (
        s.get("original_max_position_embeddings"),
        cfg.get("max_position_embeddings"),
    )
    return longest / original if original and longest else None


def _scaling_tuple(s: dict, cfg: dict):
    """A config.json's RoPE scaling as a comparable tuple (transformers' defaults filled in)."""
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "default":
        return None
    if kind == "yarn":
        original = int(
            s.get("original_max_position_embeddings") or cfg.get("max_position_embeddings", 0)
        )
        return (
            "yarn",
            float(s.get("factor") or yarn_ratio(s, cfg) or 0.0),
            original,
            float(s.get("beta_fast") or 32.0),
            float(s.get("beta_slow") or 1.0),
            float(s.get("mscale") or 0.0),
            float(s.get("mscale_all_dim") or 0.0),
            bool(s.get("truncate", True)),
        )
    if kind != "llama3":
        return (kind,)
    return (
        "llama3",
        float(s["factor"]),
        float(s["low_freq_factor"]),
        float(s["high_freq_factor"]),
        int(s["original_max_position_embeddings"]),
    )


def _our_scaling(s):
    if s is None:
        return None
    if isinstance(s, YarnScaling):
        return (
            "yarn",
            float(s.factor),
            int(s.original_max_position_embeddings),
            float(s.beta_fast),
            float(s.beta_slow),
            float(s.mscale),
            float(s.mscale_all_dim),
            bool(s.truncate),
        )
    return (
        "llama3",
        float(s.factor),
        float(s.low_freq_factor),
        float(s.high_freq_factor),
        int(s.original_max_position_embeddings),
    )
