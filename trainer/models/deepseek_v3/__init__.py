"""DeepSeek-V3's architecture (docs/deepseek.md): multi-head latent attention, group-limited
sigmoid routing with shared experts, multi-token prediction; DeepSeek-V3, Kimi K2 and Moonlight.

The family's modules: `flavors`, which a config check reads without torch; `hooks`, its answers
to the family contract (trainer/models/hooks.py); `hf` (the release format: MLA's names, the
MTP layers, config.json in and out, the config check); `plan` (what MLA saves and gathers, for
the memory and traffic plans); `parallelize` (MLA's tensor-parallel styles). The layers
themselves are shared (trainer/models/common/: mla.py, moe.py, mtp.py). Only
trainer/models/registry.py imports this package from outside it.
"""

from trainer.models.deepseek_v3.flavors import FLAVORS
from trainer.models.family import ModelFamily

FAMILY = ModelFamily(
    name="deepseek_v3",
    flavors=FLAVORS,
    hooks="trainer.models.deepseek_v3.hooks",
    about="MLA: DeepSeek-V3, Kimi K2, Moonlight; docs/deepseek.md",
)
