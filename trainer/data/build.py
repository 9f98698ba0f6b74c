"""`build_dataloader`: pick the loader for a `[data]` config and check its inputs up front.

Every user error (missing path, empty corpus, foreign store, corrupt shard, seq_len too long)
is raised here as a one-line `DataError`, before the first training step:
- "synthetic": SyntheticLoader (global order, no files);
- "stdlib" or any dataset with data.store_path: StoreLoader over a token store (global order;
  the stdlib store is built and cached at first use, see cache.py);
- a HF dataset without a store: StreamingLoader (per-rank order);
- `data.mix`: MixLoader, a blend of token stores (global order, stages; mix_loader.py).
"""

from __future__ import annotations

import os

from trainer.data.config import DataConfig
from trainer.errors import DataError


def build_dataloader(
    cfg: DataConfig,
    *,
    seq_len: int,
    local_batch_size: int,
    global_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int,
    split: str = "train",
):
    """Build this dp rank's loader (see trainer/data/loader.py for the global order)."""
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    cfg.validate()
    kw = dict(
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        global_batch_size=global_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        predict_document_start=cfg.predict_document_start,
    )
    if cfg.mix:
        if split != "train":
            raise ValueError("a blend's validation reads each source apart: mix_sources()")
        return _mix_loader(cfg, kw)
    if cfg.dataset == "synthetic":
        from trainer.data.synthetic import SyntheticLoader

        # Validation: the same chain (the same distribution), samples from a disjoint stream.
        return SyntheticLoader(vocab_size=cfg.vocab_size, split=split, **kw)
    if cfg.store_path or cfg.dataset == "stdlib":
        from trainer.data.loader import StoreLoader

        store, tokenizer_path = open_store(cfg)
        return StoreLoader(
            store,
            split=split,
            val_fraction=cfg.val_fraction,
            shuffle=cfg.shuffle,
            tokenizer_path=tokenizer_path,
            **kw,
        )
    return _streaming_loader(cfg, split, kw)


def open_store(cfg: DataConfig):
    """The checked store and the tokenizer path that goes with it."""
    from trainer.data.store import Store

    if cfg.dataset == "stdlib" and not cfg.store_path:
        from trainer.data.cache import ensure_stdlib

        tokenizer_path, store_path = ensure_stdlib(cfg)
        return Store(store_path, cfg.verify_store), tokenizer_path
    store = Store(cfg.store_path, cfg.verify_store, **store_cache(cfg))
    if not cfg.tokenizer_path:
        return store, store.tokenizer_file
    return store, _matching_tokenizer(cfg, store, "")


def store_cache(cfg: DataConfig) -> dict:
    """The block cache of stores at a URL (trainer/data/remote.py)."""
    return {
        "cache_dir": cfg.cache_dir,
        "cache_max_gib": cfg.cache_max_gib,
        "block_cache_dir": cfg.block_cache_dir,
    }


def open_mix_stores(cfg: DataConfig) -> tuple[dict, str]:
    """({name: Store} of the blend's sources, the tokenizer path they share). Each problem
    is one DataError naming the source."""
    from trainer.data.store import Store

    stores = {}
    for src in cfg.mix:
        try:
            stores[src.name] = Store(
                src.store_path,
                cfg.verify_store,
                **store_cache(cfg),
                key=f"data.mix source {src.name!r} store_path",
            )
        except DataError as e:
            raise DataError(f"data.mix source {src.name!r}: {e}") from None
    first = next(iter(stores))
    for name, store in stores.items():
        if store.tokenizer_sha256 != stores[first].tokenizer_sha256:
            raise DataError(
                f"data.mix sources {first!r} and {name!r} were prepared with different "
                f"tokenizers ({stores[first].tokenizer_file}, sha256 "
                f"{stores[first].tokenizer_sha256[:12]}; {store.tokenizer_file}, sha256 "
                f"{store.tokenizer_sha256[:12]}); a blend needs one tokenizer: re-prepare one "
                "of them with the other's tokenizer.model"
            )
    if not cfg.tokenizer_path:
        return stores, stores[first].tokenizer_file
    tokenizer_path = _matching_tokenizer(cfg, stores[first], f"data.mix source {first!r}: ")
    return stores, tokenizer_path


