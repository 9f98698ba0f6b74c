"""Model shapes: `ModelArgs` and the named flavors, without importing torch.

Kept apart from model.py so that validating a config (before any process starts) and the
memory plan stay fast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from trainer.models.hybrid import FULL, LINEAR, HybridArgs  # noqa: F401  (re-exported)
from trainer.models.rope import (
    DEEPSEEK_V3_YARN,
    KIMI_K2_YARN,
    LLAMA3_ROPE_SCALING,  # noqa: F401
    LLAMA31_ROPE_SCALING,
    RopeScaling,
    YarnScaling,
)


@dataclass(frozen=True)
class MoEArgs:
    """Mixture of experts (trainer/models/moe.py): which blocks have one, and its shape. The
    training knobs (capacity, loss weights) come from the config's [moe] section."""

    n_experts: int = 8
    top_k: int = 2
    hidden_dim: int = 384  # each routed expert's SwiGLU width
    n_shared_experts: int = 0  # experts of hidden_dim every token goes through (DeepSeek)
    score_func: str = "softmax"  # or "sigmoid" (DeepSeek-V3)
    norm_topk_prob: bool = True  # renormalise the chosen experts' weights to sum to 1
    route_scale: float = 1.0
    first_dense_layers: int = 0  # the first k blocks keep a dense FFN (DeepSeek)
    sparse_step: int = 1  # then every sparse_step-th block is MoE (Qwen3-MoE decoder_sparse_step)
    capacity_factor: float = 0.0  # 0 = dropless
    aux_loss_weight: float = 0.0
    seq_aux_loss_weight: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (alpha)
    router_z_loss_weight: float = 0.0
    # Group-limited routing (DeepSeek-V3): the experts form n_group groups; a token picks the
    # topk_group groups with the largest sum of their two best (biased) scores, then its
    # top_k experts within them. 1 group: plain top-k.
    n_group: int = 1
    topk_group: int = 1
    # Expert parallelism (trainer/parallel/expert_parallel.py): the dispatch ("auto", "flat",
    # "node") and whether the AC recompute reuses the dispatched rows.
    dispatch: str = "auto"
    save_dispatch: bool = True

    def hybrid_layer_type(self, block: int) -> str:
        """The hybrid's mixer in `block`: its layer's (layer_types), and full attention in an
        MTP block (block >= n_layers), as Qwen3-Next's release has it (mtp.layers.0.self_attn)."""
        return FULL if block >= self.n_layers else self.hybrid.layer_type(block)

    def is_moe_layer(self, layer_id: int) -> bool:
        """Qwen3-MoE's rule ((i + 1) % step == 0) after the first dense layers."""
        return layer_id >= self.first_dense_layers and (layer_id + 1) % self.sparse_step == 0

    NO_HF = (
        "shared experts, sigmoid scores or a routed scale: DeepSeek's router, whose Hugging "
        "Face architecture (DeepseekV3ForCausalLM) also needs MLA: the deepseek_v3 flavors "
        "(debugmodel-dsv3, deepseek-v3-16b, ...) export; Qwen3-MoE flavors (debugmodel-moe, "
        "qwen3-30b-a3b) export to Qwen3MoeForCausalLM"
    )

    @property
    def hf_exportable(self) -> bool:
        """Whether Qwen3MoeForCausalLM can hold it: a softmax router, no shared experts, no
        routed scale, no groups (DeepSeek-V3's router goes with MLA: DeepseekV3ForCausalLM)."""
        return (
            not self.n_shared_experts
            and self.score_func == "softmax"
            and self.route_scale == 1.0
            and self.n_group == 1
        )

    def validate(self) -> None:
        from trainer.errors import ConfigError

        if self.n_group < 1 or self.n_experts % self.n_group:
            valid = [d for d in range(1, self.n_experts + 1) if self.n_experts % d == 0]
            raise ConfigError(
                f"moe.n_group = {self.n_group}: the {self.n_experts} experts "
                f"(moe.num_experts) do not divide into that many groups; valid: "
                f"{', '.join(map(str, valid))}"
            )
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"moe.topk_group = {self.topk_group} must be between 1 and "
                f"moe.n_group = {self.n_group}"
            )
        per_group = self.n_experts // self.n_group
        if self.top_k > self.topk_group * per_group or (self.n_group > 1 and per_group < 2):
            raise ConfigError(
                f"moe.top_k = {self.top_k} needs at most moe.topk_group x experts "
                f"per group = {self.topk_group} x {per_group}, and groups of at "
                "least 2 experts (a group scores by its two best)"
            )

    def active_ffn(self, dim: int) -> int:
        """FFN parameters a token goes through: top_k routed + the shared experts + router."""
        return (
            3 * dim * self.hidden_dim * (self.top_k + self.n_shared_experts) + dim * self.n_experts
        )

    def total_ffn(self, dim: int) -> int:
        return (
            3 * dim * self.hidden_dim * (self.n_experts + self.n_shared_experts)
            + dim * self.n_experts
        )


