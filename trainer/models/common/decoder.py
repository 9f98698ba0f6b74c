"""A Llama-3-style decoder: RMSNorm, RoPE (optionally with Llama-3.1's scaling), grouped-query
attention, SwiGLU, an output head of its own or tied to the token embedding.

RoPE rotates consecutive (interleaved) pairs of each head's channels, as Meta's reference code
does; Hugging Face's Llama rotates the two halves instead, so the q/k projections are permuted
on conversion (trainer/hf.py).

Attention is causal over the window by default; with `attn_mask_type = "block_causal"` the forward
takes the microbatch's document ids, builds one mask (and, with `positions = "document"`,
per-document RoPE tables) before the first block, and every block uses it
(trainer/models/common/attention.py). A single document (generation, the HF export) computes the
same either way.

The model is built on the meta device and materialised after sharding. `init_weights(seed)`
fills every parameter as if the whole tensor were generated on one process from a generator
seeded by (seed, parameter name), then keeps the local shard: runs on 1 and N ranks, FSDP or
HSDP, start from the same weights.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.models.args import ModelArgs
from trainer.models.common.attention import attend, build_mask, document_positions
from trainer.models.common.layers import RMSNorm, apply_rope, rope_tables, scale_frequencies  # noqa: F401
from trainer.models.common.logits import clip_normed_, scale_rows_
from trainer.models.common.moe import FeedForward, MoE  # noqa: F401  (FeedForward re-exported)
from trainer.models.common.mtp import MTPModule, future_labels, mtp_streams
from trainer.parallel.loss_parallel import vocab_parallel_project


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        # Qwen3: RMSNorm over each head's q and k before RoPE
        self.q_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, args.norm_eps) if args.qk_norm else None
        self.logit_max: torch.Tensor | None = None  # QK-clip's per-head maxima (optim/qk_clip.py)

    def query_weight(self) -> torch.Tensor:
        """The weight whose rows are the query heads (QK-clip finds this rank's heads by it)."""
        return self.wq.weight

    def clip_logits_(self, gamma: torch.Tensor) -> None:
        """QK-clip (trainer/optim/qk_clip.py): scale the weights so that the same inputs give
        each head's largest logit x gamma [heads] (1 where not clipped; every head, also under TP:
        the sharded weights' global rows). With q/k norms
        the norms take it, the layer as one; with one key head per query head the query and
        key rows each x sqrt(gamma); under GQA (a key head serves several query heads) the
        query rows x gamma, the shared key head untouched."""
        if self.q_norm is not None:
            clip_normed_(self.q_norm, self.k_norm, gamma)
        elif self.n_kv_heads == self.n_heads:
            root = gamma.sqrt().repeat_interleave(self.head_dim)
            scale_rows_(self.wq.weight, root)
            scale_rows_(self.wk.weight, root)
        else:
            scale_rows_(self.wq.weight, gamma.repeat_interleave(self.head_dim))

    def project(self, x: torch.Tensor, cos, sin):
        """(q, k, v) [b, s, heads, head_dim] after the norms and RoPE."""
        b, s, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds n_heads / tp of them
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x, cos, sin, mask=None):
        """`mask`: None = causal; else the microbatch's block-causal mask
        (trainer/models/common/attention.py)."""
        b, s, _ = x.shape
        maxima = self.logit_max if self.training else None  # evaluation does not feed the clip
        out = attend(*self.project(x, cos, sin), mask, logit_max=maxima)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class TransformerBlock(nn.Module):
    """Pre-norm attention and feed-forward. `attention`: the attention layer's class, called
    with the args (GQA `Attention`, or a family's own: DeepSeek-V3's MLA)."""

    def __init__(self, layer_id: int, args: ModelArgs, attention: type[nn.Module] = Attention):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = attention(args)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = (
            MoE(args.dim, args.moe, layer_id)
            if args.is_moe_layer(layer_id)
            else FeedForward(args.dim, args.hidden_dim)
        )

    def forward(self, x, cos, sin, mask=None):
        h = x + self.attention(self.attention_norm(x), cos, sin, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Head(nn.Linear):
    """The output projection. Given labels and a loss (trainer.models.common.loss), it returns the
    summed token loss instead of the logits: the loss then runs inside this module's forward, where
    FSDP holds its unsharded weight, so the [tokens, vocab] logits need not leave the loss."""

    def forward(self, h: torch.Tensor, labels: torch.Tensor | None = None, loss_fn=None):
        return project(h, self.weight, labels, loss_fn)


def project(h: torch.Tensor, weight: torch.Tensor, labels=None, loss_fn=None) -> torch.Tensor:
    """The output projection by `weight` [vocab, dim]: logits, or with labels the summed token
    loss. A DTensor weight is vocab-sharded by tensor parallelism (trainer/parallel/tp.py)."""
    if isinstance(weight, DTensor):
        return vocab_parallel_project(h, weight, labels, loss_fn)
    return F.linear(h, weight) if labels is None else loss_fn(h, weight, labels)


class Transformer(nn.Module):
    # Sequence lengths a forward takes must be multiples of this (tensor parallelism's sequence
    # sharding sets it to the tp degree: trainer/parallel/tp.py).
    sequence_multiple = 1

    def __init__(self, args: ModelArgs, attention: type[nn.Module] = Attention):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, args, attention) for i in range(args.n_layers)}
        )
        self.norm = RMSNorm(args.dim, args.norm_eps)
        # Tied: no parameter of its own; the head multiplies by tok_embeddings.weight.
        self.output = (
            None if args.tie_word_embeddings else Head(args.dim, args.vocab_size, bias=False)
        )
        # Multi-token prediction (trainer/models/common/mtp.py): depth k's block is layer
        # n_layers + k
        self.mtp = (
            nn.ModuleDict(
                {
                    str(k): MTPModule(
                        args.dim,
                        args.norm_eps,
                        TransformerBlock(args.n_layers + k, args, attention),
                    )
                    for k in range(args.mtp_layers)
                }
            )
            if args.mtp_layers
            else None
        )
        # The MTP loss's weight: args.mtp_loss_weight, or the step's (TrainStep sets it per step
        # under model.mtp_loss_weight_until_step)
        self.mtp_loss_weight = args.mtp_loss_weight
        # Filled by init_rope (init_weights calls it) once the model has a real device.
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
        future: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [batch, seq, vocab]; or, with labels and a trainer.models.common.loss function,
        the summed token loss (fp32 scalar), computed without returning the logits.

        `doc_ids` [batch, seq]: the document of each token (the loader's `document_ids`),
        needed by block_causal attention and document positions, ignored otherwise.
        `positions` [batch, seq] or [seq]: explicit RoPE positions (default: per `args.positions`).
        `attention`: an object whose `attend(q, k, v)` every layer calls instead of masking
        itself (context parallelism: trainer/parallel/context_parallel.py); `positions` are
        then the tokens' global ones. With MTP modules, a training forward with labels adds
        their loss (`mtp_loss`); `future`: their targets, when not `labels` shifted."""
        h = self.tok_embeddings(tokens)
        if attention is not None:
            cos, sin, mask = self.rope_cos[positions], self.rope_sin[positions], attention
        else:
            cos, sin, mask = self.attention_inputs(tokens.shape[1], doc_ids, positions, h.dtype)
        for layer in self.layers.values():
            h = layer(h, cos, sin, mask)
        h = self.norm(h)  # the MTP modules take the normed state, as the releases' servers do
        main = self.head(h, labels, loss_fn)
        if not self.trains_mtp(labels, loss_fn):
            return main
        return main + self.mtp_loss(h, labels, loss_fn.for_mtp(), (cos, sin, mask), future)

    def trains_mtp(self, labels, loss_fn) -> bool:
        """Whether a forward adds the MTP loss: a training forward with labels and the
        training loss (validation, evals and generation use the main model alone)."""
        return (
            self.args.mtp_layers > 0
            and labels is not None
            and self.training
            and torch.is_grad_enabled()
            and hasattr(loss_fn, "for_mtp")
        )

    def head(self, h: torch.Tensor, labels=None, loss_fn=None) -> torch.Tensor:
        if self.output is not None:
            return self.output(h, labels, loss_fn)
        # Tied: the embedding is in the root's FSDP group, unsharded until the root's forward ends.
        return project(h, self.tok_embeddings.weight, labels, loss_fn)

    def mtp_loss(
        self, h, labels, loss_fn, attention_inputs, future=None, embeddings=None
    ) -> torch.Tensor:
        """The MTP loss weight x the mean over depths of their summed token losses (the MTP
        modules after the main model's last hidden state `h`; trainer/models/common/mtp.py).
        `future` [depth, b, s]: the targets past `labels` (default: `labels` shifted; context
        parallelism passes them, cut from the whole sequence). `embeddings`: each depth's
        input token embeddings, when the embedding is elsewhere (the first pipeline stage's)."""
        a = self.args
        streams = mtp_streams(
            labels, future_labels(labels, a.mtp_layers) if future is None else future
        )
        if embeddings is None:
            embeddings = [self.tok_embeddings(tokens) for tokens, _ in streams]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        for module, emb, (_, target) in zip(self.mtp.values(), embeddings, streams, strict=True):
            h = module(h, emb, *attention_inputs)
            total = total + self.head(module.norm(h), target, loss_fn)
        return total * (self.mtp_loss_weight / a.mtp_layers)

    def blocks(self) -> list[nn.Module]:
        """Every transformer block: the layers', then the MTP modules' (parallelisms, AC and
        compile wrap each)."""
        return list(self.layers.values()) + [m.block for m in (self.mtp or {}).values()]

    @property
    def uses_documents(self) -> bool:
        """Whether forward reads `doc_ids` (block_causal attention or document positions):
        callers skip computing them otherwise."""
        return self.args.attn_mask_type != "causal" or self.args.positions == "document"

    def attention_inputs(self, seq: int, doc_ids, positions, dtype):
        """(cos, sin, mask) for every layer of one forward: built once per microbatch."""
        a = self.args
        if doc_ids is None and self.uses_documents:
            raise ValueError(
                f"attn_mask_type {a.attn_mask_type!r} with positions "
                f"{a.positions!r} needs doc_ids (the loader's document_ids)"
            )
        if positions is None and a.positions == "document":
            positions = document_positions(doc_ids)
        if positions is None:
            cos, sin = self.rope_cos[:seq], self.rope_sin[:seq]
        else:
            cos, sin = self.rope_cos[positions], self.rope_sin[positions]
        mask = None
        if a.attn_mask_type == "block_causal":
            with torch.no_grad():
                mask = build_mask(doc_ids, a.attn_implementation, dtype)
        return cos, sin, mask

    @torch.no_grad()
    def init_rope(self) -> None:
        """Compute the RoPE tables (non-persistent buffers: needed after `to_empty`)."""
        a = self.args
        cos, sin = rope_tables(
            a.rope_dim,
            a.max_seq_len,
            a.rope_theta,
            device=self.rope_cos.device,
            scaling=a.rope_scaling,
        )
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic, sharding-independent init (see the module docstring)."""
        a = self.args
        self.init_rope()
        for name, param in self.named_parameters():
            _fill(param, name, seed, _init_std(name, a))
        for module in self.modules():  # balancing bias and load counters start at zero
            if isinstance(module, MoE):
                for buf in module.buffers():
                    buf.zero_()


def _init_std(name: str, args: ModelArgs) -> float | None:
    """Per-parameter init: None = ones (norms); otherwise a truncated normal's std."""
    if name.endswith("norm.weight"):
        return None
    if name.startswith("tok_embeddings"):  # tied, it is also the head: small, as HF inits it
        return 0.02 if args.tie_word_embeddings else 1.0
    if name.startswith("output"):
        return args.dim**-0.5
    if name.endswith(("wo.weight", "w2.weight", "w3.weight", "experts.w2", "experts.w3")):
        # depth-scaled residual outputs (an MTP block: after the last layer)
        layer_id = int(name.split(".")[1]) + (args.n_layers if name.startswith("mtp.") else 0)
        return 0.02 / math.sqrt(2 * (layer_id + 1))
    return 0.02


def trunc_normal(t: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    """N(0, std^2) truncated to +-3 std, by the inverse CDF: one uniform draw, erfinv, scale.

    torch 2.13's `nn.init.trunc_normal_` resamples the out-of-range values in a loop that draws
    a whole new tensor each round (8M values: 0.54 s against 0.09 s here, on one CPU thread),
    and its algorithm differs between torch versions; this one is a single pass whose values
    do not depend on torch's choice.
    """

    def cdf(x: float) -> float:  # the standard normal's, computed as torch <= 2.11 did
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    t.uniform_(2 * cdf(-3.0) - 1, 2 * cdf(3.0) - 1, generator=gen)
    return t.erfinv_().mul_(std * math.sqrt(2.0)).clamp_(min=-3 * std, max=3 * std)


def _fill(param: torch.Tensor, name: str, seed: int, std: float | None) -> None:
    """Fill the full logical tensor from (seed, name), then keep this rank's shard of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    is_dt = isinstance(param, DTensor)
    local = param.to_local() if is_dt else param
    # Drawn on the mesh's device: a CPU-offloaded shard on a CUDA mesh gets the same values
    # as a shard on the GPU (CPU and CUDA generators differ).
    where = param.device_mesh.device_type if is_dt else local.device
    full = torch.empty(param.shape, dtype=param.dtype, device=where)
    if std is None:
        full.fill_(1.0)
    else:
        gen = torch.Generator(device=where)
        gen.manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        trunc_normal(full, std, gen)
    if is_dt:
        full = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    local.copy_(full)
