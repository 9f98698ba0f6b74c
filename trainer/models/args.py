"""Model shapes: `ModelArgs` and the named flavors, without importing torch.

Kept apart from model.py so that validating a config (before any process starts) and the
memory plan stay fast.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1/3.2 RoPE scaling (Hugging Face `rope_scaling` of type "llama3"): frequencies
    with wavelengths above original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those below ... / high_freq_factor are kept, and the band between is blended."""

    factor: float = 32.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


LLAMA3_ROPE_SCALING = RopeScaling()  # as released with Llama-3.2 1B/3B
LLAMA31_ROPE_SCALING = RopeScaling(factor=8.0)  # as released with Llama-3.1 8B/70B/405B


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
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False  # the output head reuses the token embedding
    # How tokens attend (trainer/models/attention.py); no parameter depends on them, so a checkpoint
    # loads under any of them. attn_implementation is resolved: sdpa, flex or per_document.
    attn_mask_type: str = "causal"  # or "block_causal"
    positions: str = "sequence"  # or "document"
    attn_implementation: str = "sdpa"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU width: 2/3 of 4*dim, scaled by ffn_dim_multiplier, rounded up to multiple_of."""
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    def num_params(self, embeddings: bool = True) -> int:
        kv_dim = self.n_kv_heads * self.head_dim
        attn = self.dim * (2 * self.dim + 2 * kv_dim)
        ffn = 3 * self.dim * self.hidden_dim
        per_layer = attn + ffn + 2 * self.dim
        head = 0 if self.tie_word_embeddings else self.vocab_size * self.dim
        total = self.n_layers * per_layer + self.dim + head
        return total + (self.vocab_size * self.dim if embeddings else 0)

    def validate(self) -> None:
        from trainer.errors import ConfigError

        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads or self.head_dim % 2:
            raise ConfigError(f"model shape: dim {self.dim} must divide into n_heads "
                              f"{self.n_heads} (even head_dim), and n_heads into n_kv_heads "
                              f"{self.n_kv_heads}")
        if (self.attn_mask_type not in ("causal", "block_causal")
                or self.positions not in ("sequence", "document")
                or self.attn_implementation not in ("sdpa", "flex", "per_document")):
            raise ConfigError(f"model attention: mask {self.attn_mask_type!r}, positions "
                              f"{self.positions!r}, implementation {self.attn_implementation!r}")


FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=8192,
                            multiple_of=64),
    # A 2-layer, dim-64 slice for smoke runs and the end-to-end tests: every code path of the
    # debug model (GQA, FSDP per block, DCP) at a fraction of its startup and step time.
    "debugmodel-tiny": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=8192,
                                 multiple_of=32),
    # The debug shape with Llama-3.2's tied embeddings and RoPE scaling (tests, smoke runs).
    "debugmodel-3.2": ModelArgs(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=8192,
                                multiple_of=64, rope_scaling=LLAMA3_ROPE_SCALING,
                                tie_word_embeddings=True),
    # Llama-3.2-1B and -3B as released (tied embeddings, llama3 RoPE scaling): they load the
    # public Hugging Face weights (checkpoint.initial_load_path).
    "llama3.2-1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                             multiple_of=256, ffn_dim_multiplier=1.5,
                             rope_scaling=LLAMA3_ROPE_SCALING, tie_word_embeddings=True),
    "llama3.2-3B": ModelArgs(dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=128256,
                             multiple_of=256, ffn_dim_multiplier=1.0,
                             rope_scaling=LLAMA3_ROPE_SCALING, tie_word_embeddings=True),
    # The Llama-3.2-1B shape with an untied output head and no RoPE scaling, Llama-3.1-8B and
    # -70B and -405B (without RoPE scaling: pretraining at <= 8k context does not need it).
    "1B": ModelArgs(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    multiple_of=256, ffn_dim_multiplier=1.5),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                    multiple_of=1024, ffn_dim_multiplier=1.3),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                     multiple_of=4096, ffn_dim_multiplier=1.3),
    # Llama-3.1 8B and 70B as released, with their RoPE scaling: long-context stages (128k)
    "llama3.1-8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                             vocab_size=128256, multiple_of=1024, ffn_dim_multiplier=1.3,
                             rope_scaling=LLAMA31_ROPE_SCALING),
    "llama3.1-70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                              vocab_size=128256, multiple_of=4096, ffn_dim_multiplier=1.3,
                              rope_scaling=LLAMA31_ROPE_SCALING),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                      multiple_of=4096, ffn_dim_multiplier=1.2),
}


def model_args(flavor: str, *, vocab_size: int | None = None, max_seq_len: int | None = None,
               **attention):
    """The flavor's args with the run's vocab and length, and the attention fields of
    trainer.models.attention.attention_args (default: causal, sequence positions)."""
    args = FLAVORS[flavor]
    changes = {k: v for k, v in (("vocab_size", vocab_size), ("max_seq_len", max_seq_len)) if v}
    return dataclasses.replace(args, **changes, **attention)
