"""Gated DeltaNet's token mixing (Yang, Kautz, Hatamizadeh 2024; Qwen3-Next, Qwen3.5): the
gated delta rule and the short causal convolution before it, with documents kept apart.

Per head, a state S [d_k, d_v] is decayed, corrected towards the new value and read:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,    o_t = S_t^T q_t

with q, k (optionally L2-normalised here) and q scaled by d_k^-0.5, as transformers' and
flash-linear-attention's kernels do. Three implementations, one contract:

- `recurrent_gated_delta_rule`: token by token, the reference (a Python loop over tokens).
- `chunk_gated_delta_rule`: the chunked WY/UT form (chunk 64): within a chunk the corrections
  are one unit-lower-triangular solve, across chunks one state update per chunk.
- flash-linear-attention's Triton `chunk_gated_delta_rule` (`pip install fla-core`), used by
  `gated_delta_rule` on CUDA when installed (`kernel_name` says which runs).

**Documents.** `doc_ids` [b, s] (the loader's document ids of a packed window): the state
restarts at every token whose id differs from the previous token's, exactly as if each document
ran alone; no loop over documents or tokens: a restart is a decay of zero, so the chunked form
masks the decays that cross a boundary (within a chunk, from the chunk's start, to its end).
The convolution (`short_conv`) masks the taps that reach into another document the same way.

**State in and out.** `initial_state` [b, h_v, d_k, d_v] continues into the window's first
document (zero it for rows whose window starts a new one); the final state is the window's
last document's. The convolution's `prefix` (the K - 1 inputs before the window) likewise.
Splitting a sequence and passing both on gives the unsplit result (context parallelism).

Grouped values (h_v > h_k): key head i serves value heads i r ... i r + r - 1 (r = h_v / h_k).
"""

