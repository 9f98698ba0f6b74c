"""Build a model of any family on the meta device: Llama-style (GQA or MLA blocks,
trainer/models/llama.py) or the Qwen3-Next hybrid (trainer/models/qwen3_next.py)."""

from __future__ import annotations

import torch

from trainer.models.args import ModelArgs
from trainer.models.llama import Transformer
from trainer.models.qwen3_next import Qwen3Next


def build_model(args: ModelArgs) -> Transformer:
    """Validated, on the meta device: no memory is allocated until `to_empty` after sharding."""
    args.validate()
    with torch.device("meta"):
        return Qwen3Next(args) if args.hybrid is not None else Transformer(args)
