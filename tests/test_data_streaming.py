"""Streaming a HF dataset (local jsonl, offline) without a store: split by dp rank, per-rank
resume on the same dp size, and a clear error on another one."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from tests.data_fixtures import *  # noqa: F401,F403
from tests.data_fixtures import build
from trainer.data.sources import hf_documents
from trainer.data.tokenizer import Tokenizer
from trainer.errors import DataError

SEQ, B = 32, 2


def rank_loaders(cfg, dp):
    return [
        build(cfg, r, dp, seq_len=SEQ, local_batch_size=B, global_batch_size=B * dp)
        for r in range(dp)
    ]


def take(loader, n):
    """n microbatches as one flat token stream (windows are consecutive, non-overlapping)."""
    out = []
    for _ in range(n):
        x, y = loader.next_microbatch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        out.append(torch.cat([x, y[:, -1:]], dim=1).flatten())
    return torch.cat(out)


@pytest.mark.needs_datasets
def test_ranks_read_disjoint_parts(json_cfg):
    everything = list(hf_documents(json_cfg, "train"))
    parts = [list(hf_documents(json_cfg, "train", r, 2)) for r in range(2)]
    assert sorted(parts[0] + parts[1]) == sorted(everything) and not set(parts[0]) & set(parts[1])
    tok = Tokenizer(json_cfg.tokenizer_path)
    for r, loader in enumerate(rank_loaders(json_cfg, 2)):
        got = take(loader, 4)
        want = np.concatenate(tok.encode_docs(parts[r][:20]))[: len(got)]
        assert got.tolist() == want.tolist()  # this rank's documents, packed in order
        assert "per-rank resume only" in loader.describe()


@pytest.mark.needs_datasets
def test_resume_on_the_same_dp_size(json_cfg):
    first = rank_loaders(json_cfg, 2)
    for loader in first:
        take(loader, 3)
    states = [loader.state_dict() for loader in first]
    assert states[1]["dp_size"] == 2 and "dp_rank_1" in states[1]
    json.dumps(states)  # plain python values only
    want = [take(loader, 2) for loader in first]
    merged = {**states[0], **states[1]}  # a checkpoint may also hold every rank's entry
    for r, loader in enumerate(rank_loaders(json_cfg, 2)):
        loader.load_state_dict(merged if r else states[0])
        assert torch.equal(take(loader, 2), want[r])


@pytest.mark.needs_datasets
def test_resume_on_another_dp_size_fails_clearly(json_cfg):
    loader = rank_loaders(json_cfg, 2)[0]
    take(loader, 1)
    sd = loader.state_dict()
    with pytest.raises(DataError) as e:
        rank_loaders(json_cfg, 4)[0].load_state_dict(sd)
    msg = e.value.one_line()
    assert "dp size 2" in msg and "dp size 4" in msg and "python -m trainer.data.prepare" in msg


@pytest.mark.needs_datasets
def test_wraps_around_at_the_end(json_cfg, tmp_path):
    tiny = tmp_path / "tiny.jsonl"
    tiny.write_text("".join(json.dumps({"text": f"doc {i} " * 5}) + "\n" for i in range(3)))
    loader = build(
        replace(json_cfg, data_files=[str(tiny)]),
        seq_len=SEQ,
        local_batch_size=B,
        global_batch_size=B,
    )
    take(loader, 5)
    assert loader.epoch >= 2


@pytest.mark.needs_datasets
def test_streaming_errors(json_cfg, corpus_dir):
    with pytest.raises(DataError, match="data.val_split"):
        build(json_cfg, split="validation")
    with pytest.raises(DataError, match="tokenizer_path is empty"):
        build(replace(json_cfg, tokenizer_path=""))
    with pytest.raises(DataError, match="no column 'body'"):
        build(replace(json_cfg, text_field="body"))
    with pytest.raises(DataError, match="cannot open dataset"):
        build(replace(json_cfg, val_split="validation"), split="validation")
