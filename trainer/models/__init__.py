"""Model families, built on the meta device.

- args.py, flavors.py: the shapes (`ModelArgs`) and every family's flavors (torch-free)
- hooks.py: the family contract (`DecoderHooks`: the plain decoder's answers)
- registry.py, family.py: model.name -> its flavors and hooks; build.py: a model from its args
- common/: the layers every family builds on: the decoder (`decoder.py`), attention backends
  and masks, RoPE and YaRN, MLA, MoE, MTP, the chunked and loss-parallel cross-entropy
- flops.py: FLOPs per token; config.py: the [model] and [moe] sections
- llama3/, deepseek_v3/, qwen3_next/: the families, one package each; a new family is a new
  package and one line in registry.py (docs/architecture.md#where-new-things-go)
"""
