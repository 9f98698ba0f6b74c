"""RoPE frequency scaling as the released models configure it (Hugging Face `rope_scaling`):
Llama 3.1/3.2's and YaRN (DeepSeek-V3, Kimi K2). The tables are made in
trainer/models/common/layers.py; the flavors that carry them are in trainer/models/flavors.py."""

from __future__ import annotations

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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (Hugging Face `rope_scaling` of type "yarn", as DeepSeek-V3 and Kimi
    K2 are released): channel pairs that turn more than `beta_fast` times over
    original_max_position_embeddings keep their frequency, those that turn fewer than
    `beta_slow` times are divided by `factor`, a linear ramp between; the attention logits
    are scaled by (0.1 x mscale_all_dim x ln(factor) + 1)^2 (MLA's softmax scale) and cos/sin
    by mscale's ratio to mscale_all_dim's."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0
    truncate: bool = True  # the ramp's ends rounded to whole channels (transformers' default)

    @staticmethod
    def gain(factor: float, mscale: float) -> float:
        """YaRN's magnitude factor (DeepSeek's `yarn_get_mscale`)."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def softmax_gain(self) -> float:
        """The factor on the attention logits (DeepSeek's softmax scale times mscale^2)."""
        return self.gain(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0

    @property
    def rope_gain(self) -> float:
        """The factor on cos and sin (transformers' `attention_scaling`)."""
        if self.mscale and self.mscale_all_dim:
            return self.gain(self.factor, self.mscale) / self.gain(self.factor, self.mscale_all_dim)
        return self.gain(self.factor, 1.0)


def yarn_over(flavor, factor: float = 0.0, original: int = 0) -> YarnScaling:
    """YaRN over a flavor's RoPE (`model.rope_scaling = "yarn"`): its own YaRN with `factor`
    and `original` (original_max_position_embeddings) put in where given (e.g. Kimi K2 0905:
    factor 64 over K2's 32), or on a flavor without YaRN the form transformers builds from a
    config.json that names only those two (beta_fast 32, beta_slow 1, no mscale: cos and sin
    x 0.1 ln(factor) + 1, e.g. the YaRN edit of Qwen3-Next's and Qwen3's model cards)."""
    base = (
        flavor if isinstance(flavor, YarnScaling) else YarnScaling(mscale=0.0, mscale_all_dim=0.0)
    )
    return YarnScaling(
        **{
            **base.__dict__,
            **({"factor": float(factor)} if factor else {}),
            **({"original_max_position_embeddings": int(original)} if original else {}),
        }
    )


def yarn_from_config(s: dict, max_positions: int) -> YarnScaling:
    """A config.json's YaRN (`rope_scaling` or `rope_parameters` of rope_type "yarn") with
    transformers' defaults for the keys it leaves out."""
    return YarnScaling(
        factor=float(s["factor"]),
        original_max_position_embeddings=int(
            s.get("original_max_position_embeddings") or max_positions
        ),
        beta_fast=float(s.get("beta_fast") or 32.0),
        beta_slow=float(s.get("beta_slow") or 1.0),
        mscale=float(s.get("mscale") or 0.0),
        mscale_all_dim=float(s.get("mscale_all_dim") or 0.0),
        truncate=bool(s.get("truncate", True)),
    )


def yarn_to_config(s: YarnScaling) -> dict:
    """A YaRN as config.json's rope_scaling / rope_parameters give it."""
    return {
        "rope_type": "yarn",
        "factor": s.factor,
        "original_max_position_embeddings": s.original_max_position_embeddings,
        "beta_fast": s.beta_fast,
        "beta_slow": s.beta_slow,
        "mscale": s.mscale,
        "mscale_all_dim": s.mscale_all_dim,
        "truncate": s.truncate,
    }


def yarn_keys(s: YarnScaling) -> str:
    """The [model] overrides that give a flavor this YaRN (said in config errors)."""
    return (
        f"model.rope_scaling = 'yarn', model.yarn_factor = {s.factor:g}, "
        f"model.yarn_original_max_position_embeddings = {s.original_max_position_embeddings}"
    )


# As released: DeepSeek-V3 (and R1, V3.1) and Kimi K2 (config.json's rope_scaling).
DEEPSEEK_V3_YARN = YarnScaling()
KIMI_K2_YARN = YarnScaling(factor=32.0, beta_fast=1.0, beta_slow=1.0)
LLAMA3_ROPE_SCALING = RopeScaling()  # as released with Llama-3.2 1B/3B
LLAMA31_ROPE_SCALING = RopeScaling(factor=8.0)  # as released with Llama-3.1 8B/70B/405B
