"""Log-likelihood scoring of multiple-choice examples, as lm-evaluation-harness (0.4.13) does
for a causal model's non-rolling `loglikelihood`:

- the pair (context, target_delimiter + choice) is tokenized by `encode_pair`: trailing
  whitespace of the context moves to the continuation; the whole string and the context are
  encoded apart and the continuation is the whole's tokens after the context's (`_encode_pair`);
  an empty context is the prefix token (BOS, else EOS), the continuation encoded alone;
- the scored window is (context + continuation)[-(seq_len + 1):], the model's input its first
  tokens and the continuation's log-probabilities are summed (left truncation to seq_len);
- acc: the argmax of the summed log-likelihoods is the gold index; acc_norm: the same with
  each divided by the choice's length in characters (`len(choice)`, without the delimiter:
  lm-eval's `completion_len`; its `acc_bytes` divides by `len(choice.encode())`, the same for
  ASCII text). np.argmax: ties go to the first choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from trainer.models.common.loss import IGNORE_INDEX, RowLoss


@dataclass(frozen=True)
class Request:
    """One scored sequence: tokens[:-1] is the model input, the last n_cont of tokens[1:]
    are the continuation's tokens."""

    tokens: tuple[int, ...]
    n_cont: int


def encode_pair(
    encode, context: str, continuation: str, *, prefix: list[int], prefix_token: int
) -> tuple[list[int], list[int]]:
    """(context tokens, continuation tokens) as lm-eval's loglikelihood builds them.
    `encode(list[str]) -> list[list[int]]` adds no special tokens; `prefix` is what the
    tokenizer would add in front (e.g. [BOS]), `prefix_token` the one an empty context gets."""
    if context == "":
        cont = encode([continuation])[0]
        if cont and cont[0] == prefix_token:
            return cont[:1], cont[1:]
        return [prefix_token], cont
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    whole, ctx = encode([context + continuation, context])
    whole, ctx = prefix + whole, prefix + ctx
    return ctx, whole[len(ctx) :]


def make_request(ctx: list[int], cont: list[int], seq_len: int) -> Request:
    """Left-truncate context + continuation to seq_len + 1 tokens (the model sees seq_len)."""
    tokens = (ctx + cont)[-(seq_len + 1) :]
    return Request(tuple(tokens), min(len(cont), len(tokens) - 1))


def build_requests(task, tokenizer, seq_len: int, add_bos: bool) -> list[Request]:
    """One request per (example, choice), examples in order, choices in order."""
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    prefix = [bos] if add_bos and bos >= 0 else []
    prefix_token = bos if bos >= 0 else eos

    def encode(texts: list[str]) -> list[list[int]]:
        return tokenizer.encode_docs(texts, add_bos=False, add_eos=False)

    out = []
    for ex in task.examples:
        for choice in ex.choices:
            ctx, cont = encode_pair(
                encode,
                ex.context,
                task.target_delimiter + choice,
                prefix=prefix,
                prefix_token=prefix_token,
            )
            out.append(make_request(ctx, cont, seq_len))
    return out


def forward_one_document(
    model, inputs: torch.Tensor, labels: torch.Tensor, loss_fn, context=None
) -> torch.Tensor:
    """The summed loss of each row (`RowLoss`), rows that are each one document (a request,
    or a padding pass): a model with block_causal attention or document positions is told
    so (document 0 everywhere). `context`: context parallelism's split (trainer/parallel/
    context_parallel.py): each cp rank scores its share of every row, summed over cp."""
    row_loss = RowLoss(loss_fn)
    doc_ids = torch.zeros_like(inputs) if getattr(model, "uses_documents", False) else None
    if context is not None:
        import torch.distributed as dist

        rows, _ = context.for_width(inputs.shape[1]).run(model, inputs, labels, row_loss, doc_ids)
        dist.all_reduce(rows, group=context.group)
        return rows
    if doc_ids is not None:
        return model(inputs, labels, row_loss, doc_ids=doc_ids)
    return model(inputs, labels, row_loss)


def width_multiple(model, context=None) -> int:
    """What an eval forward's width must be a multiple of: the tp ranks' sequence shards
    (`sequence_multiple`), times the 2 x cp chunks of context parallelism's split."""
    return getattr(model, "sequence_multiple", 1) * (2 * context.cp if context else 1)


FLEX_MIN_WIDTH = 128  # FlexAttention's tile


