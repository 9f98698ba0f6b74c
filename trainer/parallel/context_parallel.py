"""Context parallelism: each sequence split over the `cp` ranks of a dp rank, exact against one
rank, documents kept apart.

`parallelism.context_parallel_degree = cp` (the mesh's `cp` dimension, trainer/parallel/dims.py).
The cp ranks of a dp rank read the same samples; each keeps its share of every sequence:

- **Head-tail split.** A sequence is cut into 2 x cp chunks and rank r keeps chunks r and
  2cp-1-r, so under a causal mask every rank attends over the same number of (query, key)
  pairs (a contiguous split gives the last rank 2cp-1 times the first one's work:
  `attention_pairs`). Tokens, labels, positions and document ids are split alike.
- **Attention.** Each layer all-gathers K and V over cp (small under GQA), puts them back in
  sequence order and attends the rank's queries to the whole sequence with a mask built from
  global positions: key <= query (`causal`), and the same document (`block_causal`), so no
  token sees another document's tokens on any rank. The all-gather's backward reduce-scatters
  the K/V gradients in fp32 (`GatherSequence`); op-level AC saves the gathered K/V rather
  than gathering again in the recompute. Kernels:
  FlexAttention with a block mask on CUDA; SDPA with the [local, global] mask on the CPU
  (FlexAttention has no CPU backward). torch's own `context_parallel` has no CPU path and,
  per torchtitan, no document masks; this one runs on plain collectives (gloo and nccl).
- **Positions.** RoPE rotates each token by its global position (`positions = "sequence"`) or
  its position in its document (`"document"`, computed on the whole sequence, then split).
- **Loss and gradients.** A rank's loss covers its tokens over the step's global token count
  (counted on the whole samples, as without CP). FSDP shards and reduces over dp_shard x cp, so
  the backward loss is scaled by dp x cp to make the reduced gradient a plain sum. After the
  backward the cp ranks add their losses, so every rank reports its dp rank's whole loss and
  the loop, the guard and the logs are unchanged.
- **Checkpoints** hold nothing of CP: any checkpoint resumes at any cp. Validation and evals
  split their sequences too (`ContextSplit.for_width`: an eval's width is padded to 2 x cp
  chunks), each cp rank scoring its share, the sums added over cp (under PP x CP too: the
  stages attend through the pass's split).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.distributed import to_device
from trainer.models.common import logits
from trainer.models.common.attention import (
    _aux_request,
    _compiled_create_block_mask,
    document_positions,
    flex,
)
from trainer.models.common.mtp import future_labels
from trainer.parallel.recompute import SAVED_GATHER_GROUPS


def head_tail_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions rank `rank` of `cp` keeps: chunks rank and 2cp-1-rank of 2cp."""
    chunk = seq_len // (2 * cp)
    return torch.cat(
        [
            torch.arange(rank * chunk, (rank + 1) * chunk),
            torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk),
        ]
    )


