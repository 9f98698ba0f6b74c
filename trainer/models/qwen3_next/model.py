"""Qwen3-Next and Qwen3.5's hybrid decoder: Gated DeltaNet layers (trainer/models/deltanet.py)
and gated softmax-attention layers in a fixed pattern (by default three linear layers, then one
full), zero-centred RMSNorms, and a MoE whose shared expert is gated by a sigmoid.

Computes what transformers 5.24's Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM compute
(tests/test_qwen3_next.py: logits within 1e-4). Our layout of the parameters:

- Separate projections where the releases fuse them (Qwen3-Next's in_proj_qkvz groups q, k, v,
  z per key head; Qwen3.5's in_proj_qkv concatenates): wq, wk, wv, wz, wb, wa and one
  convolution weight per stream (conv_q, conv_k, conv_v), so tensor parallelism shards heads
  (and their convolution channels) with plain row shards. trainer/hf/qwen3_next.py converts.
- The gated attention's wq keeps the release's rows: per head, head_dim query rows then
  head_dim gate rows (a row shard by heads keeps each head's gate with it).
- RoPE as the releases rotate it: the two halves of the first `rope_dim` channels of each head
  (partial_rotary_factor of head_dim), so q and k need no permutation on conversion.
- Zero-centred RMSNorm: weight w stored, 1 + w applied (initialised to zeros), as released;
  the DeltaNet's output norm is a plain RMSNorm (weight ones) gated by SiLU(z).

Documents: under block_causal the full-attention layers use the window's mask, and the DeltaNet
layers restart their state and convolution at every document (the same doc ids).

MTP (`model.mtp_layers`, trainer/models/common/mtp.py's design and loss, as for DeepSeek-V3): module
k's norms are zero-centred and its block is a gated full-attention layer with the MoE (the
release's `mtp.layers.0`: block n_layers + k, full attention whatever layer_types says).
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.args import ModelArgs  # noqa: F401
from trainer.models.common.attention import attend
from trainer.models.common.decoder import Head, Transformer, _init_std, trunc_normal
from trainer.models.common.layers import RMSNorm
from trainer.models.common.logits import clip_normed_
from trainer.models.common.moe import FeedForward, MoE
from trainer.models.common.mtp import MTPModule
from trainer.models.qwen3_next.args import FULL, LINEAR, HybridArgs  # noqa: F401
from trainer.models.qwen3_next.deltanet import gated_delta_rule, short_conv


class ZeroCentredRMSNorm(RMSNorm):
    """RMSNorm whose weight w scales by 1 + w (in fp32, then cast: transformers' order)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)

    @torch.no_grad()
    def scale_(self, factor: torch.Tensor) -> None:
        """Multiply the output by `factor`: 1 + w becomes factor x (1 + w)."""
        local = self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight
        f = factor.to(device=local.device, dtype=torch.float32)
        local.copy_((local.float() * f + (f - 1.0)).to(local.dtype))


class GatedRMSNorm(RMSNorm):
    """RMSNorm(x) x weight x SiLU(z) per head (the DeltaNet's output norm)."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)
        return (self.weight * normed * F.silu(z.float())).to(x.dtype)


def rope_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 cos.shape[-1] channels of x [b, s, h, d] as two halves (transformers'
    rotate_half); the rest pass. cos/sin [s, r/2] or [b, s, r/2]."""
    half = cos.shape[-1]
    xf = x.float()
    x1, x2, rest = xf[..., :half], xf[..., half : 2 * half], xf[..., 2 * half :]
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1).type_as(x)