def fixed_shapes(model, context=None) -> bool:
    """Whether the model's attention is compiled per input shape (FlexAttention, dynamic=False:
    every new (batch, width) recompiles, and past torch's recompile limit it runs eagerly,
    materialising the scores): then evals feed it a few fixed shapes (`eval_shape`). Under
    context parallelism its own kernel decides (FlexAttention on CUDA, causal models too)."""
    if context is not None:
        return context.kernel == "flex"
    args = getattr(model, "args", None)
    return getattr(args, "attn_implementation", None) == "flex" and getattr(
        model, "uses_documents", False
    )


def eval_shape(
    model, rows: int, width: int, batch: int | None, multiple: int | None = None, context=None
) -> tuple[int, int]:
    """(rows, width) of an eval forward: as given (the width rounded up to `multiple`, default
    `width_multiple`), or for `fixed_shapes` models the eval batch
    `batch` and the width rounded up to a power of two of at least 128 (at most the model's
    max_seq_len): <= 7 widths up to 8192, within torch's 8 recompiles. Rows and positions
    added are padding: causal attention and the ignored labels leave every real score alone."""
    multiple = multiple or width_multiple(model, context)
    if not fixed_shapes(model, context):
        return rows, -(-width // multiple) * multiple
    bucket = max(FLEX_MIN_WIDTH, 1 << (width - 1).bit_length())
    cap = -(-max(model.args.max_seq_len, width) // multiple) * multiple
    return max(rows, batch or rows), min(-(-bucket // multiple) * multiple, cap)


@torch.no_grad()
def score_batch(
    model,
    requests: list[Request],
    device,
    loss_fn,
    pad_id: int = 0,
    batch: int | None = None,
    context=None,
) -> torch.Tensor:
    """Summed continuation log-likelihood of each request, float64 [len(requests)]: minus the
    cross-entropy of its continuation's tokens, through the chunked head (`loss_fn`,
    trainer.models.common.loss.scoring_loss: one chunk of logits at a time). The batch is
    right-padded to its longest input (causal attention: padding changes no real logit),
    rounded up to the model's `sequence_multiple` (sequence parallelism shards the sequence
    evenly over the tp ranks); for a model compiled per shape, to `eval_shape` (`batch`: the
    eval batch, padding rows added); under context parallelism (`context`) to 2 x cp chunks."""
    multiple = width_multiple(model, context)
    width = max(len(r.tokens) - 1 for r in requests)
    rows, width = eval_shape(model, len(requests), width, batch, multiple, context)
    inputs = torch.full((rows, width), pad_id, dtype=torch.long)
    targets = torch.zeros((rows, width), dtype=torch.long)
    mask = torch.zeros((rows, width), dtype=torch.bool)
    for i, r in enumerate(requests):
        n = len(r.tokens) - 1
        inputs[i, :n] = torch.tensor(r.tokens[:-1])
        targets[i, :n] = torch.tensor(r.tokens[1:])
        mask[i, n - r.n_cont : n] = True
    labels = torch.where(mask, targets, IGNORE_INDEX)  # only the continuation is scored
    cross_entropy = forward_one_document(
        model, inputs.to(device), labels.to(device), loss_fn, context
    )
    return -cross_entropy[: len(requests)].double()


def padding_pass(
    model, device, loss_fn, pad_id: int = 0, batch: int | None = None, context=None
) -> None:
    """A forward that scores nothing: ranks with fewer batches run it so that every rank
    makes the same collectives (FSDP's all-gathers)."""
    shape = eval_shape(model, 1, 1, batch, width_multiple(model, context), context)
    inputs = torch.full(shape, pad_id, dtype=torch.long, device=device)
    with torch.no_grad():
        forward_one_document(model, inputs, torch.full_like(inputs, IGNORE_INDEX), loss_fn, context)


def choice_metrics(lls: np.ndarray, examples) -> dict[str, float]:
    """acc and acc_norm over the examples, given the log-likelihoods of their choices
    (flat, example by example, as build_requests orders them)."""
    hits = np.zeros(2)
    i = 0
    for ex in examples:
        ll = np.asarray(lls[i : i + len(ex.choices)], dtype=np.float64)
        i += len(ex.choices)
        lengths = np.array([float(len(c)) for c in ex.choices])
        hits += [np.argmax(ll) == ex.gold, np.argmax(ll / lengths) == ex.gold]
    acc, acc_norm = hits / max(len(examples), 1)
    return {"acc": float(acc), "acc_norm": float(acc_norm)}
