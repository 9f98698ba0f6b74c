"""gpt-oss's decoder: pre-norm blocks of attention with sinks (sliding-window in every other
layer) and a MoE whose router and experts carry biases, as transformers 5.24's
GptOssForCausalLM computes it (tests/test_gpt_oss.py: logits, loss, gradients and an AdamW
step against it).

Our layout of the parameters:
- `attention.wq/wk/wv/wo` with biases and `attention.sinks` [heads]; RoPE rotates each head's
  two halves, as the release does, so nothing is permuted on conversion.
- `feed_forward.router.gate` a Linear with bias (the release's `mlp.router`); the shared
  MoE's balancing bias (a buffer) joins the choice only, as in every family.
- `feed_forward.experts.w1, w3` [E, hidden, dim] (gate and up), `w2` [E, dim, hidden] and
  their biases `b1, b3` [E, hidden], `b2` [E, dim]: the release's `gate_up_proj` interleaves
  gate and up columns (hf.py splits them), so expert parallelism and tensor parallelism
  split our tensors as they split every family's experts (all six Shard(0) over ep).

The experts' activation is the clamped SwiGLU: gate clamped above at `limit`, up to
[-limit, limit], (up + 1) x gate x sigmoid(alpha x gate).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.args import ModelArgs
from trainer.models.common import logits
from trainer.models.common.attention import document_positions
from trainer.models.common.decoder import Head, Transformer, _fill, _init_std
from trainer.models.common.layers import RMSNorm
from trainer.models.common.logits import scale_rows_
from trainer.models.common.moe import GROUPED_MM, MoE, Router
from trainer.models.gpt_oss import kernels


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each head's two halves of x [b, s, h, d] (the release's RoPE); cos/sin [s, d/2]
    or [b, s, d/2]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).type_as(x)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def _scale_entries_(param: torch.Tensor, scale: torch.Tensor) -> None:
    """param[r] *= scale[r] on this rank's shard of a (possibly sharded) vector."""
    full = scale.to(torch.float32)
    if hasattr(param, "to_local"):
        from torch.distributed.tensor import distribute_tensor

        full = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    local = _local(param)
    local.mul_(full.to(device=local.device, dtype=local.dtype))


