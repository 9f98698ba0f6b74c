"""Document boundaries inside packed windows.

A store (and a streamed source) is one token stream in which each document is framed by the
tokenizer's BOS and/or EOS, as `data.add_bos` / `data.add_eos` asked when it was prepared (the
store's manifest records both, and the tokenizer's ids): those tokens are the boundaries,
nothing else is recorded. In a window, a new document starts

    at position 0 (the window may begin mid-document), at every BOS, and right after every EOS

(with both framings the two rules mark the same position, the BOS after an EOS). The document id of
a position is the number of starts up to it, minus one: [B, S] int64, computed on the device from
the input tokens (`document_ids`). The model turns ids into its block-causal mask and per-document
positions (trainer/models/common/attention.py); the loader also uses the starts to drop the targets
that begin a document when `data.predict_document_start = false`. Multi-token prediction's targets
reach one token past the inputs (the window's last label), whose document follows from the same
rules (`window_document_ids`); `MicrobatchDocuments` computes, per training microbatch, only the ids
that are used.

A source without any delimiter (a store prepared with add_bos = add_eos = false, a tokenizer
without BOS/EOS ids, the synthetic source) has no documents: `Delimiters` is None there, and a
config that needs documents is refused with the reason (`check_documents`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.errors import DataError

IGNORE_INDEX = -100  # as trainer.models.common.loss


@dataclass(frozen=True)
class Delimiters:
    """Token ids that delimit documents: a document starts at each `bos`, after each `eos`."""

    bos: int | None = None
    eos: int | None = None

    def describe(self) -> str:
        parts = ([f"at each BOS (id {self.bos})"] if self.bos is not None else []) + (
            [f"after each EOS (id {self.eos})"] if self.eos is not None else []
        )
        return "documents start " + " and ".join(parts)

    def union(self, other: Delimiters) -> Delimiters:
        return Delimiters(
            self.bos if self.bos is not None else other.bos,
            self.eos if self.eos is not None else other.eos,
        )


def delimiters_of(bos_id: int, eos_id: int, add_bos: bool, add_eos: bool) -> Delimiters | None:
    """The delimiters of a stream framed with BOS (if add_bos and the tokenizer has one) and EOS."""
    bos = bos_id if add_bos and bos_id is not None and bos_id >= 0 else None
    eos = eos_id if add_eos and eos_id is not None and eos_id >= 0 else None
    return None if bos is None and eos is None else Delimiters(bos, eos)


def store_delimiters(manifest: dict, where: str) -> tuple[Delimiters | None, str]:
    """(delimiters of a store from its manifest, why there are none, naming `where`: '' when
    there are)."""
    tok, framing = manifest.get("tokenizer", {}), manifest.get("eos_handling") or {}
    add_bos, add_eos = bool(framing.get("add_bos")), bool(framing.get("add_eos"))
    found = delimiters_of(tok.get("bos_id", -1), tok.get("eos_id", -1), add_bos, add_eos)
    if found is not None:
        return found, ""
    if not (add_bos or add_eos):
        return None, (
            f"{where} was prepared with add_bos = false and add_eos = false: nothing "
            "marks where one document ends and the next begins"
        )
    return None, f"{where} has a tokenizer without the BOS/EOS ids its framing asks for"


def starts(tokens: torch.Tensor, d: Delimiters) -> torch.Tensor:
    """Bool [B, S]: True where a document starts (position 0 always)."""
    start = torch.zeros_like(tokens, dtype=torch.bool)
    start[:, 0] = True
    if d.bos is not None:
        start |= tokens == d.bos
    if d.eos is not None:
        start[:, 1:] |= tokens[:, :-1] == d.eos
    return start


def count_targets(labels: torch.Tensor) -> int:
    """The labels a loss is computed on (not IGNORE_INDEX). The loader's labels are host
    tensors: counted on the host (numpy), they never wait for a device."""
    return int(np.count_nonzero(labels.numpy() != IGNORE_INDEX))


def document_ids(tokens: torch.Tensor, d: Delimiters) -> torch.Tensor:
    """Int64 [B, S]: 0 for the window's first (possibly partial) document, then 1, 2, ..."""
    return starts(tokens, d).cumsum(dim=1) - 1


