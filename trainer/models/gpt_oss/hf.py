"""gpt-oss's release format (GptOssForCausalLM) in and out of a run.

Names: ours are the plain decoder's (model.py); the release's are `model.layers.i.self_attn.
{q,k,v,o}_proj.{weight,bias}`, `self_attn.sinks`, `mlp.router.{weight,bias}`, and the experts
fused: `mlp.experts.gate_up_proj` [E, dim, 2 hidden] with gate and up in alternate columns
(gate first), `gate_up_proj_bias` [E, 2 hidden] alike, `down_proj` [E, hidden, dim] and
`down_proj_bias` [E, dim].

MXFP4 (the releases' experts, `quantization_config.quant_method = "mxfp4"`): `{name}_blocks`
[E, rows, groups, 16] uint8 holds 32 e2m1 values per group (two per byte, the low nibble
first) and `{name}_scales` [E, rows, groups] one e8m0 exponent per group: value =
e2m1 x 2^(scale - 127), over the rows of the transposed tensor (gate_up: [E, 2 hidden, dim]).
An import dequantizes them as transformers does (exact: each value is an e2m1 times a power
of two), a layer at a time; an export writes the experts unquantized and says so.

The import reads config.json's shape and settings against the flavor (`check_config`): a
folder of another shape, window, layer pattern, RoPE or expert count is refused in one line.
"""

from __future__ import annotations

import os

import torch

from trainer.errors import ConfigError
from trainer.models.common.rope import YarnScaling, yarn_from_config, yarn_to_config

# e2m1's 16 codes (sign, 2 exponent bits, 1 mantissa bit)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

_LAYER = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.sinks": "self_attn.sinks",
    "feed_forward.router.gate.weight": "mlp.router.weight",
    "feed_forward.router.gate.bias": "mlp.router.bias",
    **{
        f"attention.w{p}.{kind}": f"self_attn.{p}_proj.{kind}"
        for p in "qkvo"
        for kind in ("weight", "bias")
    },
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_EXPERTS = ("w1", "w2", "w3", "b1", "b2", "b3")


def param_shapes(args) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes, in model order."""
    d, m = args.dim, args.moe
    q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
    e, h = m.n_experts, m.hidden_dim
    shapes = {"tok_embeddings.weight": (args.vocab_size, d)}
    for i in range(args.n_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attention_norm.weight": (d,),
                p + "attention.wq.weight": (q, d),
                p + "attention.wq.bias": (q,),
                p + "attention.wk.weight": (kv, d),
                p + "attention.wk.bias": (kv,),
                p + "attention.wv.weight": (kv, d),
                p + "attention.wv.bias": (kv,),
                p + "attention.wo.weight": (d, q),
                p + "attention.wo.bias": (d,),
                p + "attention.sinks": (args.n_heads,),
                p + "ffn_norm.weight": (d,),
                p + "feed_forward.router.gate.weight": (e, d),
                p + "feed_forward.router.gate.bias": (e,),
                p + "feed_forward.experts.w1": (e, h, d),
                p + "feed_forward.experts.w2": (e, d, h),
                p + "feed_forward.experts.w3": (e, h, d),
                p + "feed_forward.experts.b1": (e, h),
                p + "feed_forward.experts.b2": (e, d),
                p + "feed_forward.experts.b3": (e, h),
            }
        )
    shapes["norm.weight"] = (d,)
    if not args.tie_word_embeddings:
        shapes["output.weight"] = (args.vocab_size, d)
    return shapes


# --------------------------------------------------------------------------- tensors


def to_release(ours: dict[str, torch.Tensor], args) -> dict[str, torch.Tensor]:
    """Our full tensors (param_shapes' names) -> the release's (unquantized)."""
    out = {}
    for name, t in ours.items():
        if name in _TOP:
            out[_TOP[name]] = t
            continue
        _, i, rest = name.split(".", 2)
        if rest.startswith("feed_forward.experts."):
            continue
        out[f"model.layers.{i}.{_LAYER[rest]}"] = t
    for i in range(args.n_layers):
        p, x = f"layers.{i}.feed_forward.experts.", f"model.layers.{i}.mlp.experts."
        w1, w2, w3, b1, b2, b3 = (ours[p + w] for w in _EXPERTS)
        out[x + "gate_up_proj"] = torch.stack((w1, w3), dim=2).flatten(1, 2).transpose(1, 2)
        out[x + "gate_up_proj_bias"] = torch.stack((b1, b3), dim=2).flatten(1, 2)
        out[x + "down_proj"] = w2.transpose(1, 2)
        out[x + "down_proj_bias"] = b2
    return out


def _expert_rows(get, has, key: str, experts: slice) -> torch.Tensor:
    """The release's expert tensor `key`, its `experts`, as rows of outputs: [e, out, in]."""
    if has(key + "_blocks"):
        return dequantize_mxfp4(get(key + "_blocks")[experts], get(key + "_scales")[experts])
    return get(key)[experts].transpose(1, 2)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[E, rows, groups, 16] uint8 e2m1 pairs and [E, rows, groups] e8m0 exponents -> float32
    [E, rows, groups x 32] (see the module docstring)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype}, {scales.dtype}")
    if tuple(blocks.shape[:-1]) != tuple(scales.shape) or blocks.shape[-1] != 16:
        raise ValueError(
            f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: the blocks "
            "hold 16 bytes per scale"
        )
    codes = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((codes[b & 0x0F], codes[b >> 4]), dim=-1).flatten(-2)  # [.., 32]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2)


