"""`python -m trainer.data.train_tokenizer`: train a SentencePiece BPE model on a source.

    python -m trainer.data.train_tokenizer --dataset json --data_files 'data/*.jsonl' \
        --vocab_size 32000 --output tokenizers/mydata.model

Reads documents from the configured source (the same flags / [data] keys as training) up to
--max_chars characters, showing documents and characters read, then trains. The model keeps
text exactly (see tokenizer.py) and has unk=0, bos=1, eos=2, pad=3.
"""

from __future__ import annotations

import argparse
import os

from trainer.data.progress import Progress
from trainer.data.sources import documents
from trainer.data.tokenizer import Tokenizer, train_bpe
from trainer.errors import DataError


def main() -> None:
    from trainer.data.cli import add_data_args, data_config_from_args

    parser = argparse.ArgumentParser(
        prog="python -m trainer.data.train_tokenizer", description=__doc__.split("\n\n")[0]
    )
    add_data_args(parser)
    parser.add_argument("--output", required=True, help="where to write the .model file")
    parser.add_argument(
        "--max_chars",
        type=int,
        default=100_000_000,
        help="stop reading the source after this many characters",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    cfg = data_config_from_args(args)
    if cfg.dataset == "synthetic":
        raise DataError("data.dataset = 'synthetic' has no text to train a tokenizer on")
    progress = Progress(f"train_tokenizer {args.output}")
    seen = {"docs": 0, "chars": 0}

    def on_doc(docs: int, chars: int) -> None:
        seen.update(docs=docs, chars=chars)
        progress.update(f"read {docs:,} docs, {chars / 1e6:.1f}M chars")

    train_bpe(
        documents(cfg),
        cfg.vocab_size,
        args.output,
        max_chars=args.max_chars,
        num_threads=args.threads,
        on_doc=on_doc,
    )
    progress.update(f"read {seen['docs']:,} docs, {seen['chars'] / 1e6:.1f}M chars", force=True)
    tok = Tokenizer(args.output)
    progress.done(
        f"BPE vocab {tok.vocab_size} (bos {tok.bos_id}, eos {tok.eos_id}, "
        f"pad {tok.pad_id}) trained on {seen['docs']:,} docs"
    )


if __name__ == "__main__":
    from trainer.data.cli import run_main

    run_main(main)
