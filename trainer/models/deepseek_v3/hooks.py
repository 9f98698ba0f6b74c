"""DeepSeek-V3's answers to the family contract (trainer/models/hooks.py): the decoder with
multi-head latent attention in every block, its FLOPs and plan terms, its tensor-parallel
styles and its release format. Imported when a run first asks; torch-free until a method
needs it."""

from __future__ import annotations

from trainer.models.hooks import DecoderHooks


class DeepSeekHooks(DecoderHooks):
    def build(self, args):
        from trainer.models.common.decoder import Transformer
        from trainer.models.common.mla import MLA

        return Transformer(args, attention=MLA)

    def attention_line(self, args) -> str:
        m = args.mla
        return (
            f"multi-head latent attention (q_lora_rank {m.q_lora_rank}, kv_lora_rank "
            f"{m.kv_lora_rank}; query/key heads {m.qk_nope_head_dim} + {m.qk_rope_head_dim} "
            f"rotated, value heads {m.v_head_dim}), "
        )

    def block_matmul_params(self, args, block: int) -> int:
        """MLA's projections, without its two latent norms, and the block's FFN."""
        m, d = args.mla, args.dim
        attention = m.params(d, args.n_heads) - m.q_lora_rank - m.kv_lora_rank
        ffn = args.moe.active_ffn(d) if args.is_moe_layer(block) else 3 * d * args.hidden_dim
        return attention + ffn

    def tp_mixer_styles(self, block, tp_mesh, model, colwise, prepare_input):
        from trainer.models.deepseek_v3.parallelize import mla_styles

        return "attention", mla_styles(block.attention, tp_mesh, colwise, prepare_input)

    def plan_attention_saved(self, a, p: int, tp: int, kernel: str) -> int:
        from trainer.models.deepseek_v3.plan import mla_saved

        return mla_saved(a, p, tp, kernel)

    def plan_attention_kept(self, a, tp: int, every_other: bool) -> tuple[int, int]:
        from trainer.models.deepseek_v3.plan import mla_kept

        return mla_kept(a, tp, every_other)

    def plan_cp_attention(self, a, p: int, batch: int, seq: int, tp: int) -> int:
        from trainer.models.deepseek_v3.plan import mla_cp_saved

        return mla_cp_saved(a, p, batch, seq, tp)

    def plan_cp_gathered(self, a) -> int:
        # MLA gathers its latents and the shared RoPE key (trainer/models/common/mla.py)
        return a.mla.kv_lora_rank + a.mla.qk_rope_head_dim

    def hf_adapter(self):
        from trainer.models.deepseek_v3.hf import DeepSeekHF

        return DeepSeekHF()

    def hf_router_problem(self, args) -> str | None:
        if args.moe is not None and (args.moe.score_func != "sigmoid" or args.moe.sparse_step != 1):
            return (
                "MLA with a softmax router or sparse_step > 1: DeepseekV3ForCausalLM "
                "routes by sigmoid scores in every block after the first dense ones"
            )
        return None


HOOKS = DeepSeekHooks()
