"""The model a run of a config builds, as the plan sees it before any tokenizer is loaded: its
vocab and its args. trainer/plan/memory.py plans that model's memory, trainer/plan/pipeline.py
cuts it into stages by its units' work; both read it here (neither imports the other for it).
"""

from __future__ import annotations

from trainer.config.job import JobConfig
from trainer.models.args import ModelArgs
from trainer.models.common.attention import attention_args
from trainer.models.flavors import FLAVORS, model_args


def resolve_vocab(cfg: JobConfig) -> tuple[int, str]:
    """The model vocab train.py will use, and where it comes from.

    `[model] vocab_size` if set; for the stdlib and synthetic sources the tokenizer's vocab is
    `[data] vocab_size`, padded as train.py pads it; any other tokenizer is only known once
    loaded, so the flavor's own vocab stands in (set `[model] vocab_size` to be exact).
    """
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "[model] vocab_size"
    if cfg.data.dataset in ("stdlib", "synthetic"):
        mult = cfg.model.vocab_size_multiple_of
        return -(-cfg.data.vocab_size // mult) * mult, (
            f"[data] vocab_size of the {cfg.data.dataset} tokenizer, padded to a multiple of {mult}"
        )
    return FLAVORS[cfg.model.flavor].vocab_size, (
        f"the {cfg.model.flavor} flavor's (the tokenizer is not loaded; set [model] vocab_size)"
    )


def plan_args(cfg: JobConfig, vocab: int) -> ModelArgs:
    """The model a run of `cfg` builds on a GPU (attention resolved for CUDA)."""
    return model_args(
        cfg.model.flavor,
        vocab_size=vocab,
        max_seq_len=cfg.training.seq_len,
        moe_config=cfg.moe,
        **attention_args(cfg.model, "cuda"),
    )
