"""Streaming a HF dataset without a store: documents are tokenized on the fly and packed.

Each dp rank reads its own part of the dataset (`split_dataset_by_node`), so there is no global
order: the state is per rank (the dataset iterator's state plus the packed tokens not yet
consumed) and resumes only on the same dp size. For exact resumes on any number of GPUs,
prepare a store with `python -m trainer.data.prepare`.
"""

from __future__ import annotations

import base64
import copy

import numpy as np
import torch

from trainer.data.config import DataConfig
from trainer.data.documents import WindowsOfDocuments, delimiters_of
from trainer.data.sources import examples, open_hf_stream, text_of
from trainer.data.tokenizer import Tokenizer
from trainer.errors import DataError

_DOCS_PER_ENCODE, _CHARS_PER_ENCODE = 64, 1 << 16  # small reads: fast start, little waste


class StreamingLoader(WindowsOfDocuments):
    kind = "streaming"

    def __init__(
        self,
        cfg: DataConfig,
        tokenizer: Tokenizer,
        hf_split: str,
        *,
        seq_len: int,
        local_batch_size: int,
        global_batch_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        predict_document_start: bool = True,
    ):
        assert global_batch_size % (local_batch_size * dp_size) == 0
        self.global_batch_size, self.per_rank = global_batch_size, global_batch_size // dp_size
        self.accum_steps = self.per_rank // local_batch_size
        self.cfg, self.tok, self.hf_split = cfg, tokenizer, hf_split
        self.seq_len, self.local_batch_size, self.seed = seq_len, local_batch_size, seed
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.vocab_size, self.tokenizer_path = tokenizer.vocab_size, tokenizer.path
        self.source = ", ".join(cfg.data_files) or cfg.dataset
        self.fingerprint = f"{cfg.dataset}:{hf_split}:{','.join(cfg.data_files)}:{tokenizer.sha256}"
        self.delimiters = delimiters_of(
            tokenizer.bos_id, tokenizer.eos_id, cfg.add_bos, cfg.add_eos
        )
        self.no_documents = (
            ""
            if self.delimiters
            else (
                f"streamed {self.source} is framed by neither BOS nor EOS (data.add_bos = "
                f"{cfg.add_bos}, data.add_eos = {cfg.add_eos}, tokenizer bos {tokenizer.bos_id}, "
                f"eos {tokenizer.eos_id})"
            )
        )
        self.predict_document_start = predict_document_start
        ds = open_hf_stream(cfg, hf_split)
        if dp_size > 1:
            from datasets.distributed import split_dataset_by_node

            ds = split_dataset_by_node(ds, rank=dp_rank, world_size=dp_size)
        self.ds = ds
        self._restart(epoch=0, hf_state=None, buffer="", samples=0)
        self._fill(seq_len + 1)  # an empty corpus or a missing column fails now, not mid-run

    def _restart(self, epoch: int, hf_state, buffer: str, samples: int) -> None:
        self.epoch, self.samples = epoch, samples
        self.ds.set_epoch(epoch)
        if hf_state is not None:
            self.ds.load_state_dict(copy.deepcopy(hf_state))
        self.it = examples(self.ds, self.cfg)
        self.buffer = np.frombuffer(base64.b64decode(buffer), dtype="<i8").astype(np.int64)
        self.epoch_tokens = len(self.buffer) if hf_state is None else 1

    def _fill(self, need: int) -> None:
        """Read and tokenize documents until `need` tokens are buffered; wrap at the end."""
        parts = [self.buffer]
        have = len(self.buffer)
        while have < need:
            texts, chars = [], 0
            for example in self.it:
                text = text_of(example, self.cfg)
                if text:
                    texts.append(text)
                    chars += len(text)
                if len(texts) >= _DOCS_PER_ENCODE or chars >= _CHARS_PER_ENCODE:
                    break
            if not texts:  # this rank's part of the dataset is exhausted: next epoch
                if self.epoch_tokens == 0:
                    raise DataError(
                        f"empty corpus: {self.source} (split {self.hf_split!r}) "
                        f"has no text in column {self.cfg.text_field!r} for dp rank "
                        f"{self.dp_rank} of {self.dp_size}"
                    )
                self._restart(self.epoch + 1, None, "", self.samples)
                continue
            for ids in self.tok.encode_docs(texts, self.cfg.add_bos, self.cfg.add_eos):
                parts.append(np.asarray(ids, dtype=np.int64))
                have += len(ids)
                self.epoch_tokens += len(ids)
        self.buffer = np.concatenate(parts)

    def next_microbatch(self) -> tuple[torch.Tensor, torch.Tensor]:
        n = self.local_batch_size * (self.seq_len + 1)
        self._fill(n)
        batch = torch.from_numpy(self.buffer[:n].reshape(self.local_batch_size, -1).copy())
        self.buffer = self.buffer[n:]
        self.samples += self.local_batch_size
        return self._split(batch)

    def state_dict(self) -> dict:
        """dp_size plus this rank's own state under 'dp_rank_<r>' (plain python values; the
        key is unique per rank so DCP does not deduplicate it away). The packed tokens not yet
        consumed are one base64 string rather than a list that DCP would flatten per item."""
        buffer = base64.b64encode(self.buffer.astype("<i8").tobytes()).decode("ascii")
        mine = {
            "hf_state": copy.deepcopy(self.ds.state_dict()),
            "epoch": self.epoch,
            "samples": self.samples,
            "buffer": buffer,
        }
        return {
            "kind": self.kind,
            "dp_size": self.dp_size,
            "fingerprint": self.fingerprint,
            "seq_len": self.seq_len,
            f"dp_rank_{self.dp_rank}": mine,
        }

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("kind") != self.kind:
            got = sd.get("kind") if isinstance(sd, dict) else type(sd).__name__
            raise DataError(
                f"checkpoint data state is for a {got!r} loader but {self.source} "
                "is streamed; resume with the data config it was saved with"
            )
        if sd.get("dp_size") != self.dp_size:
            raise DataError(
                f"checkpoint data state of streamed {self.source} was saved on dp size "
                f"{sd.get('dp_size')} and cannot resume on dp size {self.dp_size} (streaming "
                "keeps per-rank positions); prepare a store with python -m trainer.data.prepare"
                " and set data.store_path to resume on any number of GPUs"
            )
        if sd.get("fingerprint") != self.fingerprint or sd.get("seq_len") != self.seq_len:
            raise DataError(
                f"checkpoint data state is for another dataset, tokenizer or "
                f"seq_len than {self.source} with {self.tokenizer_path}"
            )
        mine = sd.get(f"dp_rank_{self.dp_rank}")
        if not isinstance(mine, dict):
            raise DataError(
                f"checkpoint data state has no entry dp_rank_{self.dp_rank} for "
                f"this rank (streamed {self.source})"
            )
        self._restart(mine["epoch"], mine["hf_state"], mine["buffer"], mine["samples"])

    def metrics(self) -> dict[str, float]:
        return {}

    def pop_events(self) -> list[str]:
        return []

    def describe(self) -> str:
        return (
            f"streaming {self.source} (split {self.hf_split!r}, tokenized on the fly, "
            f"per-rank resume only); tokenizer {self.tokenizer_path} (vocab "
            f"{self.vocab_size}); dp rank {self.dp_rank}/{self.dp_size}"
        )
