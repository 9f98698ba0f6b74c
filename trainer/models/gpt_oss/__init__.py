"""gpt-oss (docs/gpt_oss.md): attention with a learned sink per head, sliding-window layers
between full ones, q/k/v/o biases, and a MoE in every layer whose router and experts have
biases and whose experts use a clamped SwiGLU; gpt-oss-20b and gpt-oss-120b.

The family's modules: `args` (its layers' shape, `ModelArgs.hybrid`) and `flavors`, which a
config check reads without torch; `kernels` (attention with sinks and windows); `model` (the
layers and the model); `hf` (the release format: config.json, the fused experts, MXFP4 in,
bf16 out); `hooks`, its answers to the family contract (trainer/models/hooks.py). Only
trainer/models/registry.py imports this package from outside it.
"""

from trainer.models.family import ModelFamily
from trainer.models.gpt_oss.flavors import FLAVORS

FAMILY = ModelFamily(
    name="gpt_oss",
    flavors=FLAVORS,
    hooks="trainer.models.gpt_oss.hooks",
    about="attention sinks, sliding windows, biased experts: gpt-oss; docs/gpt_oss.md",
)