class GatedAttention(nn.Module):
    """GQA with q/k norms, partial RoPE and a sigmoid output gate per channel."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        d, self.head_dim = args.dim, args.head_dim
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_kv_heads
        self.wq = nn.Linear(d, args.n_heads * 2 * self.head_dim, bias=False)  # query, gate
        self.wk = nn.Linear(d, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(d, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, d, bias=False)
        self.q_norm = ZeroCentredRMSNorm(self.head_dim, args.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.head_dim, args.norm_eps)
        self.logit_max: torch.Tensor | None = None  # QK-clip's per-head maxima (optim/qk_clip.py)

    def query_weight(self) -> torch.Tensor:
        """The weight whose rows are the query heads (and their gates)."""
        return self.wq.weight

    def clip_logits_(self, gamma: torch.Tensor) -> None:
        """QK-clip: the q/k norms take it, the layer as one (trainer/models/common/logits.py)."""
        clip_normed_(self.q_norm, self.k_norm, gamma)

    def forward(self, x, cos, sin, mask=None):
        b, s, _ = x.shape
        q, gate = self.wq(x).view(b, s, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = rope_halves(self.q_norm(q), cos, sin)
        k = rope_halves(self.k_norm(self.wk(x).view(b, s, -1, self.head_dim)), cos, sin)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        maxima = self.logit_max if self.training else None  # evaluation does not feed the clip
        out = attend(q, k, v, mask, logit_max=maxima).transpose(1, 2).reshape(b, s, -1)
        return self.wo(out * torch.sigmoid(gate.reshape(b, s, -1)))


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet layer: q, k, v through a short causal convolution and SiLU, the decay
    g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b), the gated delta rule over
    L2-normalised q, k, a gated RMSNorm with z, the output projection."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        h, d = args.hybrid, args.dim
        self.k_head_dim, self.v_head_dim = h.linear_k_head_dim, h.linear_v_head_dim
        keys = h.linear_k_heads * h.linear_k_head_dim
        values = h.linear_v_heads * h.linear_v_head_dim
        self.wq = nn.Linear(d, keys, bias=False)
        self.wk = nn.Linear(d, keys, bias=False)
        self.wv = nn.Linear(d, values, bias=False)
        self.wz = nn.Linear(d, values, bias=False)  # the output gate
        self.wb = nn.Linear(d, h.linear_v_heads, bias=False)  # beta, per value head
        self.wa = nn.Linear(d, h.linear_v_heads, bias=False)  # the decay's input
        self.conv_q = nn.Parameter(torch.empty(keys, h.conv_kernel))
        self.conv_k = nn.Parameter(torch.empty(keys, h.conv_kernel))
        self.conv_v = nn.Parameter(torch.empty(values, h.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(h.linear_v_heads))
        self.dt_bias = nn.Parameter(torch.empty(h.linear_v_heads))
        self.norm = GatedRMSNorm(h.linear_v_head_dim, args.norm_eps)
        self.wo = nn.Linear(values, d, bias=False)

    def forward(
        self, x: torch.Tensor, doc_ids: torch.Tensor | None = None, *, split=None
    ) -> torch.Tensor:
        """`split`: context parallelism's attention (x: this rank's pieces; `SplitDeltaNet`).
        Through this forward either way, so that tensor parallelism's input hook (the
        sequence shards gathered: trainer/parallel/tp.py) applies under TP x CP too."""
        if split is not None:
            return SplitDeltaNet(self, split)(x, doc_ids)
        return self.mix(x, doc_ids)[0]

    def mix(self, x, doc_ids=None, state=None):
        """(output, the state after the window). `state`: None, or (the convolutions' prefixes
        (q, k, v), the recurrent state) of the window before, whose last document continues
        into this window's first (trainer/models/deltanet.py)."""
        b, s, _ = x.shape
        prefixes, recurrent = (None, None, None), None
        if state is not None:
            prefixes, recurrent = state
        streams, tails = [], []
        for proj, weight, prefix in zip(
            (self.wq, self.wk, self.wv),
            (self.conv_q, self.conv_k, self.conv_v),
            prefixes,
            strict=True,
        ):
            y, tail = short_conv(proj(x), _local(weight), doc_ids, prefix)
            streams.append(F.silu(y))
            tails.append(tail)
        q = streams[0].view(b, s, -1, self.k_head_dim)
        k = streams[1].view(b, s, -1, self.k_head_dim)
        v = streams[2].view(b, s, -1, self.v_head_dim)
        beta = self.wb(x).sigmoid()
        a_log, dt_bias = _local(self.A_log), _local(self.dt_bias)
        g = -a_log.float().exp() * F.softplus(self.wa(x).float() + dt_bias)
        o, last = gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            initial_state=recurrent,
            output_final_state=state is not None,
            doc_ids=doc_ids,
        )
        z = self.wz(x).view(b, s, -1, self.v_head_dim)
        out = self.wo(self.norm(o, z).reshape(b, s, -1))
        return out, (tuple(tails), last)


