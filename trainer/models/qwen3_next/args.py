"""Qwen3-Next's layers (Qwen3.5's too: model.py), without torch: `ModelArgs.hybrid`, which the
shared shape code asks through trainer.models.args.HybridLayers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.errors import ConfigError

LINEAR, FULL = "linear_attention", "full_attention"


@dataclass(frozen=True)
class HybridArgs:
    """Gated DeltaNet layers among gated full-attention layers (config.json's linear_* keys,
    layer_types); a MoE's sigmoid-gated shared expert."""

    layer_types: tuple[str, ...] = ()  # per layer LINEAR or FULL; () = by full_attention_interval
    full_attention_interval: int = 4  # every interval-th layer is full attention (Qwen3-Next: 4)
    partial_rotary_factor: float = 0.25  # the share of each head's channels RoPE rotates
    linear_k_heads: int = 16  # Gated DeltaNet query/key heads
    linear_v_heads: int = 32  # value heads (a multiple of the key heads)
    linear_k_head_dim: int = 128
    linear_v_head_dim: int = 128
    conv_kernel: int = 4  # taps of the short causal convolution over q, k, v
    shared_expert_hidden: int = 0  # the sigmoid-gated shared expert's SwiGLU width (0: none)

    family: ClassVar[str] = "qwen3_next"

    def block_mixer(self, args, block: int) -> str:
        """The mixer of `block`: its layer's (layer_types), and full attention in an MTP block
        (block >= n_layers), as Qwen3-Next's release has it (mtp.layers.0.self_attn)."""
        return FULL if block >= args.n_layers else self.layer_type(block)

    def rope_dim(self, args) -> int:
        """RoPE rotates partial_rotary_factor of each head's channels."""
        return int(args.head_dim * self.partial_rotary_factor)

    def num_params(self, args, dense_total: int, attention: int) -> int:
        """The model's parameters from the plain decoder's count `dense_total`, whose blocks
        each hold an `attention` of GQA: the mixers per layer type instead, and each MoE
        layer's shared expert."""
        blocks = args.n_blocks
        full = sum(self.block_mixer(args, i) == FULL for i in range(blocks))
        d = args.dim
        total = dense_total - blocks * attention
        total += full * self.full_params(d, args.n_heads, args.n_kv_heads, args.head_dim)
        total += (blocks - full) * self.linear_params(d)
        return total + self.shared_params(d) * len(args.moe_layer_ids)

    def mtp_export_problem(self, args) -> str | None:
        """The release format holds one MTP module (mtp.fc, mtp.norm, ...)."""
        if args.mtp_layers <= 1:
            return None
        return (
            f"model.mtp_layers = {args.mtp_layers}, but Qwen3-Next's release format holds "
            "one MTP module (mtp.fc, mtp.pre_fc_norm_*, mtp.norm and mtp.layers.0; "
            "num_nextn_predict_layers = 1), so an export or import could not hold the "
            "others: use model.mtp_layers = 1 to exchange this model with Hugging Face"
        )

    def validate(self, args) -> None:
        types = [self.layer_type(i) for i in range(args.n_layers)]
        if set(types) - {LINEAR, FULL} or len(types) != args.n_layers:
            raise ConfigError(
                f"model layer_types {types}: {args.n_layers} entries, each {LINEAR!r} or {FULL!r}"
            )
        if self.linear_v_heads % self.linear_k_heads or args.rope_dim % 2:
            raise ConfigError(
                f"model linear_v_heads {self.linear_v_heads} must be a multiple of "
                f"linear_k_heads {self.linear_k_heads}, and rope_dim {args.rope_dim} "
                "(head_dim x partial_rotary_factor) even"
            )
        if self.shared_expert_hidden and args.moe is not None and args.moe.n_shared_experts:
            raise ConfigError(
                "model: a gated shared expert (shared_expert_hidden "
                f"{self.shared_expert_hidden}) replaces moe.n_shared_experts "
                f"{args.moe.n_shared_experts}; set the latter to 0"
            )

    def layer_type(self, i: int) -> str:
        if self.layer_types:
            return self.layer_types[i]
        return FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR

    @property
    def keys(self) -> int:
        return self.linear_k_heads * self.linear_k_head_dim

    @property
    def values(self) -> int:
        return self.linear_v_heads * self.linear_v_head_dim

    def linear_params(self, dim: int) -> int:
        """One Gated DeltaNet layer: wq, wk, wv, wz, wb, wa, wo, the convolutions, A_log,
        dt_bias and the gated norm."""
        k, v, nv = self.keys, self.values, self.linear_v_heads
        return (
            dim * (2 * k + 3 * v + 2 * nv)
            + (2 * k + v) * self.conv_kernel
            + 2 * nv
            + self.linear_v_head_dim
        )

    def full_params(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int) -> int:
        """One gated attention layer: wq (queries and gates), wk, wv, wo, the q/k norms."""
        return dim * head_dim * (3 * n_heads + 2 * n_kv_heads) + 2 * head_dim

    def shared_params(self, dim: int) -> int:
        """The gated shared expert of one MoE layer (its SwiGLU and its gate)."""
        return (3 * self.shared_expert_hidden + 1) * dim if self.shared_expert_hidden else 0