from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) over the last dim (transformers' and fla's formula)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _heads_first(q, k, v, g, beta, use_qk_l2norm: bool):
    """[b, s, h, d] inputs -> fp32 [b, h_v, s, d] (q, k repeated over their value heads), q
    scaled by d_k^-0.5 after the optional L2 norm."""
    r = v.shape[2] // k.shape[2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=2), k.repeat_interleave(r, dim=2)
    q, k, v, g, beta = (x.transpose(1, 2).float() for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    output_final_state: bool = False,
    doc_ids=None,
    use_qk_l2norm: bool = False,
):
    """The token-by-token recurrence (the reference). q, k [b, s, h_k, d_k], v [b, s, h_v, d_v],
    g (log decay, <= 0) and beta [b, s, h_v] -> (o [b, s, h_v, d_v] in q's dtype, the final
    state [b, h_v, d_k, d_v] fp32 or None)."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, use_qk_l2norm)
    b, h, s, dk = k.shape
    state = (
        torch.zeros(b, h, dk, v.shape[-1], device=v.device)
        if initial_state is None
        else initial_state.float()
    )
    out = []
    for t in range(s):
        if doc_ids is not None and t > 0:  # a new document: its state starts from zero
            state = state * (doc_ids[:, t] == doc_ids[:, t - 1]).float()[:, None, None, None]
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - read) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        out.append((state * q[:, :, t, :, None]).sum(-2))
    o = torch.stack(out, dim=2).transpose(1, 2).to(dtype)
    return o, (state if output_final_state else None)


def _document_masks(doc_ids: torch.Tensor, n: int, c: int):
    """Per chunk of `doc_ids` [b, n c]: (same [b, 1, n, c, c]: tokens i, j of one document;
    from_start [b, 1, n, c]: token i in the document of the state entering the chunk;
    to_end [b, 1, n, c]: token i in the chunk's last document). The state entering the window
    continues its first document."""
    d = doc_ids.view(-1, 1, n, c)
    entering = torch.cat((doc_ids[:, :1], doc_ids[:, :-1]), dim=1).view(-1, 1, n, c)[..., :1]
    same = d[..., :, None] == d[..., None, :]
    return same, d == entering, d == d[..., -1:]


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    output_final_state: bool = False,
    doc_ids=None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
):
    """The chunked form (in torch), the same contract as `recurrent_gated_delta_rule`.

    Per chunk of c tokens with in-chunk cumulative log decays G: the corrections solve
    (I + L) U = diag(beta) V and (I + L) W = diag(beta exp(G)) K, L the strictly lower part
    of diag(beta) K K^T weighted by exp(G_i - G_j); then per chunk, in order,
    V' = U - W S, O = (Q exp(G)) S + tril(Q K^T exp(G_i - G_j)) V',
    S <- exp(G_c) S + (K exp(G_c - G))^T V'. A document boundary zeroes every decay across it."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta, use_qk_l2norm)
    b, h, s, dk = k.shape
    c = chunk_size
    pad = (-s) % c  # zero tokens after the window: no decay, no update, outputs dropped
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        if doc_ids is not None:  # the padding continues the last document
            doc_ids = torch.cat((doc_ids, doc_ids[:, -1:].expand(-1, pad)), dim=1)
    n = (s + pad) // c
    q, k, v = (x.view(b, h, n, c, -1) for x in (q, k, v))
    g, beta = g.view(b, h, n, c), beta.view(b, h, n, c)
    cum = g.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    start, end = cum.exp(), (cum[..., -1:] - cum).exp()
    if doc_ids is None:
        keep = lower
    else:
        same, from_start, to_end = _document_masks(doc_ids, n, c)
        keep = same & lower
        start, end = start * from_start, end * to_end
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~keep, float("-inf")).exp()
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its diagonal is not read (unitriangular)
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k_beta * start[..., None], upper=False, unitriangular=True
    )
    inner = (q @ k.transpose(-1, -2)) * decay
    q_start, k_end = q * start[..., None], k * end[..., None]
    chunk_decay = start[..., -1]  # exp(G_c), zero where the chunk holds a boundary
    state = (
        torch.zeros(b, h, dk, v.shape[-1], device=v.device)
        if initial_state is None
        else initial_state.float()
    )
    out = []
    for i in range(n):
        v_new = u[:, :, i] - w[:, :, i] @ state
        out.append(q_start[:, :, i] @ state + inner[:, :, i] @ v_new)
        state = state * chunk_decay[:, :, i, None, None] + k_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(out, dim=2).reshape(b, h, n * c, -1)[:, :, :s]
    return o.transpose(1, 2).to(dtype), (state if output_final_state else None)


FLA_MIN = (0, 6)  # grouped value heads (Qwen3-Next's 32 value over 16 key heads) in the kernel


def _fla_version(fla) -> str | None:
    """fla's version: its __version__ (a source install too), else a distribution's."""
    from importlib.metadata import PackageNotFoundError, version

    found = getattr(fla, "__version__", None)
    for dist in ("fla-core", "flash-linear-attention"):
        if found:
            break
        try:
            found = version(dist)
        except PackageNotFoundError:
            pass
    return found


@functools.cache
def _fla_found():
    """(flash-linear-attention's chunk_gated_delta_rule or None, what was found). An fla older
    than FLA_MIN, or of no known version, is not used: before 0.6 its kernel took one value
    head per key head and would leave half of Qwen3-Next's output heads unwritten."""
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None, "fla-core not installed"
    found = _fla_version(fla)
    parts = re.match(r"(\d+)\.(\d+)", found or "")
    if parts is None or (int(parts[1]), int(parts[2])) < FLA_MIN:
        return None, (
            f"fla {found or 'of unknown version'} found, not used: its kernel needs "
            f"fla-core >= {FLA_MIN[0]}.{FLA_MIN[1]} for grouped value heads"
        )
    return fla_chunk, f"fla-core {found}"


def _fla():
    return _fla_found()[0]


