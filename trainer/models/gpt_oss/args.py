"""gpt-oss's layers, without torch: `ModelArgs.hybrid`, which the shared shape code asks
through trainer.models.args.HybridLayers. Its layers differ in one way only: every other one
attends over a sliding window of the last `sliding_window` tokens (config.json's
`layer_types`), the rest over the whole window; every layer is the same MoE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer.errors import ConfigError

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclass(frozen=True)
class GptOssLayers:
    """The attention pattern (config.json's layer_types, sliding_window) and the experts'
    clamped SwiGLU (swiglu_limit; alpha 1.702 as the reference code fixes it)."""

    layer_types: tuple[str, ...] = ()  # per layer SLIDING or FULL; () = sliding, full, ...
    sliding_window: int = 128  # a sliding layer's token sees itself and the 127 before it
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    family: ClassVar[str] = "gpt_oss"

    def layer_type(self, i: int) -> str:
        if self.layer_types:
            return self.layer_types[i]
        return SLIDING if i % 2 == 0 else FULL

    def block_mixer(self, args, block: int) -> str:
        return self.layer_type(block)

    def window(self, block: int) -> int:
        """The sliding window of `block`'s attention (0: the whole causal window)."""
        return self.sliding_window if self.layer_type(block) == SLIDING else 0

    def rope_dim(self, args) -> int:
        return args.head_dim

    def num_params(self, args, dense_total: int, attention: int) -> int:
        """The plain decoder's count `dense_total` plus what gpt-oss adds: the q/k/v/o biases
        and the sinks of every attention layer, the router's bias, and the experts' biases (of
        every expert, or of the top_k a token goes through where `dense_total` counted only
        those: the active count)."""
        m, d = args.moe, args.dim
        q, kv = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim
        per_block = q + 2 * kv + d + args.n_heads + m.n_experts
        head = 0 if args.tie_word_embeddings else args.vocab_size * d
        every_expert = args.n_layers * (attention + 2 * d + m.total_ffn(d)) + d + head
        experts = m.n_experts if dense_total == every_expert else m.top_k
        per_block += experts * (2 * m.hidden_dim + d)
        return dense_total + args.n_layers * per_block

    def mtp_export_problem(self, args) -> str | None:
        return None  # validate refuses MTP modules

    def validate(self, args) -> None:
        types = [self.layer_type(i) for i in range(args.n_layers)]
        if set(types) - {SLIDING, FULL} or len(types) != args.n_layers:
            raise ConfigError(
                f"model layer_types {types}: {args.n_layers} entries, each {SLIDING!r} or {FULL!r}"
            )
        if self.sliding_window < 1:
            raise ConfigError(f"model sliding_window = {self.sliding_window} must be >= 1")
        if args.mtp_layers:
            raise ConfigError(
                f"model.mtp_layers = {args.mtp_layers}: gpt-oss has no multi-token "
                "prediction modules (its release holds none); set model.mtp_layers = 0"
            )
        if args.moe is None or args.moe.n_shared_experts or args.moe.first_dense_layers:
            raise ConfigError(
                "model: gpt-oss is a MoE in every layer with no shared experts "
                "(moe.first_dense_layers = 0, n_shared_experts = 0)"
            )