# --------------------------------------------------------------------------- config.json


def release_config(args, *, dtype: str, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json of a GptOssForCausalLM with these args (unquantized: no
    quantization_config)."""
    h, m = args.hybrid, args.moe
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": args.dim,
        "intermediate_size": m.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.top_k,
        "experts_per_token": m.top_k,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": _rope_config(args),
        "max_position_embeddings": args.max_seq_len,
        "initial_context_length": (
            args.rope_scaling.original_max_position_embeddings
            if isinstance(args.rope_scaling, YarnScaling)
            else args.max_seq_len
        ),
        "sliding_window": h.sliding_window,
        "layer_types": [h.layer_type(i) for i in range(args.n_layers)],
        "swiglu_limit": h.swiglu_limit,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "hidden_act": "silu",
        "tie_word_embeddings": args.tie_word_embeddings,
        "output_router_logits": False,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
    }


def _rope_config(args) -> dict:
    s = args.rope_scaling
    if isinstance(s, YarnScaling):
        cfg = {k: v for k, v in yarn_to_config(s).items() if k not in ("mscale", "mscale_all_dim")}
        return cfg if not (s.mscale or s.mscale_all_dim) else yarn_to_config(s)
    if s is not None:
        raise ConfigError(f"gpt-oss's release holds YaRN or plain RoPE, not {s}")
    return {"rope_type": "default"}


def _their_rope(cfg: dict):
    """config.json's RoPE scaling as ours (YarnScaling or None)."""
    s = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    kind = s.get("rope_type") or s.get("type") or "default"
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"config.json: rope_type {kind!r}; gpt-oss's releases use 'yarn'")
    return yarn_from_config(s, int(cfg.get("max_position_embeddings") or 4096))


