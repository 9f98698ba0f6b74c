"""How a model is spread over the world's devices: the mesh (`dims.py`), and the parallelize
step that applies TP (`tp.py`), float8 (`float8.py`), activation checkpointing, compile and
FSDP2/HSDP (`fsdp.py`) in that order (`parallelize.py`); loss parallel, clipping over every mesh
(`clip.py`) and the step's seam: how a step's microbatches run forward and backward
(`microbatches.py`: what they return, and the loop; `pipeline.py` under pp), chosen for the
layout by `forward_backward.py`. A new parallelism is a new file here."""
