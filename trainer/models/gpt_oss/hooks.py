"""gpt-oss's answers to the family contract (trainer/models/hooks.py): its model, its
windowed layers' FLOPs, its sinks' tensor-parallel split and its release format. Imported
when a run first asks; torch-free until a method needs it."""

from __future__ import annotations

from trainer.models.hooks import DecoderHooks


class GptOssHooks(DecoderHooks):
    def build(self, args):
        from trainer.models.gpt_oss.model import GptOss

        return GptOss(args)

    def attention_summary(self, args, device_type: str) -> str:
        h = args.hybrid
        sliding = [i for i in range(args.n_layers) if h.window(i)]
        mask = (
            "block_causal (a token sees earlier tokens of its own document only)"
            if args.attn_mask_type == "block_causal"
            else "causal"
        )
        kernel = (
            "FlexAttention (compiled) returning its log-sum-exp, one BlockMask per window"
            if device_type == "cuda"
            else "torch's CPU flash kernel returning its log-sum-exp, one additive mask per window"
        )
        return (
            f"attention: GQA with a sink logit per head and q/k/v/o biases, {mask}; a "
            f"window of {h.sliding_window} tokens in {len(sliding)} of {args.n_layers} layers "
            f"(sliding_attention), the others over the whole window; {kernel}, the output "
            f"rescaled by sigmoid(lse - sink); RoPE positions: {args.positions}"
        )

    def kernel_note(self, device_type: str) -> str:
        return "; gpt-oss's attention with sinks runs its own kernel (the attention line)"

    def layer_kind(self, args, block: int) -> str:
        return args.hybrid.block_mixer(args, block)

    whole_model_for_a_layer = True  # its layers' windows alternate through the model

    # ------------------------------------------------------------------ FLOPs

    def block_attention_flops(self, args, block: int, seq_len: int, causal_half: bool):
        """A sliding layer's queries each see at most `window` keys: counted as that many
        (or, with `causal_half`, the mean keys a query sees), full layers as the decoder's."""
        window = args.hybrid.window(block)
        if not window:
            return None
        if causal_half:
            keys = sum(min(i + 1, window) for i in range(seq_len)) / seq_len
        else:
            keys = min(window, seq_len)
        return 6.0 * args.n_heads * (args.head_dim + args.v_head_dim) * keys

    # ------------------------------------------------------------------ tensor parallelism

    def tp_mixer_styles(self, block, tp_mesh, model, colwise, prepare_input):
        from torch import nn
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor

        attention = block.attention
        # each tp rank's heads' sinks: a Shard(0) DTensor, as the heads of wq
        attention.register_parameter(
            "sinks", nn.Parameter(distribute_tensor(attention.sinks, tp_mesh, [Shard(0)]))
        )
        return "attention", {
            "attention": prepare_input(
                input_layouts=(Shard(1), None, None, None),
                desired_input_layouts=(Replicate(), None, None, None),
            ),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
        }

    # ------------------------------------------------------------------ the memory plan

    def plan_blocks_activations(self, a, p, tokens, **how):
        from trainer.models.gpt_oss.plan import blocks_activations

        return blocks_activations(a, p, tokens, **how)

    def plan_largest_block(self, a, p, tokens, tp, ep, documents, seq):
        from trainer.models.gpt_oss.plan import largest_block

        return largest_block(a, p, tokens, tp, ep, documents, seq)

    # ------------------------------------------------------------------ Hugging Face

    def hf_param_shapes(self, args) -> dict:
        from trainer.models.gpt_oss.hf import param_shapes

        return param_shapes(args)

    def hf_export_problem(self, args) -> str | None:
        return None

    def hf_load(self, model, hf, folder: str, flavor: str, log):
        from trainer.models.gpt_oss.hf import release_into

        return release_into(model, hf, folder, flavor, log=log)

    def hf_export(self, out_dir: str, args, fetch, *, dtype, max_shard_bytes, log):
        from trainer.models.gpt_oss.hf import release_config, write_release

        files = write_release(
            out_dir, args, fetch, dtype=dtype, max_shard_bytes=max_shard_bytes, log=log
        )
        return release_config, files


HOOKS = GptOssHooks()
