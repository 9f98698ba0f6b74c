"""`build_dataloader`: pick the loader for a `[data]` config and check its inputs up front.

Every user error (missing path, empty corpus, foreign store, corrupt shard, seq_len too long)
is raised here as a one-line `DataError`, before the first training step.
"""

from __future__ import annotations

from trainer.data.config import DataConfig
from trainer.errors import DataError


def build_dataloader(cfg: DataConfig, *, seq_len: int, local_batch_size: int,
                     global_batch_size: int, dp_rank: int, dp_size: int, seed: int,
                     split: str = "train"):
    """Build this dp rank's loader (see trainer/data/loader.py for the global order)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    cfg.validate()
    kw = dict(seq_len=seq_len, local_batch_size=local_batch_size,
              global_batch_size=global_batch_size, dp_rank=dp_rank, dp_size=dp_size, seed=seed)
    if cfg.dataset == "synthetic":
        from trainer.data.synthetic import SyntheticLoader
        # validation draws from a disjoint seed stream, so it never repeats training samples
        return SyntheticLoader(vocab_size=cfg.vocab_size, **{
            **kw, "seed": seed if split == "train" else seed + 1_000_003})
    raise DataError(f"data.dataset = {cfg.dataset!r} is not supported yet")


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round a tokenizer vocab up to a multiple (e.g. 64 x tensor-parallel degree) so the
    embedding and output layers shard evenly; the extra rows are never produced as targets."""
    return -(-vocab_size // multiple) * multiple


def check_model_vocab(model_vocab_size: int, loader) -> None:
    """Refuse a model whose embedding cannot hold every token id the tokenizer produces."""
    if model_vocab_size < loader.vocab_size:
        where = loader.tokenizer_path or f"the {loader.kind} data"
        raise DataError(f"model vocab_size {model_vocab_size} is smaller than the tokenizer "
                        f"vocab {loader.vocab_size} of {where}; set the model's vocab_size >= "
                        f"{loader.vocab_size}")
