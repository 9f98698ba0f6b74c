"""Multi-token prediction within documents (trainer/models/common/mtp.py, docs/deepseek.md).

In one process: a packed window of several documents (EOS, BOS or both framing them; the
window's last token starting a document in some rows; data.predict_document_start either way)
gives the MTP loss of its documents taken one at a time, each run alone through the model with
its own labels (a plain loop over the documents, their boundaries found by hand); which ids a
step computes, per setting. The multi-rank check (CP and PP against one rank, with documents)
is in test_moe_recipe.py's shared launch.
"""

from types import SimpleNamespace

import pytest
import torch

from trainer.data.documents import Delimiters, document_ids, split_window
from trainer.models.build import build_model
from trainer.models.common.loss import build_loss
from trainer.models.common.mtp import IGNORE_INDEX, future_labels
from trainer.models.flavors import model_args
from trainer.parallel.forward_backward import microbatch_documents

BOS, EOS, S, DEPTH = 1, 2, 40, 2


def windows(bos: int | None, eos: int | None) -> torch.Tensor:
    """[3, S + 1] windows cut from a stream of documents (content tokens >= 10): row 0 ends
    with a document's last token, row 1 with a document's first, row 2 lies inside one long
    document (it begins mid-document)."""
    gen = torch.Generator().manual_seed(0)
    stream, starts = [], []
    for n in [20, 3, 9, 1, 12, 6, 5, 14, 8, 60]:
        starts.append(len(stream))
        body = torch.randint(10, 8000, (n,), generator=gen).tolist()
        stream += ([bos] if bos is not None else []) + body + ([eos] if eos is not None else [])
    last_of_6th, first_of_9th, long_doc = starts[6] - 1, starts[8], starts[9]
    rows = [
        stream[last_of_6th - S : last_of_6th + 1],
        stream[first_of_9th - S : first_of_9th + 1],
        stream[long_doc + 5 : long_doc + 6 + S],
    ]
    return torch.tensor(rows)


def documents_by_hand(row: list[int], bos, eos) -> list[list[int]]:
    """A window's documents: a new one at position 0, at each BOS, after each EOS."""
    docs: list[list[int]] = []
    for i, t in enumerate(row):
        if i == 0 or t == bos or row[i - 1] == eos:
            docs.append([])
        docs[-1].append(t)
    return docs


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_model(
        model_args(
            "debugmodel-dsv3",
            max_seq_len=64,
            mtp_layers=DEPTH,
            attn_mask_type="block_causal",
            positions="document",
        )
    )
    m.to_empty(device="cpu")
    m.init_weights(0)
    return m.train()


def mtp_sum(model, loss_fn, inputs, labels, doc_ids, future=None) -> float:
    model(inputs, labels=labels, loss_fn=loss_fn, doc_ids=doc_ids, future=future)
    return float(loss_fn.take_mtp_loss())


@pytest.mark.parametrize(
    "bos, eos, predict_start",
    [(None, EOS, True), (BOS, None, False), (BOS, EOS, True), (None, EOS, False)],
)
def test_a_packed_window_gives_its_documents_mtp_loss(model, bos, eos, predict_start):
    d = Delimiters(bos, eos)
    win = windows(bos, eos)
    inputs, labels = split_window(win, d, predict_start)
    loader = SimpleNamespace(
        document_ids=lambda x: document_ids(x, d),
        delimiters=d,
        predict_document_start=predict_start,
    )
    docs = microbatch_documents(model, loader)
    loss_fn = build_loss("chunked", 16)
    doc_ids, window = docs(inputs, labels)
    packed = mtp_sum(model, loss_fn, inputs, labels, doc_ids, future_labels(labels, DEPTH, window))
    alone, targets = 0.0, 0
    for row in win.tolist():
        for tokens in documents_by_hand(row, bos, eos):
            if len(tokens) < 3:  # no MTP target at depth 1
                continue
            t = torch.tensor([tokens])
            alone += mtp_sum(model, loss_fn, t[:, :-1], t[:, 1:], torch.zeros_like(t[:, :-1]))
            targets += sum(max(len(tokens) - 1 - k, 0) for k in range(1, DEPTH + 1))
    assert abs(packed - alone) <= 1e-6 * alone, (packed, alone)
    kept = int((future_labels(labels, DEPTH, window) != IGNORE_INDEX).sum())
    assert kept == targets  # every target of every document, no other
    # the window's last label: its document from the delimiters (row 1's starts one)
    assert window[:, -1].tolist()[:2] == [doc_ids[0, -1], doc_ids[1, -1] + 1]
    assert window[2, -1] == doc_ids[2, -1] == 0


def test_which_ids_a_step_computes():
    """The model's ids only where it keeps documents apart; the window's only with MTP and
    documents applying (kept apart, or document starts masked)."""
    d = Delimiters(None, EOS)

    def decide(mask, positions, mtp, predict_start):
        m = build_model(
            model_args("debugmodel-tiny", mtp_layers=mtp, attn_mask_type=mask, positions=positions)
        )
        loader = SimpleNamespace(
            document_ids=lambda x: document_ids(x, d),
            delimiters=d,
            predict_document_start=predict_start,
        )
        docs = microbatch_documents(m, loader)
        return None if docs is None else (docs.model, docs.mtp)

    assert decide("causal", "sequence", 1, True) is None  # one stream, as the main head
    assert decide("causal", "sequence", 0, False) is None
    assert decide("causal", "sequence", 1, False) == (False, True)
    assert decide("block_causal", "sequence", 0, True) == (True, False)
    assert decide("block_causal", "document", 1, True) == (True, True)
