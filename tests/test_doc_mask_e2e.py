"""block_causal end to end through ./run_train.sh: 1 rank, FSDP 2 and HSDP 2x2 give the same
training and validation losses, and a resume is bitwise.

The store holds short documents (stdlib paragraphs, ~tens of tokens each, framed BOS ... EOS),
so every 64-token window packs several: the mask and the document positions act in every
row. Four tiny fp32 launches: FSDP 2 with checkpoints (4 steps, 2 microbatches per step), its
resume from step 2, HSDP 2x2 (1 microbatch) and one rank (4 microbatches), with
`positions = 'document'` and validation every 2 steps.
"""

import json
import re

import pytest

from tests.data_fixtures import stdlib_texts, tokenizer_path  # noqa: F401
from tests.helpers import BASE_FP32, losses, run_train, scalars, stopped_after_save

DOCS = [
    "--model.attn_mask_type",
    "block_causal",
    "--model.positions",
    "document",
    "--validation.enable",
    "true",
    "--validation.freq",
    "2",
    "--validation.steps",
    "2",
    "--validation.local_batch_size",
    "2",
    "--validation.global_batch_size",
    "4",
]
VAL = "validation_metrics/loss"


@pytest.fixture(scope="module")
def short_docs_store(tokenizer_path, tmp_path_factory):  # noqa: F811
    """A store of ~2.5k short documents (paragraphs of stdlib modules)."""
    from trainer.data import DataConfig
    from trainer.data.prepare import prepare_store

    root = tmp_path_factory.mktemp("short_docs")
    paragraphs = [p.strip() for text in stdlib_texts(40) for p in text.split("\n\n")]
    with open(root / "docs.jsonl", "w") as f:
        for p in paragraphs[:2500]:
            if p:
                f.write(json.dumps({"text": p}) + "\n")
    cfg = DataConfig(
        dataset="json",
        data_files=[str(root / "docs.jsonl")],
        tokenizer_path=str(tokenizer_path),
        cache_dir=str(root / "cache"),
    )
    prepare_store(cfg, cfg.tokenizer_path, str(root / "store"), workers=1, show_progress=False)
    return str(root / "store")


def common(store: str) -> list[str]:
    return [
        *BASE_FP32,
        "--data.dataset",
        "json",
        "--data.store_path",
        store,
        *DOCS,
        "--training.steps",
        "4",
    ]


@pytest.fixture(scope="module")
def fsdp2(short_docs_store, tmp_path_factory):
    """(dump, stdout): 2 ranks, checkpoints at steps 2 and 4."""
    dump = tmp_path_factory.mktemp("docmask") / "fsdp2"
    out = run_train(
        dump, *common(short_docs_store), "--checkpoint.enable", "true", "--checkpoint.interval", "2"
    ).stdout
    return dump, out


@pytest.mark.needs_datasets
def test_startup_names_the_mask_and_the_documents(fsdp2):
    out = fsdp2[1]
    assert (
        "attention: block_causal (a token sees earlier tokens of its own document only); "
        "one causal SDPA call per document (split by the microbatch's document ids); RoPE "
        "positions: document"
    ) in out, out  # auto on the CPU
    assert "documents start at each BOS (id 1) and after each EOS (id 2)" in out
    assert "block_causal counted as causal over the whole window" in out


@pytest.mark.needs_datasets
def test_resume_is_bitwise(fsdp2, short_docs_store, tmp_path):
    dump = stopped_after_save(fsdp2[0], tmp_path / "resumed", 4)
    out = run_train(
        dump, *common(short_docs_store), "--checkpoint.enable", "true", "--checkpoint.interval", "2"
    ).stdout
    assert re.search(r"resumed from \S*step-2 \(step 2\)", out), out
    ref = losses(fsdp2[0])
    assert losses(dump) == {3: ref[3], 4: ref[4]}
    assert scalars(dump, VAL) == {4: scalars(fsdp2[0], VAL)[4]}


@pytest.mark.parametrize("layout", ["hsdp2x2", "one_rank"])
@pytest.mark.needs_datasets
def test_layouts_give_the_same_losses(fsdp2, short_docs_store, tmp_path, layout):
    extra, nproc = (
        (["--parallelism.data_parallel_replicate_degree", "2"], 4)
        if layout == "hsdp2x2"
        else ([], 1)
    )
    out = run_train(tmp_path, *common(short_docs_store), *extra, nproc=nproc).stdout
    assert f"gradient accumulation steps: {4 // nproc}" in out
    ref, got = losses(fsdp2[0]), losses(tmp_path)
    assert sorted(got) == [1, 2, 3, 4]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=1e-4), (layout, step)
    ref_val, got_val = scalars(fsdp2[0], VAL), scalars(tmp_path, VAL)
    assert sorted(got_val) == [2, 4]
    for step in got_val:
        assert got_val[step] == pytest.approx(ref_val[step], rel=1e-4), (layout, step)
