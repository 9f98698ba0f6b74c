"""Qwen3-Next and Qwen3.5 (docs/qwen3_next.md): Gated DeltaNet layers among gated attention
layers, a MoE with a sigmoid-gated shared expert, partial RoPE, zero-centred norms.

The family's modules: `args` (its layers' shape, `ModelArgs.hybrid`) and `flavors`, which a
config check reads without torch; `model` (the layers and the model) and `deltanet` (the
chunked recurrence and its kernels); `hf` and `hf_io` (the release format: config.json in and
out, the fused tensors); `plan` (its blocks' saved activations for the memory plan); `hooks`,
its answers to the family contract (trainer/models/hooks.py), including its tensor-parallel
styles. Only trainer/models/registry.py imports this package from outside it.
"""

from trainer.models.family import ModelFamily
from trainer.models.qwen3_next.flavors import FLAVORS

FAMILY = ModelFamily(
    name="qwen3_next",
    flavors=FLAVORS,
    hooks="trainer.models.qwen3_next.hooks",
    about="Gated DeltaNet hybrid: Qwen3-Next, Qwen3.5; docs/qwen3_next.md",
)
