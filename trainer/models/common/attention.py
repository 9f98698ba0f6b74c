"""Attention over packed windows: causal, or block-causal (documents do not see each other).

`[model] attn_mask_type`:
- `causal` (default): every token attends to every earlier token of the window, whatever
  document it belongs to. SDPA's causal kernel (`is_causal=True`), no mask tensor.
- `block_causal`: a token attends only to earlier tokens of its own document, as Llama 3 was
  trained. Documents come from the data (trainer/data/documents.py: a new one starts at each
  BOS and after each EOS the store framed them with); the model gets their ids, [B, S], with
  each microbatch and builds ONE mask per microbatch in its forward, shared by every layer:

  - `flex` (auto on CUDA): compiled FlexAttention over a BlockMask (128x128 tiles, ~B*(S/128)^2
    ints) from a compiled `create_block_mask`; tiles of other documents and above the diagonal
    are skipped; GQA in the kernel (k, v not repeated).
  - `per_document` (auto on CPU): one causal `scaled_dot_product_attention` per document of each
    row; no mask: q, k, v are split by the document lengths (read on the host; a graph break
    under compile).
  - `sdpa`: `scaled_dot_product_attention` with an additive [B, 1, S, S] mask in the compute
    dtype (0 / -inf), converted once, so every layer saves the same tensor.

  FlexAttention has no backward on the CPU. Of the two SDPA paths, per-document calls were
  measured faster on the CPU (benchmarks/RESULTS.md): the masked flash kernel visits every
  tile (~1.85x the causal kernel's time at seq_len 2048, whatever the documents), while the
  per-document calls cost about the causal kernel's time with one document per window (+5%)
  and less with more (0.3-0.4x at 8-133 documents); in the debug model's step at seq_len 256
  the two are within noise, at 2048 `sdpa` costs 1.31x the causal step and `per_document`
  1.00x. `sdpa` stays selectable (on CUDA: the memory-efficient kernel with a bias), e.g. as a
  fallback for `flex`, and compiles whole.

`[model] positions`: `sequence` (default) rotates token i of the window by position i;
`document` restarts at 0 at each document start (the first, possibly partial, document of a
window starts at 0 too), so a document sees the positions it would have alone.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from trainer.errors import ConfigError
from trainer.models.common import logits


def resolve_implementation(mask_type: str, implementation: str, device_type: str) -> str:
    """The kernel a run uses: sdpa, flex or per_document ('sdpa' for causal, whatever is
    asked: its causal kernel)."""
    if mask_type == "causal":
        return "sdpa"
    if implementation == "auto":
        return "flex" if device_type == "cuda" else "per_document"
    if implementation == "flex" and device_type != "cuda":
        raise ConfigError(
            f"model.attn_implementation = 'flex' needs CUDA, but this run computes "
            f"on {device_type}: FlexAttention has no backward on the CPU; use "
            "'auto', 'per_document' or 'sdpa'"
        )
    return implementation


def attention_args(model_cfg, device_type: str) -> dict:
    """The ModelArgs fields of a `[model]` config on this device (model_args(**...)): the
    depth, the attention's, the RoPE scaling's and the multi-token prediction's."""
    return {
        "n_layers": model_cfg.n_layers,
        "attn_mask_type": model_cfg.attn_mask_type,
        "positions": model_cfg.positions,
        "mtp_layers": model_cfg.mtp_layers,
        "mtp_loss_weight": model_cfg.mtp_loss_weight,
        "attn_implementation": resolve_implementation(
            model_cfg.attn_mask_type, model_cfg.attn_implementation, device_type
        ),
        **rope_args(model_cfg),
    }


def rope_args(model_cfg) -> dict:
    """model.rope_scaling as ModelArgs fields: 'none' drops the flavor's scaling, 'yarn' sets
    YaRN over it (model.yarn_factor, model.yarn_original_max_position_embeddings)."""
    if model_cfg.rope_scaling == "none":
        return {"rope_scaling": None}
    if model_cfg.rope_scaling == "yarn":
        from trainer.models.common.rope import yarn_over
        from trainer.models.flavors import FLAVORS

        flavor = FLAVORS[model_cfg.flavor].rope_scaling
        return {
            "rope_scaling": yarn_over(
                flavor, model_cfg.yarn_factor, model_cfg.yarn_original_max_position_embeddings
            )
        }
    return {}