def contiguous_index(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The naive split, for comparison: rank r keeps the r-th of cp equal pieces."""
    piece = seq_len // cp
    return torch.arange(rank * piece, (rank + 1) * piece)


def attention_pairs(index: torch.Tensor) -> int:
    """Causal (query, key) pairs of the queries at global positions `index`: the attention
    work of a rank, in units of one q.k product per head."""
    return int((index + 1).sum())


def kernel(device_type: str, implementation: str) -> str:
    """CP's attention kernel: flex on CUDA unless 'sdpa' is asked, sdpa (masked) on the CPU."""
    return "flex" if device_type == "cuda" and implementation != "sdpa" else "sdpa"


def describe_kernel(name: str) -> str:
    return {
        "flex": "FlexAttention with one block mask per microbatch",
        "sdpa": "SDPA with one [local, global] mask per microbatch",
    }[name]


class ContextAttention:
    """One microbatch's attention on one cp rank, passed to every layer in place of a mask
    (trainer/models/common/attention.py `attend` calls `attend` here)."""

    def __init__(
        self,
        group,
        index: torch.Tensor,
        natural: torch.Tensor,
        doc_ids: torch.Tensor | None,
        implementation: str,
    ):
        self.group, self.natural, self.implementation = group, natural, implementation
        seq, batch = natural.numel(), 1 if doc_ids is None else doc_ids.shape[0]
        with torch.no_grad():
            if implementation == "flex":
                self.mask = _block_mask(index, doc_ids, batch, seq)
            else:
                keys = torch.arange(seq, device=index.device)
                allowed = keys[None, :] <= index[:, None]  # [local, global]
                if doc_ids is not None:
                    local_docs = doc_ids[:, index]
                    allowed = allowed & (local_docs[:, :, None] == doc_ids[:, None, :])
                # 4-D [batch or 1, 1, local, global]: with a 3-D mask SDPA falls back to its
                # math kernel on the CPU, which saves the [heads, local, global] scores
                self.mask = allowed.reshape(-1, 1, *allowed.shape[-2:])
        self._additive = None

    # Eager under torch.compile (a graph break per layer); not recursive, so the compiled
    # FlexAttention it calls stays compiled.
    @torch.compiler.disable(recursive=False)
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        gathered: bool = False,
        logit_max: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [b, local, h, d] over the whole sequence's k, v: [b, h, local, d]. `gathered`:
        k and v are already the whole sequence's (MLA expands them from gathered latents).
        `logit_max` (QK-clip): raised to each head's largest logit of this rank's queries."""
        if not gathered:
            k, v = self.gather(k), self.gather(v)
        gqa = q.shape[2] != k.shape[2]
        if logit_max is not None and not (
            self.implementation == "flex" and q.is_cuda and _aux_request() is not None
        ):
            allowed = (
                logits.block_mask(self.mask)
                if self.implementation == "flex"
                else logits.boolean(self.mask)
            )
            # this rank's queries are head-tail chunks, not in sequence order: every key
            logits.record(logit_max, logits.max_logits(q, k, allowed, causal=False))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.implementation == "flex":
            return flex(q, k, v, self.mask, gqa, logit_max)
        if self._additive is None or self._additive.dtype != q.dtype:  # once per microbatch
            self._additive = torch.zeros(self.mask.shape, dtype=q.dtype, device=q.device)
            self._additive.masked_fill_(~self.mask, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=self._additive, enable_gqa=gqa)

    @torch.compiler.disable  # also called from a block (MLA's latents); no compiled kernel
    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[b, local, h, d] from every cp rank -> [b, seq, h, d] in sequence order; the
        backward reduce-scatters the gradient in fp32."""
        full = GatherSequence.apply(t.transpose(0, 1).contiguous(), self.group)
        return full.index_select(0, self.natural).transpose(0, 1)

    def own_chunks(self) -> tuple[int, int]:
        """The sequence's 2cp chunks this rank holds: (head, tail) = (r, 2cp - 1 - r)."""
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        return rank, 2 * cp - 1 - rank

    @torch.compiler.disable
    def gather_chunks(self, t: torch.Tensor) -> torch.Tensor:
        """[b, 2, ...]: something of this rank's head and tail chunks -> [b, 2cp, ...] of every
        chunk in sequence order (a hybrid's DeltaNet: states, convolution inputs); the backward
        reduce-scatters the gradient in fp32."""
        cp = dist.get_world_size(self.group)
        full = GatherSequence.apply(t.transpose(0, 1).contiguous(), self.group)  # rank-major
        order = [2 * c if c < cp else 2 * (2 * cp - 1 - c) + 1 for c in range(2 * cp)]
        return full[order].transpose(0, 1)


class GatherSequence(torch.autograd.Function):
    """All-gather over the cp group on dim 0. The backward reduce-scatters the gradient in
    fp32: summed in bf16 it would round cp - 1 times (torch's ring attention accumulates its
    K/V gradients in fp32 too). Under op-level activation checkpointing the gathered tensor is
    saved, not gathered again in the recompute (`recompute.SAVED_GATHER_GROUPS`)."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        import torch.distributed._functional_collectives as funcol

        ctx.group, ctx.dtype = group, t.dtype
        # *_single on torch 2.13+ (the *_tensor names warn there), *_tensor on 2.11: one op
        gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
        return funcol.wait_tensor(gather(t, 0, group))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed._functional_collectives as funcol

        scatter = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
        summed = scatter(grad.float().contiguous(), "sum", 0, ctx.group)
        return funcol.wait_tensor(summed).to(ctx.dtype), None


def mask_mod(index: torch.Tensor, doc_ids: torch.Tensor | None):
    """FlexAttention's mask_mod for a rank's queries (global positions `index`) over the whole
    sequence in order: key <= query, and under block_causal the same document."""

    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= index[q_idx]

    def block_causal(b, h, q_idx, kv_idx):
        pos = index[q_idx]
        return (kv_idx <= pos) & (doc_ids[b, kv_idx] == doc_ids[b, pos])

    return causal if doc_ids is None else block_causal


def _block_mask(index: torch.Tensor, doc_ids: torch.Tensor | None, batch: int, seq: int):
    rows = None if doc_ids is None else batch
    return _compiled_create_block_mask()(
        mask_mod(index, doc_ids), rows, None, index.numel(), seq, device=index.device
    )


class ContextSplit:
    """One cp rank's share of every sequence: its global positions (head-tail), the order that
    puts gathered K/V back in sequence order, and the attention of a microbatch. Used by
    ContextParallelLoop, and by the pipeline's stages under PP x CP."""

    def __init__(self, cp_mesh, seq_len: int, device: torch.device, model_cfg):
        self.cp, self.group = cp_mesh.size(), cp_mesh.get_group()
        SAVED_GATHER_GROUPS.add(self.group.group_name)  # op-level AC keeps the K/V gathers
        self._remake, self._widths = (cp_mesh, device, model_cfg), {seq_len: self}
        rank = cp_mesh.get_local_rank()
        self.index = to_device(head_tail_index(seq_len, self.cp, rank), device)
        order = torch.cat([head_tail_index(seq_len, self.cp, r) for r in range(self.cp)])
        self.natural = to_device(torch.argsort(order), device)  # gathered -> sequence order
        self.block_causal = model_cfg.attn_mask_type == "block_causal"
        self.document_positions = model_cfg.positions == "document"
        self.kernel = kernel(device.type, model_cfg.attn_implementation)

    def for_width(self, width: int) -> "ContextSplit":
        """The split of sequences `width` long (evals: a multiple of 2 x cp), made once."""
        if width not in self._widths:
            self._widths[width] = ContextSplit(self._remake[0], width, *self._remake[1:])
        return self._widths[width]

    def describe(self) -> str:
        return (
            f"context parallel: cp {self.cp}, each sequence cut into {2 * self.cp} chunks "
            f"(head-tail); attention: {describe_kernel(self.kernel)}, by global position"
            f"{' and document' if self.block_causal else ''}, K/V all-gathered per layer"
        )

    def split(self, inputs: torch.Tensor, labels: torch.Tensor, doc_ids):
        """This rank's tokens, labels and RoPE positions [b, local] of whole samples."""
        positions = (
            document_positions(doc_ids)[:, self.index]
            if self.document_positions
            else self.index.expand(inputs.shape[0], -1)
        )
        return inputs[:, self.index], labels[:, self.index], positions

    def run(
        self, model, inputs: torch.Tensor, labels: torch.Tensor, loss_fn, doc_ids=None, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`model`'s forward on this rank's share of the whole samples `inputs` (training,
        validation and evals alike): (its result, the share's labels)."""
        local, local_labels, positions = self.split(inputs, labels, doc_ids)
        out = model(
            local,
            labels=local_labels,
            loss_fn=loss_fn,
            positions=positions,
            doc_ids=doc_ids,
            attention=self.attention(doc_ids),
            **kwargs,
        )
        return out, local_labels

    # ---- as the microbatch loop's split (trainer/parallel/microbatches.py's WholeSequences)

    @property
    def share(self) -> int:
        """The backward's extra scale: the cp ranks' shares of a sample add up to its loss,
        and FSDP averages over dp x cp ranks."""
        return self.cp

    def forward(self, model, inputs, labels, loss_fn, doc_ids, window) -> torch.Tensor:
        """This rank's summed token loss of its share of the microbatch (the MTP targets cut
        from the whole sequence)."""
        depth = model.args.mtp_layers
        future = self.future(labels, depth, window) if depth else None
        return self.run(model, inputs, labels, loss_fn, doc_ids, future=future)[0]

    def after(self, loss_sum, z_loss, mtp):
        """Every cp rank reports its dp rank's whole loss, as without CP."""
        return sum_over_cp(loss_sum, z_loss, self.group, mtp)

    def future(self, labels: torch.Tensor, depth: int, documents=None) -> torch.Tensor:
        """The MTP modules' targets [depth, b, local] at this rank's positions, shifted on the
        whole samples (a position's next tokens may sit on another cp rank); `documents`:
        the whole window's document ids [b, s + 1] (targets within documents)."""
        return future_labels(labels, depth, documents)[:, :, self.index]

    def attention(self, doc_ids) -> ContextAttention:
        """A microbatch's attention; `doc_ids` [b, seq] of the whole samples (block_causal)."""
        return ContextAttention(
            self.group,
            self.index,
            self.natural,
            doc_ids if self.block_causal else None,
            self.kernel,
        )


def sum_over_cp(loss: torch.Tensor, z_loss, group, mtp=None):
    """The cp ranks' shares of the loss (and z-loss, MTP loss) added: every cp rank reports
    its dp rank's whole loss."""
    dist.all_reduce(loss, group=group)
    out = [loss]
    for extra in (z_loss, mtp):
        if extra is not None:
            extra = extra.detach().clone()
            dist.all_reduce(extra, group=group)
        out.append(extra)
    return tuple(out)
