"""The building blocks every attention flavor shares: RMSNorm and rotary position embeddings
(consecutive channel pairs rotated, as in Meta's and DeepSeek's reference code; optionally with
Llama-3.1's frequency scaling or YaRN's)."""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight

    @torch.no_grad()
    def scale_(self, factor: torch.Tensor) -> None:
        """Multiply the output by `factor` (a 0-d tensor) from now on: the weight x factor, on
        this rank's shard of it (QK-clip on q/k-normed attention: trainer/optim/qk_clip.py)."""
        local = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        local.mul_(factor.to(device=local.device, dtype=local.dtype))


def rope_tables(head_dim: int, seq_len: int, theta: float, device=None, scaling=None):
    """cos/sin of the rotation angles, [seq_len, head_dim // 2], in float32."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    gain = 1.0
    if hasattr(scaling, "beta_fast"):  # YaRN (args.YarnScaling)
        inv_freq, gain = yarn_frequencies(inv_freq, theta, scaling), scaling.rope_gain
    elif scaling is not None:
        inv_freq = scale_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(seq_len, device=device).float(), inv_freq)
    if gain == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * gain, angles.sin() * gain


def yarn_frequencies(inv_freq: torch.Tensor, theta: float, s) -> torch.Tensor:
    """YaRN (`s` a YarnScaling): channel pairs that turn more than beta_fast times over the
    original context keep their frequency, those under beta_slow times are interpolated
    (divided by the factor), with a linear ramp between (the YaRN paper's NTK-by-parts)."""
    dim = 2 * inv_freq.numel()

    def pair(rotations: float) -> float:  # the channel whose wavelength fits `rotations` times
        turns = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(turns) / (2 * math.log(theta))

    low, high = pair(s.beta_fast), pair(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = (torch.arange(dim // 2, device=inv_freq.device).float() - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (the original frequency), 0: interpolate
    return inv_freq / s.factor * (1 - keep) + inv_freq * keep


def scale_frequencies(inv_freq: torch.Tensor, s) -> torch.Tensor:
    """Llama-3.1 RoPE scaling (`s` a RopeScaling): long wavelengths slowed down by s.factor,
    short ones kept, a linear blend (in 1/wavelength) in between."""
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    between = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(between, blended, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of x [b, s, h, d] (real-valued form, so Inductor compiles it);
    cos/sin are [s, d/2] (every row alike) or [b, s, d/2] (per-token positions)."""
    xf = x.float().unflatten(-1, (-1, 2))
    x0, x1 = xf[..., 0], xf[..., 1]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)  # broadcast over the heads
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)
    return out.flatten(-2).type_as(x)