def kernel_name(device_type: str) -> str:
    """The Gated DeltaNet kernel a run on `device_type` uses (for the startup line)."""
    if device_type != "cuda":
        return "torch chunked gated delta rule (chunk 64)"
    kernel, found = _fla_found()
    if kernel is not None:
        return f"fla chunk_gated_delta_rule ({found})"
    return f"torch chunked gated delta rule (chunk 64; {found})"


def gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    *,
    initial_state=None,
    output_final_state=False,
    doc_ids=None,
    use_qk_l2norm=True,
):
    """The chunked gated delta rule on the fastest path here: fla's Triton kernel on CUDA when
    installed, else `chunk_gated_delta_rule` (the same contract)."""
    if q.is_cuda and _fla() is not None:
        return _fla_gated_delta_rule(
            q, k, v, g, beta, initial_state, output_final_state, doc_ids, use_qk_l2norm
        )
    return chunk_gated_delta_rule(
        q,
        k,
        v,
        g,
        beta,
        initial_state=initial_state,
        output_final_state=output_final_state,
        doc_ids=doc_ids,
        use_qk_l2norm=use_qk_l2norm,
    )


def _fla_gated_delta_rule(
    q, k, v, g, beta, initial_state, output_final_state, doc_ids, use_qk_l2norm
):
    """fla-core's kernel (>= 0.6: grouped values in the kernel). Untested here: no GPU or
    Triton on the development machine; written against fla-core 0.6.0's signature
    (q, k, v, g, beta, scale=None -> d_k^-0.5, initial_state [N, h_v, d_k, d_v],
    output_final_state, use_qk_l2norm_in_kernel, cu_seqlens [N + 1] over a batch of 1).
    Documents become the kernel's variable-length sequences: the [b, s] window is flattened
    and every document (and every row) is one sequence; a row's initial state enters its first
    document and its final state is its last document's (one host sync for the boundaries)."""
    fla = _fla()
    if doc_ids is None:
        return fla(
            q,
            k,
            v,
            g.float(),
            beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm,
        )
    b, s = doc_ids.shape
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = starts.flatten().nonzero().flatten()
    cu_seqlens = torch.cat((first, first.new_tensor([b * s])))
    row_first = torch.searchsorted(first, torch.arange(b, device=first.device) * s)
    init = None
    if initial_state is not None:
        init = initial_state.new_zeros(first.numel(), *initial_state.shape[1:])
        init[row_first] = initial_state
    flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g.float(), beta)]
    o, state = fla(
        *flat,
        initial_state=init,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        cu_seqlens=cu_seqlens,
    )
    row_last = torch.cat((row_first[1:], row_first.new_tensor([first.numel()]))) - 1
    return o.view(b, s, *o.shape[2:]), (state[row_last] if output_final_state else None)


def short_conv(x: torch.Tensor, weight: torch.Tensor, doc_ids=None, prefix=None):
    """The depthwise causal convolution: y_t = sum_j weight[:, K-1-j] x_{t-j} over the taps
    j < K within x_t's document (K = weight.shape[-1]); x [b, s, c], weight [c, K].
    `prefix` [b, K-1, c]: the inputs before the window (default zeros), in its first document.
    Returns (y, the last K - 1 inputs: the next window's prefix)."""
    b, s, _ = x.shape
    taps = weight.shape[-1]
    before = x.new_zeros(b, taps - 1, x.shape[-1]) if prefix is None else prefix.to(x.dtype)
    full = torch.cat((before, x), dim=1)
    if doc_ids is not None:
        docs = torch.cat((doc_ids[:, :1].expand(-1, taps - 1), doc_ids), dim=1)
    y = x * weight[:, -1]
    for j in range(1, taps):
        tap = full[:, taps - 1 - j : taps - 1 - j + s] * weight[:, -1 - j]
        if doc_ids is not None:
            tap = tap * (docs[:, taps - 1 - j : taps - 1 - j + s] == doc_ids)[..., None]
        y = y + tap
    return y, full[:, -(taps - 1) :] if taps > 1 else full[:, :0]
