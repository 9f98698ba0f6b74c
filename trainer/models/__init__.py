"""Model families, built on the meta device: the Llama (`llama.py`, its shapes in `args.py`,
the flavors in `flavors.py`), attention backends and masks (`attention.py`), the chunked and
loss-parallel cross-entropy (`loss.py`) and FLOPs per token (`flops.py`). A new model family is
a new file here."""