def window_document_ids(
    doc_ids: torch.Tensor, inputs: torch.Tensor, labels: torch.Tensor, d: Delimiters | None
) -> torch.Tensor:
    """Int64 [B, S + 1]: the document of each of the window's tokens, `doc_ids` [B, S] of the
    inputs then token S (the last label): a new document if it is a BOS, follows an EOS, or
    was masked as a document start (IGNORE_INDEX: data.predict_document_start = false)."""
    last, new = labels[:, -1:], labels[:, -1:] == IGNORE_INDEX
    if d is not None and d.bos is not None:
        new = new | (last == d.bos)
    if d is not None and d.eos is not None:
        new = new | (inputs[:, -1:] == d.eos)
    return torch.cat([doc_ids, doc_ids[:, -1:] + new], dim=1)


class WindowsOfDocuments:
    """What a loader of document windows gives the step, from its `delimiters` (None: data
    without documents) and `predict_document_start`: the document ids of inputs, and a
    window's (inputs, labels). Shared by the global-order and the streaming loaders."""

    delimiters: Delimiters | None = None
    predict_document_start: bool = True

    def document_ids(self, inputs: torch.Tensor) -> torch.Tensor | None:
        """The document id of every input position ([B, S] int64, on the inputs' device), or
        None for data without documents. The model's block-causal mask and per-document
        positions come from these (trainer/models/common/attention.py)."""
        return None if self.delimiters is None else document_ids(inputs, self.delimiters)

    def _split(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels) of [B, seq_len+1] windows (data.predict_document_start applied)."""
        return split_window(windows, self.delimiters, self.predict_document_start)


class MicrobatchDocuments:
    """The document ids one training microbatch needs, each computed only where used: the
    model's [B, S] (`model`: block_causal attention, document positions) and the window's
    [B, S + 1] (`mtp`: multi-token prediction's targets within documents). `ids`: inputs ->
    [B, S] (the loader's `document_ids`)."""

    def __init__(self, ids, delimiters: Delimiters | None, *, model: bool, mtp: bool):
        self.ids, self.delimiters, self.model, self.mtp = ids, delimiters, model, mtp

    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor):
        """(the model's doc ids or None, the window's or None)."""
        ids = self.ids(inputs)
        window = window_document_ids(ids, inputs, labels, self.delimiters) if self.mtp else None
        return (ids if self.model else None), window


def split_window(
    windows: torch.Tensor, d: Delimiters | None, predict_document_start: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) of [B, S+1] windows; without `predict_document_start`, a label that
    is the first token of a document (predicted at the previous document's last position) is
    IGNORE_INDEX. Position 0 of the window is never a label, so the first start is skipped."""
    inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    if d is not None and not predict_document_start:
        labels = labels.masked_fill(starts(windows, d)[:, 1:], IGNORE_INDEX)
    return inputs, labels


def describe_documents(loader) -> str:
    """'; documents start ...' for a loader's describe(), with the cross-document targets."""
    d = loader.delimiters
    if d is None:
        return "; no document delimiters"
    kept = (
        "kept" if loader.predict_document_start else "masked (data.predict_document_start = false)"
    )
    return f"; {d.describe()}; targets that start a document {kept}"


def check_documents(model_cfg, loader) -> None:
    """Refuse `attn_mask_type = 'block_causal'`, `positions = 'document'` or
    `predict_document_start = false` on data whose documents cannot be told apart, naming the
    source and the reason (one line)."""
    needs = [
        f"model.attn_mask_type = {model_cfg.attn_mask_type!r}"
        if model_cfg.attn_mask_type != "causal"
        else "",
        f"model.positions = {model_cfg.positions!r}" if model_cfg.positions != "sequence" else "",
    ]
    if not getattr(loader, "predict_document_start", True):
        needs.append("data.predict_document_start = false")
    needs = " and ".join(n for n in needs if n)
    if not needs or getattr(loader, "delimiters", None) is not None:
        return
    why = getattr(loader, "no_documents", "") or f"the {loader.kind} data has no documents"
    raise DataError(
        f"{needs} needs document boundaries, but {why}; frame the documents with "
        "EOS or BOS (re-prepare a store with python -m trainer.data.prepare "
        "--add_eos; stream with data.add_eos = true), or set model.attn_mask_type "
        "= 'causal' and model.positions = 'sequence'"
    )