def mix_sources(
    cfg: DataConfig, stores: dict, *, split: str, seeds: dict[str, int] | None = None, **kw
) -> dict:
    """{name: StoreLoader} over the `split` of each source's store."""
    from trainer.data.loader import StoreLoader

    out = {}
    for name, store in stores.items():
        seed = seeds[name] if seeds else kw["seed"]
        try:
            out[name] = StoreLoader(
                store,
                split=split,
                val_fraction=cfg.val_fraction,
                shuffle=cfg.shuffle,
                tokenizer_path="",
                **{**kw, "seed": seed},
            )
        except DataError as e:
            raise DataError(f"data.mix source {name!r}: {e}") from None
    return out


def _mix_loader(cfg: DataConfig, kw: dict):
    from trainer.data.mix_loader import MixLoader, source_seed

    stores, tokenizer_path = open_mix_stores(cfg)
    # Each source's own order only needs the window maths: one sample per "batch", one rank.
    one = {**kw, "local_batch_size": 1, "global_batch_size": 1, "dp_rank": 0, "dp_size": 1}
    seeds = {name: source_seed(kw["seed"], name) for name in stores}
    sources = mix_sources(cfg, stores, split="train", seeds=seeds, **one)
    return MixLoader(sources, cfg.mix_weights_by_name(), tokenizer_path, **kw)


def _matching_tokenizer(cfg: DataConfig, store, what: str) -> str:
    """data.tokenizer_path, checked against the tokenizer the store was made with."""
    from trainer.data.tokenizer import file_sha256

    tokenizer_path = os.path.expanduser(cfg.tokenizer_path)
    if not os.path.isfile(tokenizer_path):
        raise DataError(f"tokenizer not found: {tokenizer_path} (data.tokenizer_path)")
    sha = file_sha256(tokenizer_path)
    if sha != store.tokenizer_sha256:
        raise DataError(
            f"{what}store {store.path} was prepared with a different tokenizer (sha256 "
            f"{store.tokenizer_sha256[:12]}) than data.tokenizer_path = {tokenizer_path} "
            f"(sha256 {sha[:12]}); re-prepare the store with this tokenizer, or leave "
            "data.tokenizer_path empty to use the store's own tokenizer.model"
        )
    return tokenizer_path


def _streaming_loader(cfg: DataConfig, split: str, kw: dict):
    from trainer.data.streaming import StreamingLoader
    from trainer.data.tokenizer import load_tokenizer

    if not cfg.tokenizer_path:
        raise DataError(
            f"data.tokenizer_path is empty: streaming {cfg.dataset} needs a "
            "sentencepiece model (train one with python -m "
            "trainer.data.train_tokenizer) or a tokenizer.json, or set data.store_path to a store"
        )
    if split == "validation" and not cfg.val_split:
        raise DataError(
            f"no validation data for streamed {cfg.dataset}: set data.val_split "
            "(a HF split such as 'validation') or prepare a store and set "
            "data.store_path (validation is then a held-out slice)"
        )
    hf_split = cfg.split if split == "train" else cfg.val_split
    tok = load_tokenizer(os.path.expanduser(cfg.tokenizer_path))
    return StreamingLoader(cfg, tok, hf_split, **kw)


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round a tokenizer vocab up to a multiple (e.g. 64 x tensor-parallel degree) so the
    embedding and output layers shard evenly; the extra rows are never produced as targets."""
    return -(-vocab_size // multiple) * multiple


def check_model_vocab(model_vocab_size: int, loader) -> None:
    """Refuse a model whose embedding cannot hold every token id the tokenizer produces."""
    if model_vocab_size < loader.vocab_size:
        where = loader.tokenizer_path or f"the {loader.kind} data"
        raise DataError(
            f"model vocab_size {model_vocab_size} is smaller than the tokenizer "
            f"vocab {loader.vocab_size} of {where}; set the model's vocab_size >= "
            f"{loader.vocab_size} (padding up to a multiple is fine)"
        )
