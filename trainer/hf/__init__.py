"""Hugging Face interchange: models leave the trainer as `LlamaForCausalLM` folders
(config.json, safetensors, tokenizer) and come back in through `checkpoint.initial_load_path`.

- mapping.py: parameter names, the q/k RoPE permutation, config.json <-> ModelArgs
- weights.py: writing (sharded) safetensors, reading a HF folder tensor by tensor
- tokenizer.py: a sentencepiece BPE model as a `tokenizer.json` (+ tokenizer_config.json)
- load.py: loading HF weights into a sharded model (import), writing the last step (export)
- trainer/convert.py: the CLI that exports a DCP checkpoint on one process
"""
