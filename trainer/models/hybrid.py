"""The hybrid layers' shape (Qwen3-Next, Qwen3.5: trainer/models/qwen3_next.py), without torch:
`ModelArgs.hybrid` (trainer/models/args.py)."""

from __future__ import annotations

from dataclasses import dataclass

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