def check_config(cfg: dict, args, folder: str, flavor: str) -> None:
    """Refuse (in one line naming the key) a folder whose config.json is not this flavor."""
    if cfg.get("model_type") != "gpt_oss":
        raise ConfigError(
            f"{folder}: config.json's model_type is {cfg.get('model_type')!r}, not "
            f"'gpt_oss'; model.name = 'gpt_oss' loads GptOssForCausalLM folders"
        )
    h, m = args.hybrid, args.moe
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta")
    pairs = {
        "hidden_size": (cfg.get("hidden_size"), args.dim),
        "num_hidden_layers": (cfg.get("num_hidden_layers"), args.n_layers),
        "num_attention_heads": (cfg.get("num_attention_heads"), args.n_heads),
        "num_key_value_heads": (cfg.get("num_key_value_heads"), args.n_kv_heads),
        "head_dim": (cfg.get("head_dim"), args.head_dim),
        "intermediate_size": (cfg.get("intermediate_size"), m.hidden_dim),
        "num_local_experts": (cfg.get("num_local_experts"), m.n_experts),
        "num_experts_per_tok": (
            cfg.get("num_experts_per_tok") or cfg.get("experts_per_token"),
            m.top_k,
        ),
        "sliding_window": (cfg.get("sliding_window"), h.sliding_window),
        "swiglu_limit": (float(cfg.get("swiglu_limit", 7.0)), h.swiglu_limit),
        "rope_theta": (float(theta or 150000.0), float(args.rope_theta)),
        "rms_norm_eps": (float(cfg.get("rms_norm_eps", 1e-5)), args.norm_eps),
        "tie_word_embeddings": (
            bool(cfg.get("tie_word_embeddings", False)),
            args.tie_word_embeddings,
        ),
    }
    types = cfg.get("layer_types") or [
        "sliding_attention" if i % 2 == 0 else "full_attention"
        for i in range(int(cfg.get("num_hidden_layers") or 0))
    ]
    pairs["layer_types"] = (list(types), [h.layer_type(i) for i in range(args.n_layers)])
    pairs["rope_scaling"] = (_their_rope(cfg), args.rope_scaling)
    for key, (theirs, ours) in pairs.items():
        if theirs != ours:
            raise ConfigError(
                f"{folder} does not fit model.flavor = {flavor!r}: config.json's {key} is "
                f"{theirs}, the flavor's {ours}; choose the flavor the checkpoint was made with"
                + (
                    " (model.n_layers keeps the flavor's first layers)"
                    if key == "num_hidden_layers"
                    else ""
                )
            )


# --------------------------------------------------------------------------- in and out


def release_into(model, hf, folder: str, flavor: str, log=print):
    """(our tensor, its full value) for every parameter of `model` (a DTensor shard or a
    plain tensor; a pipeline stage's only) but the experts, read from the folder `hf`
    (trainer/hf/weights.HFFolder) a layer at a time: the caller copies each into place. Of
    each layer's experts only this rank's are read (and, MXFP4, dequantized), and copied into
    place here: a rank of EP 8 at gpt-oss-120b reads 16 of the 128 experts."""
    args = model.args
    check_config(hf.config, args, folder, flavor)
    q = (hf.config.get("quantization_config") or {}).get("quant_method")
    if q == "mxfp4":
        log(f"{folder} holds its experts in MXFP4: each rank dequantizes its own as it reads them")
    tensors = dict(model.named_parameters())
    missing = [k for k in _keys(args) if not hf.has(k)]
    if missing:
        raise ConfigError(
            f"{folder} lacks {len(missing)} of this model's tensors (e.g. {missing[0]}); "
            f"is it a {flavor} checkpoint?"
        )
    for top, theirs in _TOP.items():
        if top in tensors:
            yield _fitting(tensors, top, hf.tensor(theirs), folder, flavor)
    for i in range(args.n_layers):
        x = f"model.layers.{i}."
        for ours, theirs in _LAYER.items():
            name = f"layers.{i}.{ours}"
            if name in tensors:
                yield _fitting(tensors, name, hf.tensor(x + theirs), folder, flavor)
        mine = {w: tensors.get(f"layers.{i}.feed_forward.experts.{w}") for w in _EXPERTS}
        if all(t is not None for t in mine.values()):
            _copy_experts(mine, hf.tensor, hf.has, i, args, folder, flavor)


def _fitting(tensors, name: str, full: torch.Tensor, folder: str, flavor: str):
    if tuple(full.shape) != tuple(tensors[name].shape):
        raise ConfigError(
            f"{folder} does not fit model.flavor = {flavor!r}: {name} has shape "
            f"{list(full.shape)} there and {list(tensors[name].shape)} here; choose "
            "the flavor and model.vocab_size the checkpoint was made with"
        )
    return tensors[name], full