def describe(args, layer: str = "") -> str:
    """One line of the startup summary: the mask, kernel and positions, after `layer` (what
    the family says of its attention layer, e.g. MLA's shape)."""
    mla = layer
    if args.attn_mask_type == "causal":
        return (
            f"attention: {mla}causal over the whole window (SDPA is_causal); RoPE "
            "positions: sequence"
        )
    kernel = {
        "flex": "FlexAttention (compiled), one BlockMask per microbatch shared by all layers",
        "sdpa": "SDPA with one additive [batch, 1, seq, seq] mask per microbatch shared "
        "by all layers",
        "per_document": "one causal SDPA call per document (split by the microbatch's "
        "document ids)",
    }[args.attn_implementation]
    return (
        f"attention: {mla}block_causal (a token sees earlier tokens of its own document only); "
        f"{kernel}; RoPE positions: {args.positions}"
    )


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Int64 [B, S]: each position's offset from the start of its document."""
    idx = torch.arange(doc_ids.shape[1], device=doc_ids.device).expand_as(doc_ids)
    start = torch.ones_like(doc_ids, dtype=torch.bool)
    start[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return idx - torch.where(start, idx, 0).cummax(dim=1).values


def build_mask(doc_ids: torch.Tensor, implementation: str, dtype: torch.dtype):
    """The block-causal mask of a microbatch for `implementation` (see the module docstring);
    per_document takes the document ids themselves."""
    if implementation == "flex":
        return _flex_block_mask(doc_ids)
    if implementation == "per_document":
        return doc_ids
    seq = doc_ids.shape[1]
    idx = torch.arange(seq, device=doc_ids.device)
    allowed = (doc_ids[:, :, None] == doc_ids[:, None, :]) & (idx[:, None] >= idx[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype, device=doc_ids.device)
    return mask.masked_fill_(~allowed, float("-inf")).unsqueeze(1)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask=None,
    gathered: bool = False,
    logit_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [b, s, n_heads, d] over k, v [b, s, n_kv_heads, d or d_v]: [b, n_heads,
    s, d_v].
    `mask` None: causal; a BlockMask: FlexAttention; a float tensor: SDPA's additive mask; an
    integer tensor (the document ids): one causal SDPA per document; an object with `attend`
    (context parallelism's, trainer/parallel/context_parallel.py): its own attention, over
    k and v of this rank's tokens, or of the whole sequence (`gathered`).
    `logit_max` [heads] (QK-clip): raised in place to each head's largest logit here
    (trainer/models/common/logits.py)."""
    width = v.shape[-1]
    if width < q.shape[-1] and q.device.type == "cpu":
        # MLA's values are narrower than its queries/keys, which only the CPU's math kernel
        # takes ([b, h, s, s] scores in fp32). Zero channels appended to v give the same
        # attention with zeros after it (exact), through the flash kernel, tile by tile; on
        # CUDA the cuDNN and memory-efficient kernels take the two widths as they are.
        v = F.pad(v, (0, q.shape[-1] - width))
        return attend(q, k, v, mask, gathered, logit_max)[..., :width]
    if hasattr(mask, "attend"):  # `gathered`: k, v already the whole sequence's (MLA)
        if logit_max is not None:
            return mask.attend(q, k, v, gathered=gathered, logit_max=logit_max)
        return mask.attend(q, k, v, gathered=gathered)
    if logit_max is not None and not _kernel_maxima(mask, q):
        logits.record(logit_max, logits.max_logits(q, k, logits.allowed_for(mask, q.shape[1])))
    groups = q.shape[2] // k.shape[2]
    q, k_t, v_t = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask is not None and not isinstance(mask, torch.Tensor):  # flex: GQA in the kernel
        return flex(q, k_t, v_t, mask, groups > 1, logit_max)
    # GQA in the kernel (each kv head serves `groups` query heads): no repeated K/V copies
    gqa = groups > 1
    if mask is None:
        return F.scaled_dot_product_attention(q, k_t, v_t, is_causal=True, enable_gqa=gqa)
    if not mask.is_floating_point():
        return _per_document(q, k_t, v_t, mask, gqa)
    return F.scaled_dot_product_attention(q, k_t, v_t, attn_mask=mask, enable_gqa=gqa)


def _kernel_maxima(mask, q: torch.Tensor) -> bool:
    """Whether the kernel of this mask returns the logit maxima itself: FlexAttention on
    CUDA (the CPU's raises 'Returning max scores is not supported on CPU'), where torch has
    `AuxRequest` (else the chunked reduction, from the BlockMask's mask_mod)."""
    return (
        mask is not None
        and not isinstance(mask, torch.Tensor)
        and q.device.type == "cuda"
        and _aux_request() is not None
    )


@functools.cache
def _aux_request():
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:  # an older torch
        return None
    return AuxRequest


def flex(q, k, v, block_mask, gqa: bool, logit_max: torch.Tensor | None = None):
    """Compiled FlexAttention (q, k, v [b, h, s, d]); with `logit_max` on CUDA, the kernel's
    own per-row maxima (AuxRequest) raise it."""
    if logit_max is None or q.device.type != "cuda" or _aux_request() is None:
        return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    out, aux = _compiled_flex()(
        q, k, v, block_mask=block_mask, enable_gqa=gqa, return_aux=_aux_request()(max_scores=True)
    )
    logits.record(logit_max, aux.max_scores.amax(dim=(0, 2)))
    return out


@torch.compiler.disable  # shapes change with every batch: a graph break, not recompiles
def _per_document(q, k, v, doc_ids: torch.Tensor, gqa: bool) -> torch.Tensor:
    """One causal SDPA per document of each row (q, k, v [b, h, s, d]; ids ascend per row).
    The split reads the ids on the host once per layer (free on the CPU)."""
    rows = []
    for b, ids in enumerate(doc_ids):
        lengths = torch.unique_consecutive(ids, return_counts=True)[1].tolist()
        pieces = zip(*(t[b : b + 1].split(lengths, dim=2) for t in (q, k, v)), strict=True)
        rows.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(*qkv, is_causal=True, enable_gqa=gqa)
                    for qkv in pieces
                ],
                dim=2,
            )
        )
    return torch.cat(rows)


def memory_bytes(args, batch: int, seq: int, p: int) -> int:
    """Bytes one microbatch's attention inputs hold from forward to the end of backward,
    beyond the activations of trainer.plan.memory.block_saved: the block-causal mask (sdpa: the
    additive [B, 1, S, S] mask in the compute dtype, saved once for every layer; flex: the
    BlockMask's int32 tile tables, ~16 * B * (S/128)^2 bytes; per_document: none, the
    document ids are an input) and, with document positions, the
    fp32 per-token cos/sin gathered once (4 * head_dim bytes per token). No path here
    materialises [B, H, S, S] scores: the flash (CPU) and memory-efficient (CUDA) SDPA kernels
    and compiled FlexAttention work tile by tile."""
    out = 0
    if args.attn_mask_type == "block_causal" and args.attn_implementation == "sdpa":
        out += batch * seq * seq * p
    elif args.attn_mask_type == "block_causal" and args.attn_implementation == "flex":
        tiles = -(-seq // 128)
        out += 16 * batch * tiles * (tiles + 1)
    if args.positions == "document":
        out += 4 * args.head_dim * batch * seq
    return out


# --------------------------------------------------------------------------- FlexAttention


@functools.cache
def _compiled_flex():
    """flex_attention compiled once per process (uncompiled it materialises the scores)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_create_block_mask():
    """create_block_mask compiled (as torchtitan does): without it, building the mask
    materialises a [B, S, S] boolean; compiled, it works tile by tile. New closures over new
    document ids do not recompile."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


def _flex_block_mask(doc_ids: torch.Tensor):
    batch, seq = doc_ids.shape

    def block_causal(b, h, q_idx, kv_idx):
        return (doc_ids[b, q_idx] == doc_ids[b, kv_idx]) & (q_idx >= kv_idx)

    return _compiled_create_block_mask()(block_causal, batch, None, seq, seq, device=doc_ids.device)