class SplitDeltaNet:
    """A Gated DeltaNet layer under context parallelism, exact, each cp rank computing only its
    tokens: its two pieces of the sequence (chunks r and 2cp - 1 - r of 2cp, `split`:
    trainer/parallel/context_parallel.ContextAttention).

    (1) Each piece's state transition: the value columns of the delta rule evolve apart, so a
    piece run from the entering state [0 | I] with zero values beside its own gives its end
    state [S0 | A], S_end = A S_in + S0 for any entering S_in. (2) These gathered over cp and
    composed in sequence order (zeroed where a document starts at a piece) give each piece's
    entering state. (3) Each piece again from its entering state. The convolution reads the
    K - 1 inputs before each piece from the rank that holds them."""

    def __init__(self, layer: "GatedDeltaNet", split):
        self.layer, self.split = layer, split

    def __call__(self, x: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
        layer, (b, n, dim) = self.layer, x.shape
        size, taps = n // 2, layer.conv_q.shape[-1]
        chunks = sum(self.split.own_chunks()) + 1  # r + (2cp - 1 - r) + 1
        docs = (
            doc_ids
            if doc_ids is not None
            else torch.zeros(  # causal: one document
                b, chunks * size, dtype=torch.long, device=x.device
            )
        )
        pieces = x.view(b, 2, size, dim)
        before = self.split.gather_chunks(pieces[:, :, size - (taps - 1) :])
        inputs = [
            self.inputs(pieces[:, p], c, before, docs, size)
            for p, c in enumerate(self.split.own_chunks())
        ]
        entering = self.entering(inputs, docs, size)
        outs = [
            gated_delta_rule(*streams, initial_state=entering[p], doc_ids=piece_docs)[0]
            for p, (streams, piece_docs) in enumerate(inputs)
        ]
        z = layer.wz(x).view(b, n, -1, layer.v_head_dim)
        return layer.wo(layer.norm(torch.cat(outs, dim=1), z).reshape(b, n, -1))

    def inputs(self, x, chunk: int, before, docs, size):
        """((q, k, v, g, beta), the piece's document ids) of the piece `x`, sequence chunk
        `chunk`, its convolution fed the K - 1 inputs before it."""
        layer, taps = self.layer, self.layer.conv_q.shape[-1]
        lo = chunk * size
        if chunk:
            prefix, prefix_docs = before[:, chunk - 1], docs[:, lo - (taps - 1) : lo]
        else:
            prefix, prefix_docs = torch.zeros_like(before[:, 0]), docs[:, :1].expand(-1, taps - 1)
        ext = torch.cat((prefix, x), dim=1)
        ext_docs = torch.cat((prefix_docs, docs[:, lo : lo + size]), dim=1)
        b = x.shape[0]
        streams = [
            F.silu(short_conv(proj(ext), _local(w), ext_docs)[0][:, taps - 1 :])
            for proj, w in (
                (layer.wq, layer.conv_q),
                (layer.wk, layer.conv_k),
                (layer.wv, layer.conv_v),
            )
        ]
        q = streams[0].view(b, size, -1, layer.k_head_dim)
        k = streams[1].view(b, size, -1, layer.k_head_dim)
        v = streams[2].view(b, size, -1, layer.v_head_dim)
        a_log, dt_bias = _local(layer.A_log), _local(layer.dt_bias)
        g = -a_log.float().exp() * F.softplus(layer.wa(x).float() + dt_bias)
        return (q, k, v, g, layer.wb(x).sigmoid()), docs[:, lo : lo + size]

    def entering(self, inputs, docs, size) -> list[torch.Tensor]:
        """The state entering each of this rank's pieces."""
        ends = []
        for (q, k, v, g, beta), piece_docs in inputs:
            b, _, hv, dv = v.shape
            dk = k.shape[-1]
            eye = torch.eye(dk, device=v.device).expand(b, hv, dk, dk)
            start = torch.cat((eye.new_zeros(b, hv, dk, dv), eye), dim=-1)
            wide = torch.cat((v, v.new_zeros(*v.shape[:-1], dk)), dim=-1)
            ends.append(
                gated_delta_rule(
                    q,
                    k,
                    wide,
                    g,
                    beta,
                    initial_state=start,
                    output_final_state=True,
                    doc_ids=piece_docs,
                )[1]
            )
        every = self.split.gather_chunks(torch.stack(ends, dim=1))  # [b, 2cp, hv, dk, dv + dk]
        mine = self.split.own_chunks()
        state, out = torch.zeros_like(every[:, 0, ..., :dv]), {}
        for c in range(max(mine) + 1):
            if c:  # a document starting at the piece starts from zero
                same = (docs[:, c * size] == docs[:, c * size - 1]).float()
                state = state * same[:, None, None, None]
            out[c] = state
            state = every[:, c, ..., dv:] @ state + every[:, c, ..., :dv]
        return [out[c] for c in mine]


def _local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's rows on this rank: under tensor parallelism the convolutions, A_log and
    dt_bias are Shard(0) DTensors over tp (each rank's heads; trainer/parallel/tp.py)."""
    return param.to_local() if isinstance(param, DTensor) else param


class GatedSharedMoE(MoE):
    """The routed experts of trainer/models/common/moe.py (softmax top-k, renormalised: Qwen's
    routing) plus one shared expert scaled per token by sigmoid(shared_expert_gate(x))."""

    def __init__(self, dim: int, args: ModelArgs, layer_id: int):
        super().__init__(dim, args.moe, layer_id)
        self.shared_expert = FeedForward(dim, args.hybrid.shared_expert_hidden)
        self.shared_expert_gate = nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class HybridBlock(nn.Module):
    """A decoder layer: a Gated DeltaNet (`linear_attention`) or gated attention (`attention`),
    then a MoE or SwiGLU feed-forward, each after a zero-centred RMSNorm, with residuals."""

    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.layer_id = layer_id
        self.layer_type = args.hybrid_layer_type(layer_id)  # an MTP block: full attention
        self.attention_norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        if self.layer_type == FULL:
            self.attention = GatedAttention(args)
        else:
            self.linear_attention = GatedDeltaNet(args)
        self.ffn_norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        if not args.is_moe_layer(layer_id):
            self.feed_forward = FeedForward(args.dim, args.hidden_dim)
        elif args.hybrid.shared_expert_hidden:
            self.feed_forward = GatedSharedMoE(args.dim, args, layer_id)
        else:
            self.feed_forward = MoE(args.dim, args.moe, layer_id)

    def forward(self, x, cos, sin, mask=None, doc_ids=None):
        """`doc_ids`: the window's documents under block_causal (the DeltaNet restarts at
        each), else None. Under context parallelism (`mask` is its attention, x this rank's
        tokens) the DeltaNet passes its state between the ranks (`SplitDeltaNet`)."""
        h = self.attention_norm(x)
        if self.layer_type == FULL:
            h = self.attention(h, cos, sin, mask)
        elif hasattr(mask, "attend"):  # context parallelism's attention: its pieces
            h = self.linear_attention(h, doc_ids, split=mask)
        else:
            h = self.linear_attention(h, doc_ids)
        h = x + h
        return h + self.feed_forward(self.ffn_norm(h))


class Qwen3Next(Transformer):
    """The hybrid model. Transformer's head (untied or tied), RoPE tables (of rope_dim
    channels), documents and masks; its own blocks, forward and init."""

    def __init__(self, args: ModelArgs):
        nn.Module.__init__(self)  # not Transformer's: its blocks are Llama's
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): HybridBlock(i, args) for i in range(args.n_layers)})
        self.norm = ZeroCentredRMSNorm(args.dim, args.norm_eps)
        self.output = (
            None if args.tie_word_embeddings else Head(args.dim, args.vocab_size, bias=False)
        )
        # Multi-token prediction: Transformer's loss (mtp_loss), the release's module shape
        self.mtp = (
            nn.ModuleDict(
                {
                    str(k): MTPModule(
                        args.dim,
                        args.norm_eps,
                        HybridBlock(args.n_layers + k, args),
                        norm=ZeroCentredRMSNorm,
                    )
                    for k in range(args.mtp_layers)
                }
            )
            if args.mtp_layers
            else None
        )
        self.mtp_loss_weight = args.mtp_loss_weight  # TrainStep sets it per step if scheduled
        table = (args.max_seq_len, args.rope_dim // 2)
        self.register_buffer("rope_cos", torch.empty(table), persistent=False)
        self.register_buffer("rope_sin", torch.empty(table), persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: torch.Tensor | None = None,
        loss_fn=None,
        *,
        doc_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        attention=None,
        future=None,
    ) -> torch.Tensor:
        """Logits, or with labels and a loss the summed token loss (Transformer.forward's
        contract, the MTP loss added in training; under context parallelism `attention` is
        its attention and `doc_ids` the whole samples' documents)."""
        h = self.tok_embeddings(tokens)
        if attention is not None:
            cos, sin, mask = self.rope_cos[positions], self.rope_sin[positions], attention
        else:
            cos, sin, mask = self.attention_inputs(tokens.shape[1], doc_ids, positions, h.dtype)
        docs = self.linear_documents(doc_ids)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask, docs)
        h = self.norm(h)  # the MTP module takes the normed state, as the release's servers do
        main = self.head(h, labels, loss_fn)
        if not self.trains_mtp(labels, loss_fn):
            return main
        return main + self.mtp_loss(h, labels, loss_fn.for_mtp(), (cos, sin, mask), future)

    def linear_documents(self, doc_ids):
        """The document ids the DeltaNet layers restart at (block_causal), else None."""
        return doc_ids if self.args.attn_mask_type == "block_causal" else None

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic and sharding-independent, as Transformer's: zero-centred norms at 0,
        the gated norm at 1, A = exp(A_log) uniform in [0.01, 16], dt_bias 1 (transformers'),
        convolutions as torch's Conv1d default (std (3 K)^-1/2), the rest by _init_std."""
        self.init_rope()
        k = self.args.hybrid.conv_kernel
        for name, param in self.named_parameters():
            if name.endswith("linear_attention.norm.weight") or name.endswith("dt_bias"):
                _fill(param, name, seed, lambda t, gen: t.fill_(1.0))
            elif name.endswith("norm.weight"):
                _fill(param, name, seed, lambda t, gen: t.zero_())
            elif name.endswith("A_log"):
                _fill(
                    param, name, seed, lambda t, gen: t.uniform_(0.01, 16.0, generator=gen).log_()
                )
            else:
                std = (3 * k) ** -0.5 if ".conv_" in name else _init_std(name, self.args)
                _fill(param, name, seed, lambda t, gen, std=std: trunc_normal(t, std, gen))
        for module in self.modules():
            if isinstance(module, MoE):
                for buf in module.buffers():
                    buf.zero_()


def _fill(param: torch.Tensor, name: str, seed: int, draw) -> None:
    """Fill the full tensor by `draw(tensor, generator seeded by (seed, name))`, then keep
    this rank's shard (llama._fill's scheme, for any draw)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    is_dt = isinstance(param, DTensor)
    where = param.device_mesh.device_type if is_dt else param.device
    full = torch.empty(param.shape, dtype=param.dtype, device=where)
    gen = torch.Generator(device=where)
    gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    draw(full, gen)
    if is_dt:
        full = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    (param.to_local() if is_dt else param).copy_(full)
