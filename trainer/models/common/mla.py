"""Multi-head latent attention (DeepSeek-V2/V3; `ModelArgs.mla`), in place of GQA.

Per token, the keys and values of every head come from one compressed latent of
`kv_lora_rank` channels (`wkv_a`, then `kv_a_norm`, then `wkv_b` up to each head's
`qk_nope_head_dim` key and `v_head_dim` value channels), and one RoPE key of
`qk_rope_head_dim` channels that every head shares (the rest of `wkv_a`'s output). Queries go
through their own low-rank path (`wq_a`, `q_a_norm`, `wq_b`), or one projection `wq` with
`q_lora_rank = 0`, and each head's last `qk_rope_head_dim` channels are rotated. A head's
query/key width (nope + rope: 192 at full size) differs from its value width (128): the
softmax scale is 1 / sqrt(query/key width), SDPA's default for these shapes, times YaRN's
mscale^2 where the RoPE is YaRN-scaled (DeepSeek-V3 and Kimi K2 as released: 1.874 and
1.813), applied to the queries. Which kernel takes such heads: on CUDA cuDNN or the
memory-efficient one (flash needs equal widths; the startup summary names the one that
runs), and FlexAttention for block_causal; on the CPU the values are zero-padded to the
query width for the flash kernel and the padding sliced off (exact: trainer/models/
attention.py).

The rotation is the same as the Llama blocks' (consecutive channel pairs), which is the
layout DeepSeek released its weights in (`rope_interleave = true` in Hugging Face's config):
the Hugging Face mapping permutes nothing here (trainer/models/deepseek_v3/hf.py).

Tensor parallelism (trainer/parallel/tp.py) splits the heads: `wq`/`wq_b`, `wkv_b` colwise and
`wo` rowwise; the down projections and their norms (`wq_a`, `q_a_norm`, `wkv_a`,
`kv_a_norm`) are replicated on every tp rank, as torchtitan and Megatron-core do. The
shared RoPE key feeds only this rank's heads, so its gradient is summed over tp
(`shared_key`, set by the TP plan).
"""

from __future__ import annotations

import torch
from torch import nn

from trainer.models.args import ModelArgs
from trainer.models.common.attention import attend
from trainer.models.common.layers import RMSNorm, apply_rope
from trainer.models.common.logits import scale_rows_

# The latent norms' epsilon, whatever model.norm_eps: DeepSeek's reference code and
# transformers' DeepseekV3Attention fix q_a_layernorm's and kv_a_layernorm's at 1e-6.
LATENT_NORM_EPS = 1e-6


class MLA(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        m = args.mla
        self.n_heads, self.n_kv_heads = args.n_heads, args.n_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        self.head_dim = m.qk_head_dim
        if m.q_lora_rank:
            self.wq = None
            self.wq_a = nn.Linear(args.dim, m.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.wq_b = nn.Linear(m.q_lora_rank, args.n_heads * self.head_dim, bias=False)
        else:
            self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wkv_a = nn.Linear(args.dim, m.kv_lora_rank + self.rope, bias=False)
        self.kv_a_norm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(m.kv_lora_rank, args.n_heads * (self.nope + self.v_dim), bias=False)
        self.wo = nn.Linear(args.n_heads * self.v_dim, args.dim, bias=False)
        # Identity; under TP the RoPE key's gradient summed over the tp ranks (see above)
        self.shared_key = _identity
        self.logit_max: torch.Tensor | None = None  # QK-clip's per-head maxima (optim/qk_clip.py)
        yarn = args.rope_scaling if hasattr(args.rope_scaling, "softmax_gain") else None
        self.softmax_gain = yarn.softmax_gain if yarn is not None else 1.0

    def query_weight(self) -> torch.Tensor:
        """The weight whose rows are the query heads (QK-clip finds this rank's heads by it)."""
        return self.wq.weight if self.wq is not None else self.wq_b.weight

    def clip_logits_(self, gamma: torch.Tensor) -> None:
        """QK-clip (trainer/optim/qk_clip.py; Kimi K2, section 2.1): each head's query rows
        and its own key rows (`wkv_b`'s key part, not shared) x sqrt(gamma), its rotary query
        rows x gamma; the rotary key, which every head shares, and the values untouched.
        `gamma`: [heads], 1 where not clipped (every head: the sharded weights' global rows)."""
        root = gamma.sqrt().unsqueeze(1)
        q_rows = torch.cat(
            [root.expand(-1, self.nope), gamma.unsqueeze(1).expand(-1, self.rope)], 1
        )
        kv_rows = torch.cat(
            [root.expand(-1, self.nope), torch.ones_like(root).expand(-1, self.v_dim)], 1
        )
        scale_rows_(self.query_weight(), q_rows.reshape(-1))
        scale_rows_(self.wkv_b.weight, kv_rows.reshape(-1))

    def project(self, x: torch.Tensor, cos, sin):
        """(q [b, s, heads, qk], k [b, s, heads, qk], v [b, s, heads, v]) after RoPE; under
        TP this rank's heads."""
        q, latent = self.latents(x, cos, sin)
        return (q, *self.expand(latent))

    def latents(self, x: torch.Tensor, cos, sin):
        """(q after RoPE, the keys' and values' latent [b, s, kv_lora_rank + rope]: the
        normed compressed latent and the rotated shared key of each token)."""
        b, s, _ = x.shape
        q = self.wq(x) if self.wq is not None else self.wq_b(self.q_a_norm(self.wq_a(x)))
        q_nope, q_rope = q.view(b, s, -1, self.head_dim).split([self.nope, self.rope], -1)
        latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.rope], -1)
        k_rope = apply_rope(self.shared_key(k_rope).unsqueeze(2), cos, sin).squeeze(2)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)
        if self.softmax_gain != 1.0:  # YaRN's mscale^2 on the logits, through the queries
            q = q * self.softmax_gain
        return q, torch.cat([self.kv_a_norm(latent), k_rope], -1)

    def expand(self, latent: torch.Tensor):
        """Each head's k [b, s, heads, qk] and v [b, s, heads, v] from the latents."""
        b, s, _ = latent.shape
        latent, k_rope = latent.split([self.kv_lora_rank, self.rope], -1)
        kv = self.wkv_b(latent).view(b, s, -1, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], -1)
        k = torch.cat([k_nope, k_rope.unsqueeze(2).expand(-1, -1, k_nope.shape[2], -1)], -1)
        return k, v

    def forward(self, x, cos, sin, mask=None):
        """As trainer.models.common.decoder.Attention: `mask` None = causal, else the microbatch's
        block-causal mask or context parallelism's attention. Under context parallelism the
        ranks all-gather the latents (kv_lora_rank + rope channels per token: 576 at full
        size), not every head's keys and values (128 x (192 + 128) = 40,960): each rank
        expands the whole sequence's latents itself."""
        b, s, _ = x.shape
        q, latent = self.latents(x, cos, sin)
        gathered = hasattr(mask, "attend")  # context parallelism's attention
        if gathered:
            latent = mask.gather(latent)
        maxima = self.logit_max if self.training else None  # evaluation does not feed the clip
        out = attend(q, *self.expand(latent), mask, gathered, maxima)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t