@torch.no_grad()
def _copy_experts(mine: dict, get, has, i: int, args, folder: str, flavor: str) -> None:
    """Layer i's experts of this rank (`mine`: w1 ... b3, plain or DTensor shards) from the
    release, only the experts each holds read and dequantized."""
    from trainer.hf.load import copy_full, local_region

    e = f"model.layers.{i}.mlp.experts."
    want = (args.moe.n_experts, 2 * args.moe.hidden_dim)
    shape = get(e + "gate_up_proj_bias").shape
    if tuple(shape) != want:
        raise ConfigError(
            f"{folder} does not fit model.flavor = {flavor!r}: {e}gate_up_proj_bias has "
            f"shape {list(shape)} there and {list(want)} here"
        )
    regions = {w: local_region(t) for w, t in mine.items()}
    if any(r is None for r in regions.values()):  # a strided layout: cut from the whole
        for w, full in layer_experts(get, has, i, slice(None)).items():
            copy_full(mine[w], full)
        return
    experts = regions["w1"][0]
    pieces = layer_experts(get, has, i, experts)
    for w, t in mine.items():
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.numel():
            local.copy_(pieces[w][(slice(None), *regions[w][1:])].to(local.dtype))


def layer_experts(get, has, i: int, experts: slice) -> dict[str, torch.Tensor]:
    """Layer i's experts `experts` under our names (w1 ... b3), from `get(key)` (the
    release's tensors; experts in bf16/fp32 or MXFP4) and `has(key)`."""
    e = f"model.layers.{i}.mlp.experts."
    gate_up = _expert_rows(get, has, e + "gate_up_proj", experts)  # [e, 2 hidden, dim]
    bias = get(e + "gate_up_proj_bias")[experts]
    return {
        "w1": gate_up[:, 0::2],
        "w3": gate_up[:, 1::2],
        "b1": bias[:, 0::2],
        "b3": bias[:, 1::2],
        "w2": _expert_rows(get, has, e + "down_proj", experts),  # [e, dim, hidden]
        "b2": get(e + "down_proj_bias")[experts],
    }


def _keys(args) -> list[str]:
    """The release keys an import reads (the experts' unquantized or MXFP4 names aside)."""
    keys = [v for k, v in _TOP.items() if k != "output.weight" or not args.tie_word_embeddings]
    for i in range(args.n_layers):
        keys += [f"model.layers.{i}.{theirs}" for theirs in _LAYER.values()]
    return keys


def write_release(
    out_dir: str, args, fetch, *, dtype: str, max_shard_bytes: int, log=print
) -> list[str]:
    """Write GptOssForCausalLM's tensors (unquantized, in `dtype`) from `fetch(names)`, in
    safetensors files of at most max_shard_bytes; a non-zero balancing bias has no place
    there: said, and left out."""
    from safetensors.torch import save_file

    from trainer.hf.mapping import routing_bias_note
    from trainer.hf.weights import DTYPES, INDEX, SINGLE, plan_shards, write_json

    names = list(param_shapes(args))
    biases = [f"layers.{i}.feed_forward.router.expert_bias" for i in range(args.n_layers)]
    ours = fetch(names + biases)
    note = routing_bias_note({n: ours.pop(n) for n in biases}, "GptOssForCausalLM")
    if note:
        log(note)
    log("the experts are written unquantized (the release's are MXFP4)")
    target = DTYPES[dtype]
    release = {k: t.to(target, copy=True).contiguous() for k, t in to_release(ours, args).items()}
    shards = plan_shards(
        {k: t.numel() for k, t in release.items()}, target.itemsize, max_shard_bytes
    )
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for keys, fname in zip(shards, files, strict=True):
        save_file(
            {k: release[k] for k in keys}, os.path.join(out_dir, fname), metadata={"format": "pt"}
        )
    if len(files) > 1:
        write_json(
            os.path.join(out_dir, INDEX),
            {
                "metadata": {
                    "total_size": sum(t.numel() * target.itemsize for t in release.values())
                },
                "weight_map": {k: f for keys, f in zip(shards, files, strict=True) for k in keys},
            },
        )
    return files
