"""The weight init's truncated normal (trainer/models/common/decoder.py): the right distribution,
the same values for the same seed, drawn in one pass."""

import math

import torch

from trainer.models.common.decoder import trunc_normal


def draw(n: int, std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator()
    gen.manual_seed(seed)
    return trunc_normal(torch.empty(n), std, gen)


def test_truncated_at_three_std_with_the_truncated_normals_moments():
    std = 0.02
    x = draw(2_000_000, std, 0).double()
    assert x.abs().max() <= 3 * std
    assert x.abs().max() > 2.9 * std  # the tails are reached, not clipped early
    # N(0, s^2) cut at +-3 s has std s * sqrt(1 - 6 phi(3) / (Phi(3) - Phi(-3))) = 0.98658 s
    phi3 = math.exp(-4.5) / math.sqrt(2 * math.pi)
    want = std * math.sqrt(1 - 6 * phi3 / math.erf(3 / math.sqrt(2)))
    assert abs(x.std().item() - want) < 2e-3 * want
    assert abs(x.mean().item()) < 5e-3 * std
    # and the shape: the share within one std is the truncated normal's (0.6844)
    inside = (x.abs() <= std).double().mean().item()
    assert abs(inside - math.erf(1 / math.sqrt(2)) / math.erf(3 / math.sqrt(2))) < 2e-3


def test_same_seed_same_values_other_seed_other_values():
    assert torch.equal(draw(1000, 1.0, 7), draw(1000, 1.0, 7))
    assert not torch.equal(draw(1000, 1.0, 7), draw(1000, 1.0, 8))
