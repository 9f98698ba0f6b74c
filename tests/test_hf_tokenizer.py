"""Training with a Hugging Face tokenizer.json: the fixture's sentencepiece model, rebuilt as a
tokenizer.json (trainer/hf/tokenizer.py), gives the same tokens through both libraries, so the
streamed batches and a prepared store's batches are identical to the sentencepiece ones."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tests.data_fixtures import (
    build,
    stdlib_texts,  # noqa: F401
)

pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer_json(tmp_path_factory, json_cfg):  # noqa: F811
    from trainer.hf.tokenizer import sentencepiece_to_hf

    path = tmp_path_factory.mktemp("tokjson") / "tokenizer.json"
    sentencepiece_to_hf(json_cfg.tokenizer_path)[0].save(str(path))
    return str(path)


def batches(loader, n: int = 3) -> list[torch.Tensor]:
    return [torch.cat(loader.next_microbatch()) for _ in range(n)]


def test_tokenizer_json_encodes_like_sentencepiece(tokenizer_json, json_cfg):  # noqa: F811
    from trainer.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer

    hf, sp = load_tokenizer(tokenizer_json), load_tokenizer(json_cfg.tokenizer_path)
    assert isinstance(hf, HFTokenizer) and isinstance(sp, Tokenizer)
    assert (hf.vocab_size, hf.bos_id, hf.eos_id) == (sp.vocab_size, sp.bos_id, sp.eos_id)
    texts = stdlib_texts(12)
    assert hf.encode_docs(texts) == sp.encode_docs(texts)
    assert hf.decode(hf.encode_docs(texts[:1])[0]) == texts[0]


@pytest.mark.needs_datasets
def test_streaming_and_prepare_with_tokenizer_json(
    tmp_path,
    tokenizer_json,
    json_cfg,  # noqa: F811
    store_cfg,
):  # noqa: F811
    from trainer.data.prepare import prepare_store

    streamed = replace(json_cfg, tokenizer_path=tokenizer_json)
    assert all(
        torch.equal(a, b)
        for a, b in zip(batches(build(streamed)), batches(build(json_cfg)), strict=True)
    )
    out = str(tmp_path / "store")
    prepare_store(
        streamed, tokenizer_json, out, workers=1, shard_tokens=30_000, show_progress=False
    )
    ours = replace(store_cfg, store_path=out, shuffle=False)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            batches(build(ours)), batches(build(replace(store_cfg, shuffle=False))), strict=True
        )
    )
