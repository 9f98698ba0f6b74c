"""The largest pre-softmax attention logit of each head (QK-clip, `optimizer.muon_qk_clip`).

A logit is what the softmax sees: the scaled score `q . k / sqrt(d)` (SDPA's default scale,
d the query/key width; MLA's YaRN gain is already in its queries) of a query and a key it may
attend to. Masked pairs (later tokens, other documents) are not logits and never count.

Where the attention kernel returns the maxima, they come from it: FlexAttention on CUDA
(`return_aux=AuxRequest(max_scores=True)`, torch >= 2.9). The SDPA kernels return none, so
on those paths (and FlexAttention on a CPU, which cannot return them) the maxima are a
reduction of their own: the scores recomputed without gradients, `CHUNK` queries at a time
(one [b, heads, CHUNK, keys] fp32 block in memory), masked as the kernel masks them. That
is one more q.k^T matmul per layer in the forward: +1/2 of the attention's forward matmul
FLOPs, about +1/7 of its forward and backward (benchmarks/optim/bench_qk_clip.py measures it).
"""

from __future__ import annotations

import math

import torch

CHUNK = 512  # queries per block of recomputed scores


def scale_rows_(param: torch.Tensor, rows: torch.Tensor) -> None:
    """param[r, :] *= rows[r] on this rank's shard of the (possibly sharded) parameter: each
    rank cuts its own block of the full scale, no communication. An attention layer's QK-clip
    (`clip_logits_`) scales its query and key rows with it."""
    full = rows.to(torch.float32).unsqueeze(1).expand(param.shape)
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
        param = param.to_local()
    param.mul_(full.to(device=param.device, dtype=param.dtype))


def clip_normed_(q_norm, k_norm, gamma: torch.Tensor) -> None:
    """QK-clip of a layer with a per-head RMSNorm of q and k: the norms divide out any scale
    of the query and key rows, so their weights (shared by every head) take it, the layer as
    one: each x sqrt(gamma) of its most clipped head."""
    layer = gamma.sqrt().min()
    q_norm.scale_(layer)
    k_norm.scale_(layer)


def record(buffer: torch.Tensor, maxima: torch.Tensor) -> None:
    """buffer = max(buffer, maxima), in place, on the device (no host sync)."""
    buffer.copy_(torch.maximum(buffer, maxima.detach().to(buffer.dtype)))


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, allowed=None, causal: bool = True) -> torch.Tensor:
    """[heads] fp32: each query head's largest logit over `q` [b, s, heads, d] and `k`
    [b, S, kv_heads, d] (kv heads serve heads / kv_heads query heads each, GQA).

    `allowed(rows)` gives the pairs that count for the query positions `rows` (a [rows]
    int64 tensor): a boolean tensor broadcastable to [b, 1, len(rows), S]; None: causal with
    the queries at the last s of the S key positions (s == S without context parallelism).
    `causal`: no query attends past its own position (the query rows are in sequence
    order), so a block of queries is scored against the keys up to its last one only."""
    b, s, heads, d = q.shape
    keys, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / math.sqrt(d)
    kt = k.permute(0, 2, 3, 1).float()  # [b, kv_heads, d, S]
    if kv_heads != heads:
        kt = kt.repeat_interleave(heads // kv_heads, dim=1)
    out = torch.full((heads,), float("-inf"), device=q.device)
    cols = torch.arange(keys, device=q.device)
    for start in range(0, s, CHUNK):
        rows = torch.arange(start, min(start + CHUNK, s), device=q.device)
        seen = min(start + len(rows) + keys - s, keys) if causal else keys
        scores = torch.matmul(
            q[:, start : start + len(rows)].transpose(1, 2).float(), kt[..., :seen]
        )
        scores.mul_(scale)  # [b, heads, rows, seen]
        mask = (
            (cols[None, :seen] <= (rows + keys - s)[:, None])
            if allowed is None
            else allowed(rows)[..., :seen]
        )
        scores.masked_fill_(~mask, float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(0, 2, 3)))
    return out


def causal_documents(doc_ids: torch.Tensor):
    """`allowed` of block-causal attention over documents `doc_ids` [b, S] (queries and
    keys the same positions)."""

    def allowed(rows):
        cols = torch.arange(doc_ids.shape[1], device=doc_ids.device)
        same = doc_ids[:, rows, None] == doc_ids[:, None, :]
        return (same & (cols[None, None, :] <= rows[None, :, None])).unsqueeze(1)

    return allowed


def additive(mask: torch.Tensor):
    """`allowed` of SDPA's additive float mask [b or 1, 1, s, S] (0 allowed, -inf not)."""
    return lambda rows: mask[:, :, rows] == 0


def boolean(mask: torch.Tensor):
    """`allowed` of a boolean mask [b or 1, 1, s, S] (True allowed)."""
    return lambda rows: mask[:, :, rows]


def block_mask(mask) -> callable:
    """`allowed` of a FlexAttention BlockMask, from its mask_mod evaluated on index grids
    (this trainer's mask_mods are elementwise tensor expressions, which broadcast)."""

    def allowed(rows):
        b = torch.arange(mask.shape[0], device=rows.device)[:, None, None, None]
        cols = torch.arange(mask.shape[-1], device=rows.device)[None, None, None, :]
        zero = torch.zeros((), dtype=torch.long, device=rows.device)
        return mask.mask_mod(b, zero, rows[None, None, :, None], cols)

    return allowed


def allowed_for(mask, seq: int):
    """`allowed` for an attention mask as trainer.models.common.attention.attend takes it (None:
    causal; a float tensor: additive; an integer tensor: document ids; a bool tensor; a
    BlockMask)."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor):
        if mask.dtype == torch.bool:
            return boolean(mask)
        return additive(mask) if mask.is_floating_point() else causal_documents(mask)
    return block_mask(mask)
