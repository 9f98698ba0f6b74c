"""Hugging Face interchange: models leave the trainer as `LlamaForCausalLM`,
`Qwen3MoeForCausalLM` or `DeepseekV3ForCausalLM` folders (config.json, safetensors, tokenizer)
and come back in through `checkpoint.initial_load_path`.

- mapping.py: `DecoderHF`, the plain decoder's parameter names, the q/k RoPE permutation and
  config.json <-> ModelArgs; a family with its own release format subclasses it in its package
  (trainer/models/deepseek_v3/hf.py: MLA's names, the MTP layers, the config check's defaults)
- quant.py: block-scaled fp8 folders (the DeepSeek-V3 and Kimi K2 releases) dequantized
- weights.py: writing (sharded) safetensors, reading a HF folder tensor by tensor
- tokenizer.py: a sentencepiece BPE model as a `tokenizer.json` (+ tokenizer_config.json)
- load.py: loading HF weights into a sharded model (import), writing the last step (export)
- trainer/convert.py: the CLI that exports a DCP checkpoint on one process
"""
