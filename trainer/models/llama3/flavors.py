"""The plain decoder's flavors (`model.flavor`): Llama 3, 3.1 and 3.2 as released and at
their pretraining shapes, Qwen3-30B-A3B (GQA with q/k norms and a softmax-routed MoE), and the
CPU-sized debug models the tests and smoke runs use. Without torch: a config is checked before
any process starts."""

from __future__ import annotations

from trainer.models.args import ModelArgs, MoEArgs
from trainer.models.common.rope import LLAMA3_ROPE_SCALING, LLAMA31_ROPE_SCALING

FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(
        dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=64
    ),
    # A 2-layer, dim-64 slice for smoke runs and the end-to-end tests: every code path of the
    # debug model (GQA, FSDP per block, DCP) at a fraction of its startup and step time.
    "debugmodel-tiny": ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192, multiple_of=32
    ),
    # The debug model's depth and heads (8 query, 4 KV: GQA) at dim 64: the layout tests' model
    # (PP splits its 6 layers, TP 4 divides its KV heads) at a fraction of the weights to init,
    # gather, reduce and save.
    "debugmodel-narrow": ModelArgs(
        dim=64, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=8192, multiple_of=32
    ),
    # Mixtures of experts at about the debug model's active size: 4 blocks, the first dense,
    # 8 experts of width 352, top 2 (2 x 352 = the dense width 704). Qwen3-MoE's layout
    # (softmax router, q/k norms, no shared expert: exports to Qwen3MoeForCausalLM), and
    # DeepSeek's (sigmoid scores, one shared expert).
    "debugmodel-moe": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=8192,
        multiple_of=64,
        qk_norm=True,
        norm_eps=1e-6,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=352, first_dense_layers=1),
    ),
    # debugmodel-moe at dim 64 (the MoE layout tests' model): the same layout, experts of width 96
    # (2 x 96 = the dense width 192).
    "debugmodel-moe-narrow": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=8192,
        multiple_of=32,
        qk_norm=True,
        norm_eps=1e-6,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=96, first_dense_layers=1),
    ),
    "debugmodel-moe-shared": ModelArgs(
        dim=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=8192,
        multiple_of=64,
        moe=MoEArgs(
            n_experts=8,
            top_k=2,
            hidden_dim=352,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=1.0,
        ),
    ),
    # Qwen3-30B-A3B as released: 48 MoE blocks of 128 experts (width 768), top 8, 3.3B active.
    "qwen3-30b-a3b": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        explicit_head_dim=128,
        vocab_size=151936,
        multiple_of=256,
        ffn_dim_multiplier=2.25,
        norm_eps=1e-6,
        rope_theta=1e6,
        qk_norm=True,
        moe=MoEArgs(n_experts=128, top_k=8, hidden_dim=768),
    ),
    # The debug shape with Llama-3.2's tied embeddings and RoPE scaling (tests, smoke runs).
    "debugmodel-3.2": ModelArgs(
        dim=256,
        n_layers=6,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=8192,
        multiple_of=64,
        rope_scaling=LLAMA3_ROPE_SCALING,
        tie_word_embeddings=True,
    ),
    # Llama-3.2-1B and -3B as released (tied embeddings, llama3 RoPE scaling): they load the
    # public Hugging Face weights (checkpoint.initial_load_path).
    "llama3.2-1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_scaling=LLAMA3_ROPE_SCALING,
        tie_word_embeddings=True,
    ),
    "llama3.2-3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_scaling=LLAMA3_ROPE_SCALING,
        tie_word_embeddings=True,
    ),
    # The Llama-3.2-1B shape with an untied output head and no RoPE scaling, Llama-3.1-8B and
    # -70B and -405B (without RoPE scaling: pretraining at <= 8k context does not need it).
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
    ),
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
    ),
    # Llama-3.1 8B and 70B as released, with their RoPE scaling: long-context stages (128k)
    "llama3.1-8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "llama3.1-70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_scaling=LLAMA31_ROPE_SCALING,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=128256,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
    ),
}