@dataclass(frozen=True)
class MLAArgs:
    """Multi-head latent attention (DeepSeek-V2/V3, trainer/models/mla.py): queries through a
    low-rank path (or one projection with q_lora_rank 0), keys and values from one compressed
    latent per token plus a RoPE key shared by every head."""

    q_lora_rank: int = 0  # 0: a plain query projection (DeepSeek-V2-Lite, Moonlight)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128  # the query/key channels without rotation
    qk_rope_head_dim: int = 64  # the rotated channels (the key's are shared by all heads)
    v_head_dim: int = 128

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def params(self, dim: int, n_heads: int) -> int:
        q = (
            (
                dim * self.q_lora_rank
                + self.q_lora_rank
                + self.q_lora_rank * n_heads * self.qk_head_dim
            )
            if self.q_lora_rank
            else dim * n_heads * self.qk_head_dim
        )
        kv = (
            dim * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * n_heads * (self.qk_nope_head_dim + self.v_head_dim)
        )
        return q + kv + n_heads * self.v_head_dim * dim

    def validate(self) -> None:
        from trainer.errors import ConfigError

        dims = (
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        if min(dims) < 0 or min(dims[1:]) < 1 or self.qk_rope_head_dim % 2:
            raise ConfigError(
                f"model MLA dims do not add up: q_lora_rank {self.q_lora_rank} "
                f"(>= 0), kv_lora_rank {self.kv_lora_rank}, qk_nope_head_dim "
                f"{self.qk_nope_head_dim}, v_head_dim {self.v_head_dim} (>= 1) "
                f"and qk_rope_head_dim {self.qk_rope_head_dim} (even, >= 2)"
            )


@dataclass(frozen=True)
class ModelArgs:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 2048
    rope_scaling: RopeScaling | YarnScaling | None = None
    tie_word_embeddings: bool = False  # the output head reuses the token embedding
    # How tokens attend (trainer/models/attention.py); no parameter depends on them, so a checkpoint
    # loads under any of them. attn_implementation is resolved: sdpa, flex or per_document.
    attn_mask_type: str = "causal"  # or "block_causal"
    positions: str = "sequence"  # or "document"
    attn_implementation: str = "sdpa"
    moe: MoEArgs | None = None  # None: every block dense
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    explicit_head_dim: int = 0  # 0: dim // n_heads (Qwen3 sets 128 at any dim)
    explicit_hidden_dim: int = 0  # 0: the SwiGLU width from dim (DeepSeek sets its own)
    mla: MLAArgs | None = None  # multi-head latent attention in place of GQA (DeepSeek-V3)
    # Multi-token prediction (DeepSeek-V3, trainer/models/mtp.py): modules after the last
    # layer, the k-th predicting the token k + 1 further; their mean loss is added with this
    # weight (from the [model] section)
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3
    # Gated DeltaNet layers among gated attention layers (Qwen3-Next, Qwen3.5:
    # trainer/models/qwen3_next.py); None: every layer softmax attention
    hybrid: HybridArgs | None = None

    @property
    def family(self) -> str:
        """The model.name this shape belongs to."""
        return "qwen3_next" if self.hybrid else "deepseek_v3" if self.mla else "llama3"

    @property
    def head_dim(self) -> int:
        """A query/key head's width (MLA: nope + rope channels)."""
        if self.mla is not None:
            return self.mla.qk_head_dim
        return self.explicit_head_dim or self.dim // self.n_heads

    @property
    def v_head_dim(self) -> int:
        return self.mla.v_head_dim if self.mla is not None else self.head_dim

    @property
    def rope_dim(self) -> int:
        """The channels RoPE rotates per head (MLA: only qk_rope_head_dim of them; hybrid:
        partial_rotary_factor of them)."""
        if self.hybrid is not None:
            return int(self.head_dim * self.hybrid.partial_rotary_factor)
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def mtp_export_problem(self) -> str | None:
        """Why a Hugging Face export or import cannot hold this model's MTP modules, or None
        (a deepseek_v3 export writes them as the release's extra layers: trainer/hf/deepseek.py)."""
        if not self.mtp_layers or self.mla is not None:
            return None
        if self.hybrid is not None:  # Qwen3-Next: one fc and set of norms (mtp.fc, mtp.norm)
            return (
                None
                if self.mtp_layers == 1
                else (
                    f"model.mtp_layers = {self.mtp_layers}, but Qwen3-Next's release format holds "
                    "one MTP module (mtp.fc, mtp.pre_fc_norm_*, mtp.norm and mtp.layers.0; "
                    "num_nextn_predict_layers = 1), so an export or import could not hold the "
                    "others: use model.mtp_layers = 1 to exchange this model with Hugging Face"
                )
            )
        hf_class = "Qwen3MoeForCausalLM" if self.moe is not None else "LlamaForCausalLM"
        return (
            f"model.mtp_layers = {self.mtp_layers}, but {hf_class} has no multi-token "
            "prediction modules, so an export would hold a different model than the one "
            "trained (the DCP checkpoints keep them): train with model.mtp_layers = 0 to "
            "exchange this model with Hugging Face, or use a deepseek_v3 flavor (its "
            "export writes the MTP modules as the release's layers num_hidden_layers + k)"
        )

    def hybrid_layer_type(self, block: int) -> str:
        """The hybrid's mixer in `block`: its layer's (layer_types), and full attention in an
        MTP block (block >= n_layers), as Qwen3-Next's release has it (mtp.layers.0.self_attn)."""
        return FULL if block >= self.n_layers else self.hybrid.layer_type(block)

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer_id)

    @property
    def n_blocks(self) -> int:
        """Transformer blocks: the layers, then one per MTP module."""
        return self.n_layers + self.mtp_layers

    @property
    def moe_layer_ids(self) -> list[int]:
        """The blocks with a MoE feed-forward (MTP blocks count after the layers)."""
        return [i for i in range(self.n_blocks) if self.is_moe_layer(i)]

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, scaled by ffn_dim_multiplier, rounded up to multiple_of."""
        if self.explicit_hidden_dim:
            return self.explicit_hidden_dim
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self, embeddings: bool = True, active: bool = False) -> int:
        """All parameters; `active`: those one token goes through (MoE: top-k experts)."""
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = self.dim * (2 * q_dim + 2 * kv_dim) + (2 * self.head_dim if self.qk_norm else 0)
        if self.mla is not None:
            attn = self.mla.params(self.dim, self.n_heads)
        dense = 3 * self.dim * self.hidden_dim
        ffn = 0
        blocks = self.n_layers + self.mtp_layers  # an MTP module: a block + 2 norms, a projection
        mtp = self.mtp_layers * (2 * self.dim * self.dim + 3 * self.dim)
        for i in range(blocks):
            if not self.is_moe_layer(i):
                ffn += dense
            else:
                ffn += (self.moe.active_ffn if active else self.moe.total_ffn)(self.dim)
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        total = blocks * (attn + 2 * self.dim) + ffn + self.dim + head + mtp
        h = self.hybrid
        if h is not None:  # the mixers per layer type, and each MoE layer's shared expert
            full = sum(self.hybrid_layer_type(i) == FULL for i in range(blocks))
            total += (
                full * h.full_params(self.dim, self.n_heads, self.n_kv_heads, self.head_dim)
                - blocks * attn
            )
            total += (blocks - full) * h.linear_params(self.dim)
            total += h.shared_params(self.dim) * len(self.moe_layer_ids)
        return total + (self.vocab_size * self.dim if embeddings else 0)

    def validate(self) -> None:
        from trainer.errors import ConfigError

        if self.moe is not None:
            self.moe.validate()
        if self.mla is not None:
            self.mla.validate()
        elif self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ConfigError(
                f"model shape: dim {self.dim} must divide into n_heads "
                f"{self.n_heads} (even head_dim), and n_heads into n_kv_heads "
                f"{self.n_kv_heads}"
            )
        if self.hybrid is not None:
            self._validate_hybrid()
        if (
            self.attn_mask_type not in ("causal", "block_causal")
            or self.positions not in ("sequence", "document")
            or self.attn_implementation not in ("sdpa", "flex", "per_document")
        ):
            raise ConfigError(
                f"model attention: mask {self.attn_mask_type!r}, positions "
                f"{self.positions!r}, implementation {self.attn_implementation!r}"
            )

    def _validate_hybrid(self) -> None:
        from trainer.errors import ConfigError

        h = self.hybrid
        types = [h.layer_type(i) for i in range(self.n_layers)]
        if set(types) - {LINEAR, FULL} or len(types) != self.n_layers:
            raise ConfigError(
                f"model layer_types {types}: {self.n_layers} entries, each {LINEAR!r} or {FULL!r}"
            )
        if h.linear_v_heads % h.linear_k_heads or self.rope_dim % 2:
            raise ConfigError(
                f"model linear_v_heads {h.linear_v_heads} must be a multiple of "
                f"linear_k_heads {h.linear_k_heads}, and rope_dim {self.rope_dim} "
                "(head_dim x partial_rotary_factor) even"
            )
        if h.shared_expert_hidden and self.moe is not None and self.moe.n_shared_experts:
            raise ConfigError(
                "model: a gated shared expert (shared_expert_hidden "
                f"{h.shared_expert_hidden}) replaces moe.n_shared_experts "
                f"{self.moe.n_shared_experts}; set the latter to 0"
            )


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
    # DeepSeek-V3's architecture (MLA, group-limited sigmoid routing with a shared expert,
    # the first blocks dense) at a CPU size: 4 blocks (the first dense), 8 experts of width
    # 96 in 2 groups (top 2 of 1 group), small latent ranks. With model.mtp_layers = 1 it is
    # configs/debug_dsv3.toml.
    "debugmodel-dsv3": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=4,
        vocab_size=8192,
        norm_eps=1e-6,
        rope_theta=10000.0,
        explicit_hidden_dim=192,
        mla=MLAArgs(
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
        ),
        moe=MoEArgs(
            n_experts=8,
            top_k=2,
            hidden_dim=96,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=2.5,
            n_group=2,
            topk_group=1,
        ),
    ),
    # Moonlight-16B-A3B's shape (DeepSeek-V3 architecture, no query latent): 27 blocks, 64
    # experts + 2 shared, top 6, 16B total, 3B active.
    "deepseek-v3-16b": ModelArgs(
        dim=2048,
        n_layers=27,
        n_heads=16,
        n_kv_heads=16,
        vocab_size=163840,
        norm_eps=1e-5,
        rope_theta=50000.0,
        explicit_hidden_dim=11264,
        mla=MLAArgs(
            q_lora_rank=0,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEArgs(
            n_experts=64,
            top_k=6,
            hidden_dim=1408,
            n_shared_experts=2,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=2.446,
        ),
    ),
    # DeepSeek-V3 (671B, 37B active): 61 blocks (the first 3 dense), 256 experts in 8 groups
    # (top 8 of 4 groups) + 1 shared, MLA with q_lora_rank 1536, kv_lora_rank 512; YaRN RoPE
    # as released (factor 40 over 4,096 positions), so the released weights load exactly.
    "deepseek-v3-671b": ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=128,
        n_kv_heads=128,
        vocab_size=129280,
        norm_eps=1e-6,
        rope_theta=10000.0,
        explicit_hidden_dim=18432,
        rope_scaling=DEEPSEEK_V3_YARN,
        mla=MLAArgs(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEArgs(
            n_experts=256,
            top_k=8,
            hidden_dim=2048,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=3,
            route_scale=2.5,
            n_group=8,
            topk_group=4,
        ),
    ),
    # Kimi K2 (1.04T, 32B active): DeepSeek-V3's blocks with 384 experts, 64 heads, the first
    # block dense, no expert groups; YaRN RoPE as released (factor 32).
    "kimi-k2": ModelArgs(
        dim=7168,
        n_layers=61,
        n_heads=64,
        n_kv_heads=64,
        vocab_size=163840,
        norm_eps=1e-6,
        rope_theta=50000.0,
        explicit_hidden_dim=18432,
        rope_scaling=KIMI_K2_YARN,
        mla=MLAArgs(
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
        ),
        moe=MoEArgs(
            n_experts=384,
            top_k=8,
            hidden_dim=2048,
            n_shared_experts=1,
            score_func="sigmoid",
            first_dense_layers=1,
            route_scale=2.827,
        ),
    ),
    # Qwen3-Next's hybrid (trainer/models/qwen3_next.py, docs/qwen3_next.md) at a CPU size:
    # Gated DeltaNet, gated attention, DeltaNet, gated attention; every layer MoE (8 experts
    # of width 96, top 2) with a gated shared expert. configs/debug_qwen3_next.toml.
    "debugmodel-qwen3-next": ModelArgs(
        dim=64,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        explicit_head_dim=16,
        vocab_size=8192,
        norm_eps=1e-6,
        qk_norm=True,
        explicit_hidden_dim=192,
        moe=MoEArgs(n_experts=8, top_k=2, hidden_dim=96),
        hybrid=HybridArgs(
            full_attention_interval=2,
            linear_k_heads=2,
            linear_v_heads=4,
            linear_k_head_dim=16,
            linear_v_head_dim=16,
            shared_expert_hidden=96,
        ),
    ),
    # Qwen3-Next-80B-A3B's and Qwen3.5-35B-A3B's shapes: transformers 5.24's Qwen3NextConfig /
    # Qwen3_5MoeTextConfig defaults (the releases' shapes); RoPE theta 1e7 as their config.json
    # (transformers' default: 1e4). 48 (40) layers, 3 DeltaNet to 1 gated attention; 512 (256)
    # experts of width 512, top 10 (8), plus the gated shared expert. The dense width (5,120 in
    # the 80B's config.json) is unused: every layer is MoE.
    "qwen3-next-80b-a3b": ModelArgs(
        dim=2048,
        n_layers=48,
        n_heads=16,
        n_kv_heads=2,
        explicit_head_dim=256,
        vocab_size=151936,
        norm_eps=1e-6,
        rope_theta=1e7,
        qk_norm=True,
        explicit_hidden_dim=5120,
        moe=MoEArgs(n_experts=512, top_k=10, hidden_dim=512),
        hybrid=HybridArgs(shared_expert_hidden=512),
    ),
    "qwen3.5-35b-a3b": ModelArgs(
        dim=2048,
        n_layers=40,
        n_heads=16,
        n_kv_heads=2,
        explicit_head_dim=256,
        vocab_size=248320,
        norm_eps=1e-6,
        rope_theta=1e7,
        qk_norm=True,
        explicit_hidden_dim=512,
        moe=MoEArgs(n_experts=256, top_k=8, hidden_dim=512),
        hybrid=HybridArgs(shared_expert_hidden=512),
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


def model_args(
    flavor: str,
    *,
    vocab_size: int | None = None,
    max_seq_len: int | None = None,
    n_layers: int = 0,
    moe_config=None,
    **attention,
):
    """The flavor's args with the run's vocab and length, its first `n_layers` blocks (0: all;
    model.n_layers), the attention fields of trainer.models.attention.attention_args (default:
    causal, sequence positions) and, for a MoE flavor, the [moe] section's training knobs
    (`moe_config`)."""
    args = FLAVORS[flavor]
    changes = {
        k: v
        for k, v in (
            ("vocab_size", vocab_size),
            ("max_seq_len", max_seq_len),
            ("n_layers", n_layers),
        )
        if v
    }
    if moe_config is not None and args.moe is not None:
        changes["moe"] = dataclasses.replace(
            args.moe,
            capacity_factor=moe_config.capacity_factor,
            aux_loss_weight=moe_config.aux_loss_weight,
            seq_aux_loss_weight=moe_config.seq_aux_loss_weight,
            router_z_loss_weight=moe_config.router_z_loss_weight,
            n_experts=moe_config.num_experts or args.moe.n_experts,
            top_k=moe_config.top_k or args.moe.top_k,
            n_group=moe_config.n_group or args.moe.n_group,
            topk_group=moe_config.topk_group or args.moe.topk_group,
            dispatch=moe_config.dispatch,
            save_dispatch=moe_config.save_dispatch,
        )
    return dataclasses.replace(args, **changes, **attention)
