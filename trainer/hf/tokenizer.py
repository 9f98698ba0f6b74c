"""The run's tokenizer in a Hugging Face folder: `tokenizer.json` (+ tokenizer_config.json),
readable by `AutoTokenizer.from_pretrained` and `tokenizers.Tokenizer.from_file`.

A sentencepiece BPE model (as trained by trainer.data.train_tokenizer) is rebuilt as a
`tokenizers` BPE with the same pieces and ids:
- whitespace becomes "▁" and words split where sentencepiece splits them (a run of "▁"
  starts a word: pieces never cross into the next word, whitespace runs stay whole);
- merges are ordered by the merged piece's score, as sentencepiece's BPE picks them;
- user-defined pieces (the newline) are added tokens, never merged with neighbours;
- unseen characters fall back to byte pieces <0x..>; BOS is prepended like the trainer does
  (EOS separates documents in training; generation stops at it).
A `tokenizer.json` used for training is copied as is.
"""

from __future__ import annotations

import json
import os
import shutil

SPACE = "\u2581"


def sentencepiece_to_hf(model_path: str):
    """A `tokenizers.Tokenizer` that encodes exactly like the sentencepiece model."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    proto = pb.ModelProto()
    with open(model_path, "rb") as fh:
        proto.ParseFromString(fh.read())
    if proto.trainer_spec.model_type != pb.TrainerSpec.BPE:
        raise ValueError(f"{model_path}: only sentencepiece BPE models convert to tokenizer.json")
    sp = spm.SentencePieceProcessor(model_file=model_path)
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    normal = pb.ModelProto.SentencePiece.NORMAL
    merges = []
    # Highest score first; among merges into the same piece, the order is immaterial except
    # for ties, which both libraries break leftmost-first.
    for piece in sorted(
        (p for p in proto.pieces if p.type == normal and len(p.piece) > 1), key=lambda p: -p.score
    ):
        for cut in range(1, len(piece.piece)):
            left, right = piece.piece[:cut], piece.piece[cut:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    unk = proto.pieces[sp.unk_id()].piece
    tok = Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=unk,
            fuse_unk=True,
            byte_fallback=proto.trainer_spec.byte_fallback,
        )
    )
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex(f"{SPACE}*[^{SPACE}]+|{SPACE}+"), behavior="isolated"
    )
    tok.decoder = decoders.Sequence(
        [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    specials = [
        p.piece
        for p in proto.pieces
        if p.type in (pb.ModelProto.SentencePiece.CONTROL, pb.ModelProto.SentencePiece.UNKNOWN)
    ]
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    user = [p.piece for p in proto.pieces if p.type == pb.ModelProto.SentencePiece.USER_DEFINED]
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in user])
    bos = proto.pieces[sp.bos_id()].piece if sp.bos_id() >= 0 else None
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, sp.bos_id())]
        )
    names = {
        "bos_token": sp.bos_id(),
        "eos_token": sp.eos_id(),
        "unk_token": sp.unk_id(),
        "pad_token": sp.pad_id(),
    }
    special = {k: proto.pieces[i].piece for k, i in names.items() if i >= 0}
    return tok, special


def export_tokenizer(tokenizer_path: str, out_dir: str, *, model_max_length: int) -> dict:
    """Write tokenizer.json and tokenizer_config.json; returns the special tokens' ids."""
    from tokenizers import Tokenizer

    from trainer.data.tokenizer import hf_special_tokens, is_hf_tokenizer

    if is_hf_tokenizer(tokenizer_path):
        shutil.copyfile(tokenizer_path, os.path.join(out_dir, "tokenizer.json"))
        tok = Tokenizer.from_file(tokenizer_path)
        special = hf_special_tokens(tokenizer_path, tok)
    else:
        tok, special = sentencepiece_to_hf(tokenizer_path)
        tok.save(os.path.join(out_dir, "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "add_bos_token": "bos_token" in special,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as fh:
        json.dump(config, fh, indent=2)
        fh.write("\n")
    return {k: tok.token_to_id(v) for k, v in special.items()}
