"""Data pipeline: tokenizer, sources, pre-tokenized store and loaders with a global order.

Only light imports here: `datasets` and `sentencepiece` are imported where they are used, so
that importing the trainer (or using the synthetic source) stays fast.
"""

from trainer.data.build import build_dataloader, check_model_vocab, padded_vocab_size
from trainer.data.config import DataConfig
from trainer.data.documents import count_targets

__all__ = [
    "DataConfig",
    "build_dataloader",
    "check_model_vocab",
    "count_targets",
    "padded_vocab_size",
]
