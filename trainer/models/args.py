"""Model shapes: `ModelArgs` and its MoE part, and the protocols of the parts a family adds
(MLA, hybrid layers), without importing torch (the named flavors are in flavors.py).

Kept apart from model.py so that validating a config (before any process starts) and the
memory plan stay fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from trainer.models.common.rope import RopeScaling, YarnScaling


class HybridLayers(Protocol):
    """A family's layers of more than one kind of mixer (`ModelArgs.hybrid`; Qwen3-Next's
    Gated DeltaNet among gated attention: trainer/models/qwen3_next/args.py). The shared
    shape code asks it, and never which family it is, what its layers add up to."""

    family: str  # the model.name of the family whose layers these are

    def block_mixer(self, args: ModelArgs, block: int) -> str: ...

    def rope_dim(self, args: ModelArgs) -> int: ...

    def num_params(self, args: ModelArgs, dense_total: int, attention: int) -> int: ...

    def mtp_export_problem(self, args: ModelArgs) -> str | None: ...

    def validate(self, args: ModelArgs) -> None: ...


@dataclass(frozen=True)
class MoEArgs:
    """Mixture of experts (trainer/models/common/moe.py): which blocks have one, and its shape. The
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


class LatentAttention(Protocol):
    """Multi-head latent attention's shape (`ModelArgs.mla`; DeepSeek-V3's MLAArgs:
    trainer/models/deepseek_v3/args.py; the layer: trainer/models/common/mla.py). What the
    shared shape code and the layer read of it."""

    family: str  # the model.name of the family whose attention this is
    q_lora_rank: int  # 0: a plain query projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @property
    def qk_head_dim(self) -> int: ...

    def params(self, dim: int, n_heads: int) -> int: ...

    def validate(self) -> None: ...


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
    # How tokens attend (trainer/models/common/attention.py); no parameter depends on them, so a
    # checkpoint loads under any of them. attn_implementation is resolved: sdpa, flex or
    # per_document.
    attn_mask_type: str = "causal"  # or "block_causal"
    positions: str = "sequence"  # or "document"
    attn_implementation: str = "sdpa"
    moe: MoEArgs | None = None  # None: every block dense
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    explicit_head_dim: int = 0  # 0: dim // n_heads (Qwen3 sets 128 at any dim)
    explicit_hidden_dim: int = 0  # 0: the SwiGLU width from dim (DeepSeek sets its own)
    mla: LatentAttention | None = None  # multi-head latent attention in place of GQA
    # Multi-token prediction (DeepSeek-V3, trainer/models/common/mtp.py): modules after the last
    # layer, the k-th predicting the token k + 1 further; their mean loss is added with this
    # weight (from the [model] section)
    mtp_layers: int = 0
    mtp_loss_weight: float = 0.3
    # Gated DeltaNet layers among gated attention layers (Qwen3-Next, Qwen3.5:
    # trainer/models/qwen3_next.py); None: every layer softmax attention
    hybrid: HybridLayers | None = None

    @property
    def family(self) -> str:
        """The model.name this shape belongs to."""
        if self.hybrid is not None:
            return self.hybrid.family
        return self.mla.family if self.mla is not None else "llama3"

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
        """The channels RoPE rotates per head (MLA: only qk_rope_head_dim of them; a hybrid:
        its own)."""
        if self.hybrid is not None:
            return self.hybrid.rope_dim(self)
        return self.mla.qk_rope_head_dim if self.mla is not None else self.head_dim

    def mtp_export_problem(self) -> str | None:
        """Why a Hugging Face export or import cannot hold this model's MTP modules, or None
        (a deepseek_v3 export writes them as the release's extra layers:
        trainer/models/deepseek_v3/hf.py)."""
        if not self.mtp_layers or self.mla is not None:
            return None
        if self.hybrid is not None:
            return self.hybrid.mtp_export_problem(self)
        hf_class = "Qwen3MoeForCausalLM" if self.moe is not None else "LlamaForCausalLM"
        return (
            f"model.mtp_layers = {self.mtp_layers}, but {hf_class} has no multi-token "
            "prediction modules, so an export would hold a different model than the one "
            "trained (the DCP checkpoints keep them): train with model.mtp_layers = 0 to "
            "exchange this model with Hugging Face, or use a deepseek_v3 flavor (its "
            "export writes the MTP modules as the release's layers num_hidden_layers + k)"
        )

    def hybrid_layer_type(self, block: int) -> str:
        """The hybrid's mixer in `block` (an MTP block's too: block >= n_layers)."""
        return self.hybrid.block_mixer(self, block)

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
        if self.hybrid is not None:  # its mixers in place of `attn` in every block
            total = self.hybrid.num_params(self, total, attn)
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
            self.hybrid.validate(self)
        if (
            self.attn_mask_type not in ("causal", "block_causal")
            or self.positions not in ("sequence", "document")
            or self.attn_implementation not in ("sdpa", "flex", "per_document")
        ):
            raise ConfigError(
                f"model attention: mask {self.attn_mask_type!r}, positions "
                f"{self.positions!r}, implementation {self.attn_implementation!r}"
            )
