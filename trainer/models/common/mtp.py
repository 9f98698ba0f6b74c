"""Multi-token prediction (DeepSeek-V3; `model.mtp_layers`, `model.mtp_loss_weight`).

After the main model's last block, MTP module k (1-based) takes the hidden state h^{k-1} of
each position i (for k = 1 the main model's after its final norm, the state Megatron, vLLM and
SGLang feed the released MTP weights; for k > 1 the previous module's block output) and the
embedding of
token i + k, the one the previous depth predicted: `proj([embed_norm(emb), hidden_norm(h)])`
(the order of DeepSeek's released weights), then a transformer block of its own (MoE like the
model's other sparse blocks), gives h^k; its own final norm and the model's head (shared, as
is the embedding) predict token i + k + 1. The positions whose input or target falls past the
window are ignored.

**Within documents.** In a packed window, token i + k + 1 and the chain's inputs i + 1..i + k
may belong to the next document. Where documents apply (the model keeps them apart:
`attn_mask_type = "block_causal"` or `positions = "document"`; or the data masks the targets
that start a document: `data.predict_document_start = false`), depth k's target at position i
is kept only if token i + k + 1 lies in position i's document; document ids never decrease
along a window, so every input of its chain does too. This is torchtitan's valid mask and
Megatron's rolling within each packed sequence: a packed window's MTP loss is the sum of its
documents' MTP losses, each taken alone. With plain causal attention and
`predict_document_start = true` the window is one stream, as it is for the main head (which
is trained there to predict a document's first token from the previous one's context), and
the depths read across documents too. The targets come from the window's document ids
[b, s + 1]: the inputs', then token s (the last label, past the inputs: trainer/data/
documents.py `window_document_ids`).

The training loss is the main loss plus `mtp_loss_weight` x the mean of the depths' losses
(each summed over its tokens and divided by the step's token count, like the main loss); the
MTP part is logged apart as `loss_metrics/mtp_loss` (the mean over depths, per token), and
`loss` stays the main model's. Validation, evals, generation and Hugging Face exports use the
main model alone.
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.common.layers import RMSNorm

IGNORE_INDEX = -100


class MTPModule(nn.Module):
    """One depth: two input norms, the projection, a transformer block, an output norm.
    `norm`: the norms' class (a family's own: Qwen3-Next's are zero-centred)."""

    def __init__(self, dim: int, eps: float, block: nn.Module, norm: type = RMSNorm):
        super().__init__()
        self.embed_norm = norm(dim, eps)
        self.hidden_norm = norm(dim, eps)
        self.proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = norm(dim, eps)

    def forward(self, h, emb, cos, sin, mask=None):
        z = torch.cat([self.embed_norm(emb), self.hidden_norm(h)], dim=-1)
        # On rows [b * s, 2 dim]: under TP the rows are this rank's sequence shard, and torch
        # 2.11's DTensor cannot flatten a [b, s, 2 dim] input whose s is sharded.
        x = self.proj(z.flatten(0, 1)).view(*z.shape[:-1], -1)
        return self.block(x, cos, sin, mask)


def future_labels(
    labels: torch.Tensor, depth: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """[depth, b, s]: labels shifted left by 1..depth along the sequence, IGNORE_INDEX past
    the end: row j - 1 holds, at position i, the token i + j + 1 (MTP depth j's target).
    `documents` [b, s + 1]: the document of each of the window's tokens (inputs, then the
    last label); a target in another document than position i's is IGNORE_INDEX."""
    out = torch.full((depth, *labels.shape), IGNORE_INDEX, dtype=labels.dtype, device=labels.device)
    for j in range(1, depth + 1):
        target = labels[:, j:]
        if documents is not None:  # token i + j + 1 against token i
            target = target.masked_fill(
                documents[:, j + 1 :] != documents[:, : -j - 1], IGNORE_INDEX
            )
        out[j - 1, :, :-j] = target
    return out


def mtp_streams(labels: torch.Tensor, future: torch.Tensor):
    """(input tokens, targets) of each depth: depth k reads token i + k (labels for k = 1,
    else future[k - 2]) and predicts future[k - 1]; a position whose input is unknown
    (IGNORE_INDEX) has no target, and reads token 0 in its place."""
    streams, inputs = [], labels
    for k in range(future.shape[0]):
        unknown = inputs == IGNORE_INDEX
        streams.append(
            (torch.where(unknown, 0, inputs), torch.where(unknown, IGNORE_INDEX, future[k]))
        )
        inputs = future[k]
    return streams