class SinkAttention(nn.Module):
    """GQA with q/k/v/o biases and a learned sink logit per head; `window` > 0: each token
    attends to itself and the window - 1 tokens before it."""

    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.window = args.hybrid.window(layer_id)
        q, kv = args.n_heads * self.head_dim, args.n_kv_heads * self.head_dim
        self.wq = nn.Linear(args.dim, q, bias=True)
        self.wk = nn.Linear(args.dim, kv, bias=True)
        self.wv = nn.Linear(args.dim, kv, bias=True)
        self.wo = nn.Linear(q, args.dim, bias=True)
        self.sinks = nn.Parameter(torch.empty(args.n_heads))
        self.logit_max: torch.Tensor | None = None  # QK-clip's per-head maxima

    def query_weight(self) -> torch.Tensor:
        return self.wq.weight

    def clip_logits_(self, gamma: torch.Tensor) -> None:
        """QK-clip: a head's logits x gamma, its query rows and their biases x gamma (a key
        head serves several query heads), as the plain decoder's GQA does."""
        rows = gamma.repeat_interleave(self.head_dim)
        scale_rows_(self.wq.weight, rows)
        _scale_entries_(self.wq.bias, rows)

    def forward(self, x, cos, sin, mask=None):
        """`mask`: this microbatch's kernels.Masks, or context parallelism's attention."""
        b, s, _ = x.shape
        q = rope_halves(self.wq(x).view(b, s, -1, self.head_dim), cos, sin)
        k = rope_halves(self.wk(x).view(b, s, -1, self.head_dim), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if hasattr(mask, "attend"):  # context parallel: every rank's keys and values
            k, v = mask.gather(k), mask.gather(v)
            allowed = kernels.cp_allowed(mask, self.window)
        else:
            allowed = mask.for_window(self.window)
        if self.logit_max is not None and self.training:
            seen = kernels.allowed_pairs(allowed)
            logits.record(self.logit_max, logits.max_logits(q, k, seen, causal=seen is None))
        out = kernels.attend(q, k, v, _local(self.sinks), allowed)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class BiasedRouter(Router):
    """The router with a bias (the release's `mlp.router`): softmax over the chosen experts'
    logits (= the softmax over all renormalised over the top k), in fp32."""

    def __init__(self, dim: int, moe):
        super().__init__(dim, moe)
        self.gate = nn.Linear(dim, moe.n_experts, bias=True)

    def forward(self, x: torch.Tensor):
        logits_ = F.linear(x.float(), self.gate.weight.float(), self.gate.bias.float())
        probs = logits_.softmax(-1)
        with torch.no_grad():
            chosen = (probs + self.expert_bias).topk(self.moe.top_k, dim=-1).indices
        weights = logits_.gather(-1, chosen).softmax(-1)
        return weights, chosen, probs, logits_


class BiasedExperts(nn.Module):
    """E experts with biases and the clamped SwiGLU (see the module docstring), as stacked
    weights; forward(x [N, dim] sorted by expert, counts [E]) as GroupedExperts'."""

    def __init__(self, dim: int, hidden: int, n_experts: int, alpha: float, limit: float):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.b1 = nn.Parameter(torch.empty(n_experts, hidden))
        self.b2 = nn.Parameter(torch.empty(n_experts, dim))
        self.b3 = nn.Parameter(torch.empty(n_experts, hidden))
        self.alpha, self.limit = alpha, limit
        self.grouped = GROUPED_MM

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return ClampedSwiGLU.apply(gate, up, self.alpha, self.limit)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        w1, w2, w3, b1, b2, b3 = (
            _local(t) for t in (self.w1, self.w2, self.w3, self.b1, self.b2, self.b3)
        )
        offs = counts.cumsum(0)
        # each row's expert, without reading the counts on the host (rows past the counted
        # ones, a capacity's padding, get the last expert; the caller masks them out)
        expert = torch.searchsorted(offs, torch.arange(x.shape[0], device=x.device), right=True)
        expert = expert.clamp(max=counts.numel() - 1)
        if self.grouped:
            offs = offs.to(torch.int32)

            def mm(a, w):
                return torch._grouped_mm(a, w.transpose(-2, -1), offs=offs)

        else:

            def mm(a, w):
                return _per_expert(a, w, counts)

        h = self.activation(mm(x, w1) + b1[expert], mm(x, w3) + b3[expert])
        return mm(h, w2) + b2[expert]


class ClampedSwiGLU(torch.autograd.Function):
    """(clamp(up, -limit, limit) + 1) x g x sigmoid(alpha g), g = clamp(gate, max=limit),
    saving only its two inputs and recomputing the rest in backward: two hidden-wide tensors
    a routed row instead of the seven autograd would keep (the clamps' inputs and outputs,
    the sigmoid, the gated product, up + 1). The backward runs in fp32 (or wider) over
    blocks of CHUNK values, so its temporaries stay small."""

    CHUNK = 2**24  # values per block of the backward (64 MiB of fp32 per temporary)

    @staticmethod
    def forward(ctx, gate, up, alpha: float, limit: float):
        ctx.save_for_backward(gate, up)
        ctx.alpha, ctx.limit = alpha, limit
        g = gate.clamp(max=limit)
        return (up.clamp(min=-limit, max=limit) + 1) * g * torch.sigmoid(g * alpha)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        d_gate, d_up = torch.empty_like(gate), torch.empty_like(up)
        rows = max(1, ClampedSwiGLU.CHUNK // max(gate.shape[-1], 1))
        for start in range(0, gate.shape[0], rows):
            part = slice(start, start + rows)
            d_gate[part], d_up[part] = _swiglu_grads(
                gate[part], up[part], grad[part], ctx.alpha, ctx.limit
            )
        return d_gate, d_up, None, None


def _swiglu_grads(gate, up, grad, alpha: float, limit: float):
    """The clamped SwiGLU's input gradients of one block of rows."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    g, u, dy = gate.to(wide).clamp(max=limit), up.to(wide), grad.to(wide)
    s = torch.sigmoid(g * alpha)
    d_up = dy * g * s * ((u >= -limit) & (u <= limit))
    d_gate = dy * (u.clamp(min=-limit, max=limit) + 1) * s * (1 + alpha * g * (1 - s))
    return (d_gate * (gate <= limit)).to(gate.dtype), d_up.to(up.dtype)


def _per_expert(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x's rows through their experts' w [E, out, in] where the build lacks grouped GEMMs."""
    sizes = counts.tolist()
    counted = sum(sizes)
    outs = [xe @ we.t() for xe, we in zip(x[:counted].split(sizes), w.unbind(0), strict=True)]
    if x.shape[0] > counted:
        outs.append(x.new_zeros(x.shape[0] - counted, w.shape[1]))
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


class GptOssMoE(MoE):
    """The shared MoE (routing, dispatch, statistics, aux losses) with gpt-oss's router and
    experts."""

    def __init__(self, dim: int, args: ModelArgs, layer_id: int):
        super().__init__(dim, args.moe, layer_id)
        h = args.hybrid
        self.router = BiasedRouter(dim, args.moe)
        self.experts = BiasedExperts(
            dim, args.moe.hidden_dim, args.moe.n_experts, h.swiglu_alpha, h.swiglu_limit
        )


class GptOssBlock(nn.Module):
    """Pre-norm attention with sinks and the MoE (the plain decoder's block's names)."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = SinkAttention(args, layer_id)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = GptOssMoE(args.dim, args, layer_id)

    def forward(self, x, cos, sin, mask=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class GptOss(Transformer):
    """The model: Transformer's embedding, head, RoPE tables and forward, with gpt-oss's
    blocks, its masks (one kernels.Masks per microbatch) and its init."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not Transformer's: its blocks are the plain decoder's
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): GptOssBlock(i, args) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = (
            None if args.tie_word_embeddings else Head(args.dim, args.vocab_size, bias=False)
        )
        self.mtp = None  # gpt-oss has no MTP modules (GptOssLayers.validate)
        self.mtp_loss_weight = 0.0
        table = (args.max_seq_len, args.rope_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table), persistent=False)

    def attention_inputs(self, seq: int, doc_ids, positions, dtype):
        """(cos, sin, the microbatch's kernels.Masks): built once per microbatch."""
        a = self.args
        if doc_ids is None and self.uses_documents:
            raise ValueError(
                f"attn_mask_type {a.attn_mask_type!r} with positions {a.positions!r} needs "
                "doc_ids (the loader's document_ids)"
            )
        if positions is None and a.positions == "document":
            positions = document_positions(doc_ids)
        if positions is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        documents = doc_ids if a.attn_mask_type == "block_causal" else None
        return cos, sin, kernels.Masks(seq, documents, self.rope_cos.device)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic and sharding-independent, as Transformer's: biases and sinks at
        zero, the rest as the plain decoder's."""
        self.init_rope()
        for name, param in self.named_parameters():
            bias = name.endswith((".bias", "sinks")) or name.split(".")[-1] in ("b1", "b2", "b3")
            if bias:
                (param.to_local() if hasattr(param, "to_local") else param).zero_()
            else:
                _fill(param, name, seed, _init_std(name, self.args))
        for module in self.modules():
            if isinstance(module, MoE):
                for buf in module.buffers():
                    buf.zero_()
