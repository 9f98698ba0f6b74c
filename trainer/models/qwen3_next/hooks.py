"""Qwen3-Next's answers to the family contract (trainer/models/hooks.py): its model, its
Gated DeltaNet's FLOPs and tensor-parallel styles, its blocks in the memory plan, and its
release format on the way to and from Hugging Face."""

from __future__ import annotations

from trainer.models.hooks import DecoderHooks
from trainer.models.qwen3_next.args import LINEAR


class Qwen3NextHooks(DecoderHooks):
    def build(self, args):
        from trainer.models.qwen3_next.model import Qwen3Next

        return Qwen3Next(args)

    def kernel_note(self, device_type: str) -> str:
        from trainer.models.qwen3_next.deltanet import kernel_name

        return f"; Gated DeltaNet: {kernel_name(device_type)}"

    def layer_kind(self, args, block: int) -> str:
        return args.hybrid.block_mixer(args, block)

    # ------------------------------------------------------------------ FLOPs

    def block_matmul_params(self, args, block: int) -> int:
        """The layer's mixer (a Gated DeltaNet's wq, wk, wv, wz, wo, wb, wa, or the gated
        attention's queries with their gates, keys, values and output) and its FFN (with a
        MoE layer's gated shared expert)."""
        h, d = args.hybrid, args.dim
        if h.block_mixer(args, block) == LINEAR:
            mixer = d * (2 * h.keys + 3 * h.values + 2 * h.linear_v_heads)
        else:
            mixer = d * args.head_dim * (3 * args.n_heads + 2 * args.n_kv_heads)
        if args.is_moe_layer(block):
            return mixer + args.moe.active_ffn(d) + h.shared_params(d)
        return mixer + 3 * d * args.hidden_dim

    def block_attention_flops(self, args, block: int, seq_len: int, causal_half: bool):
        """A Gated DeltaNet layer's chunked recurrence (no causal halving applies to it)."""
        if args.hybrid.block_mixer(args, block) != LINEAR:
            return None
        return deltanet_flops(args.hybrid)

    # ------------------------------------------------------------------ tensor parallelism

    def tp_dims(self, args) -> dict[str, int]:
        h = args.hybrid
        return {"linear_k_heads": h.linear_k_heads, "linear_v_heads": h.linear_v_heads}

    def tp_mixer_styles(self, block, tp_mesh, model, colwise, prepare_input):
        if not hasattr(block, "linear_attention"):
            return None  # a gated attention layer: attention's styles (its gate rides wq's rows)
        return "linear_attention", deltanet_styles(
            block.linear_attention, tp_mesh, model, colwise, prepare_input
        )

    # ------------------------------------------------------------------ the memory plan

    def plan_blocks_activations(self, a, p, tokens, **how):
        from trainer.models.qwen3_next.plan import blocks_activations

        return blocks_activations(a, p, tokens, **how)

    def plan_largest_block(self, a, p, tokens, tp, ep, documents, seq):
        from trainer.models.qwen3_next.plan import largest_block

        return largest_block(a, p, tokens, tp, ep, documents, seq)

    whole_model_for_a_layer = True  # its layers' kinds follow layer_types through the model

    # ------------------------------------------------------------------ Hugging Face

    def hf_param_shapes(self, args) -> dict:
        from trainer.models.qwen3_next.hf import hybrid_shapes

        return hybrid_shapes(args)

    def hf_export_problem(self, args) -> str | None:
        from trainer.models.qwen3_next.hf import export_problem

        return export_problem(args)

    def hf_load(self, model, hf, folder: str, flavor: str, log):
        """The release's fused tensors, read a layer at a time."""
        from trainer.models.qwen3_next.hf_io import release_into

        return release_into(model, hf, folder, flavor, log=log)

    def hf_export(self, out_dir: str, args, fetch, *, dtype, max_shard_bytes, log):
        from trainer.models.qwen3_next.hf import release_config
        from trainer.models.qwen3_next.hf_io import write_release

        files = write_release(
            out_dir, args, fetch, dtype=dtype, max_shard_bytes=max_shard_bytes, log=log
        )
        return release_config, files


def deltanet_flops(h, chunk: int = 64) -> float:
    """One Gated DeltaNet layer's recurrence per token, forward + backward (x3), in the chunked
    form (deltanet.py): per value head, with dk / dv its key / value widths, the state's
    readout q.S, the correction k.S and the update k^T u (2 dk dv each), and within the chunk
    the scores q.k^T and k.k^T (2 C dk each) and their products with the values (2 C dv each).
    The UT transform's triangular solve (~C^2 / 3 per token) is left out."""
    dk, dv, c = h.linear_k_head_dim, h.linear_v_head_dim, chunk
    return 3.0 * h.linear_v_heads * (6 * dk * dv + 4 * c * dk + 4 * c * dv)


def deltanet_styles(layer, tp_mesh, model, colwise, prepare_input) -> dict:
    """A Gated DeltaNet layer (model.py) split by heads: its projections colwise (wq, wk: key
    heads; wv, wz: value heads; wb, wa: a row per value head), the convolutions' channels,
    A_log and dt_bias as Shard(0) DTensors (the forward takes their local rows: each rank's
    heads, their channels), `wo` rowwise. The recurrence runs over the whole sequence, so the
    layer's input is gathered as attention's is. The gated norm's weight, shared by every head,
    stays a plain tensor; each rank's gradient holds its heads' share, summed over tp once a
    step with the MoE's (trainer/parallel/tp.py's `sum_partial_grads`)."""
    from torch import nn
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from trainer.errors import ConfigError

    heads = {
        "linear_k_heads": layer.wq.out_features // layer.k_head_dim,
        "linear_v_heads": layer.wb.out_features,
    }
    for what, n in heads.items():
        if n % tp_mesh.size():
            raise ConfigError(
                f"parallelism.tensor_parallel_degree = {tp_mesh.size()} does not "
                f"divide the Gated DeltaNet's {what} = {n}"
            )
    for name in ("conv_q", "conv_k", "conv_v", "A_log", "dt_bias"):
        param = getattr(layer, name)
        layer.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, tp_mesh, [Shard(0)]), requires_grad=param.requires_grad
            ),
        )
    partial = model.__dict__.setdefault("_tp_partial", [tp_mesh.get_group(), []])
    partial[1].append(layer.norm)
    # (x, doc_ids): x gathered to the whole sequence; the documents are every rank's
    styles = {
        "linear_attention": prepare_input(
            input_layouts=(Shard(1), None),
            desired_input_layouts=(Replicate(), None),
            use_local_output=True,
        )
    }
    styles.update(
        {f"linear_attention.{w}": colwise() for w in ("wq", "wk", "wv", "wz", "wb", "wa")}
    )
    return styles


HOOKS = Qwen3NextHooks()
