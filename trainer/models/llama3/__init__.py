"""The plain decoder family (`model.name = "llama3"`): Llama 3 / 3.1 / 3.2 and the Qwen3 shapes
(GQA attention, optionally with q/k RMSNorm, a dense or softmax-routed MoE feed-forward). It is
the decoder every family builds on (trainer/models/common/decoder.py), so its answers to the
family contract are the contract's own defaults (trainer/models/hooks.py's `DecoderHooks`) and
its release format is the shared one (trainer/hf/mapping.py's `DecoderHF`: LlamaForCausalLM,
Qwen3ForCausalLM, Qwen3MoeForCausalLM).

The family's modules: `flavors` (torch-free) and `hooks`. Only trainer/models/registry.py
imports this package from outside it.
"""

from trainer.models.family import ModelFamily
from trainer.models.llama3.flavors import FLAVORS

FAMILY = ModelFamily(
    name="llama3",
    flavors=FLAVORS,
    hooks="trainer.models.llama3.hooks",
    about="Llama 3, Qwen3, Qwen3-MoE: GQA",
)
