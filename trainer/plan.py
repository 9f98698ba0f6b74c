"""A memory plan before launch: what one device will hold, and whether it fits.

    python -m trainer.plan --config configs/debug_model.toml --ngpu 8 [--nnodes 2] [--gpu h100]
        [--mfu 0.4] [--host-gib 2048] [--section.key value ...]

Everything is computed from the config and the model's shapes (built on the meta device), for
the rank holding the biggest shard (rank 0: FSDP2 gives it ceil(rows / shard) rows of every
tensor and pads the other ranks' storage to the same size). Bytes are per device.

The device's peak is the largest of five moments of a step; each is the resident state
(sharded fp32 parameters, AdamW states, buffers and inputs) plus what is live then:
- the loss: every saved activation and the loss region at its widest (eager: the fp32
  log-probabilities and their gradients; chunked: one chunk, dh and the fp32 dW; see
  `loss_region`), with the head's params kept unsharded from forward;
- the output head's backward: activations, the loss's gradients for it, the head's unsharded
  params, grads and reduce-scatter buffer, and the prefetched last block;
- the top block's backward: saved activations, one block recomputed under AC, one block's
  FSDP buffers;
- the end of backward (the embedding): the sharded gradients, the embedding's FSDP buffers;
- the optimizer step: every sharded gradient and the optimizer's temporaries.
Sharded gradients are None from `zero_grad(set_to_none=True)` until each group's backward, so
they are counted only from the end of backward on. The formulas assume the eager model in
trainer/model.py with a flash/memory-efficient SDPA or, for block_causal, compiled
FlexAttention (no [seq, seq] score matrix; `attn_implementation = "sdpa"` adds one
[batch, 1, seq, seq] mask per microbatch, see trainer.attention.memory_bytes) and the loss
of trainer/loss.py; compiled blocks usually save less (Inductor fuses the elementwise ops),
so for `[compile] enable` the plan is an upper bound in practice. Each formula's assumptions are in its function's docstring;
tests/test_plan.py checks them against tensors measured on CPU ranks.

With `parallelism.fsdp_offload = "cpu"` the sharded state moves to host memory, which the
plan checks too (trainer/plan_host.py): per rank, times the ranks of a node. The printed
report and the command line are trainer/plan_report.py.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from dataclasses import dataclass

from trainer.attention import attention_args, memory_bytes as attention_bytes
from trainer.config import JobConfig
from trainer.errors import ConfigError
from trainer.flops import flops_per_token
from trainer.model import FLAVORS, ModelArgs, build_model, model_args
from trainer.plan_host import host_memory, offload_staging
from trainer.optim import implementation

GIB = 2**30
BYTES = {"float32": 4, "bfloat16": 2, "auto": 2}  # the plan is for GPUs: auto = bfloat16 there
FP32, INT64 = 4, 8


@dataclass(frozen=True)
class Gpu:
    name: str  # as torch.cuda.get_device_name() reports it: looked up in trainer.flops' table
    memory_gib: float  # total memory as nvidia-smi reports it (approximate; --gpu-mem-gib)


GPUS = {
    "h100": Gpu("NVIDIA H100 80GB HBM3", 81559 / 1024),
    "h100-pcie": Gpu("NVIDIA H100 PCIe", 81559 / 1024),
    "h200": Gpu("NVIDIA H200", 143771 / 1024),
    "a100": Gpu("NVIDIA A100-SXM4-80GB", 81920 / 1024),
    "a100-40gb": Gpu("NVIDIA A100-SXM4-40GB", 40960 / 1024),
    "l40s": Gpu("NVIDIA L40S", 46068 / 1024),
    "b200": Gpu("NVIDIA B200", 179.0),
}
CONTEXT_GIB = 1.5  # CUDA context, cuBLAS and NCCL workspaces: outside the caching allocator
FRAGMENTATION = 0.07  # caching-allocator rounding and fragmentation, as a share of the plan


# --------------------------------------------------------------------------- shapes


def resolve_vocab(cfg: JobConfig) -> tuple[int, str]:
    """The model vocab train.py will use, and where it comes from.

    `[model] vocab_size` if set; for the stdlib and synthetic sources the tokenizer's vocab is
    `[data] vocab_size`, padded as train.py pads it; any other tokenizer is only known once
    loaded, so the flavor's own vocab stands in (set `[model] vocab_size` to be exact).
    """
    if cfg.model.vocab_size:
        return cfg.model.vocab_size, "[model] vocab_size"
    if cfg.data.dataset in ("stdlib", "synthetic"):
        mult = cfg.model.vocab_size_multiple_of
        return -(-cfg.data.vocab_size // mult) * mult, (
            f"[data] vocab_size of the {cfg.data.dataset} tokenizer, padded to a multiple of "
            f"{mult}")
    return FLAVORS[cfg.model.flavor].vocab_size, (
        f"the {cfg.model.flavor} flavor's (the tokenizer is not loaded; set [model] vocab_size)")


def plan_args(cfg: JobConfig, vocab: int) -> ModelArgs:
    """The model a run of `cfg` builds on a GPU (attention resolved for CUDA)."""
    return model_args(cfg.model.flavor, vocab_size=vocab, max_seq_len=cfg.training.seq_len,
                      **attention_args(cfg.model, "cuda"))


COLWISE = ("wq", "wk", "wv", "w1", "w3", "output", "tok_embeddings")  # tp splits dim 0
ROWWISE = ("wo", "w2")  # tp splits dim 1 (the matmul's input features)


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """One tp rank's part of parameter `name` (Megatron layout): wq/wk/wv/w1/w3 colwise and the
    output head colwise (rows split), wo/w2 rowwise (columns split), the embedding rowwise
    (vocab rows split); RMSNorm weights are replicated over tp (sequence parallel)."""
    module = name.split(".")[-2] if "." in name else name
    if tp == 1 or module not in COLWISE + ROWWISE:
        return shape
    dim = 0 if module in COLWISE else 1
    return tuple(n // tp if i == dim else n for i, n in enumerate(shape))


@functools.lru_cache(maxsize=16)
def fsdp_groups(args: ModelArgs, tp: int = 1) -> dict[str, list[tuple[int, ...]]]:
    """Parameter shapes per FSDP group, as trainer.parallelize.apply_fsdp forms the groups:
    one per block, the embedding, and the final norm + output head. Built on meta: free.
    With tp > 1 each shape is one tp rank's part (`tp_local_shape`): FSDP shards that part
    over dp_shard (FSDP2's strided sharding of a colwise weight gives rank 0
    ceil(rows / tp / dp_shard) rows, as `shard_numel` counts on the tp-local shape)."""
    groups: dict[str, list[tuple[int, ...]]] = {}
    for name, p in build_model(args).named_parameters():
        key = ".".join(name.split(".")[:2]) if name.startswith("layers.") else (
            "embedding" if name.startswith("tok_embeddings") else "head")
        groups.setdefault(key, []).append(tp_local_shape(name, tuple(p.shape), tp))
    return groups


def shard_numel(shape: tuple[int, ...], shard: int) -> int:
    """Elements of rank 0's shard: FSDP2 splits dim 0 like torch.chunk, ceil(rows / shard)."""
    return math.ceil(shape[0] / shard) * math.prod(shape[1:])


def gathered_numel(shapes, shard: int) -> int:
    """Elements of a group's all-gather output: every tensor padded to shard * ceil(rows/shard)."""
    return sum(shard * shard_numel(s, shard) for s in shapes)


# --------------------------------------------------------------------------- activations


def block_split(a: ModelArgs, p: int, tp: int = 1) -> tuple[int, int]:
    """Bytes one block saves for backward, no AC (eager trainer.model), as (per token of this
    rank's sequence shard, per token of the whole microbatch); their sum per token is the
    block's figure without TP.

    RMSNorm x2: the fp32 upcast and the normed output in the compute dtype, (4 + p) * dim each
    (in fp32 the upcast is the input itself: still 8 * dim). Attention: the normed input of
    wq/wk/wv (p * dim); SDPA's q, k, v (k and v repeated to n_heads for GQA), output (wo's input
    is a view of it) at p * n_heads * head_dim each (FlexAttention, block_causal on CUDA, takes
    k and v unrepeated: 2 * p * n_kv_heads * head_dim for them; per-document SDPA keeps each
    document's output and wo's input, their concatenation: one more p * n_heads * head_dim);
    the logsumexp, fp32 per head.
    RoPE saves only the cos/sin tables. FFN: the normed input (p * dim) and four hidden-sized
    tensors (w1 and w3 outputs, silu output, their product: w2's input).
    With tp > 1 (sequence parallel): the norms see 1/tp of the sequence (the first figure);
    the inputs of wq/wk/wv and w1/w3 are the all-gathered whole sequence (p * dim each); the
    heads and the FFN width are split, so everything attention and FFN save is 1/tp.
    """
    q, kv = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp
    kernel = a.attn_implementation if a.attn_mask_type == "block_causal" else "sdpa"
    attn = {"flex": 2 * p * (q + kv), "per_document": 5 * p * q}.get(kernel, 4 * p * q)
    inner = 2 * p * a.dim + attn + FP32 * a.n_heads // tp + 4 * p * a.hidden_dim // tp
    return 2 * (4 + p) * a.dim, inner


def block_saved(a: ModelArgs, p: int) -> int:
    """Bytes one block saves for backward per token without TP, no AC (see `block_split`)."""
    return sum(block_split(a, p))


def op_sac_split(a: ModelArgs, p: int, tp: int = 1) -> tuple[int, int]:
    """Per token under op-level selective AC (trainer.parallelize keeps every mm and SDPA
    output): the block input, the outputs of wq, wk, wv, wo, w1, w3, w2 and SDPA's output and
    logsumexp. Everything else is recomputed in backward. As (sequence-shard, whole-sequence)
    bytes like `block_split`: with tp > 1 the block input is sequence-sharded, the outputs of
    the colwise matmuls and SDPA are 1/tp, and wo's and w2's are their full [tokens, dim]
    partial sums (before the reduce-scatter)."""
    q, kv = a.n_heads * a.head_dim // tp, a.n_kv_heads * a.head_dim // tp
    mm_out = q + 2 * kv + a.dim + 2 * a.hidden_dim // tp + a.dim
    return p * a.dim, p * mm_out + p * q + FP32 * a.n_heads // tp


def block_saved_op_sac(a: ModelArgs, p: int) -> int:
    """Per token under op-level selective AC without TP (see `op_sac_split`)."""
    return sum(op_sac_split(a, p))


def sp_tokens(tokens: int, tp: int) -> int:
    """Tokens of one rank's sequence shard under sequence parallelism (rank 0: ceil)."""
    return -(-tokens // tp)


def split_bytes(split: tuple[int, int], tokens: int, tp: int) -> int:
    """Bytes of a (sequence-shard, whole-sequence) per-token pair for one microbatch."""
    return split[0] * sp_tokens(tokens, tp) + split[1] * tokens


def checkpointed_blocks(cfg: JobConfig, n_layers: int) -> int:
    """Blocks recomputed in full: all (full), those with index % k == 0 (selective k), none."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return n_layers
    if ac.mode == "selective" and ac.selective_ac_option != "op":
        return math.ceil(n_layers / int(ac.selective_ac_option))
    return 0


def blocks_activations(cfg: JobConfig, a: ModelArgs, p: int, tokens: int,
                       mode: str | None = None, tp: int = 1) -> int:
    """Saved activations of all blocks for one microbatch under an AC mode (default: config's).
    A checkpointed block keeps only its input (p * dim per token; 1/tp of the sequence under
    TP). With document positions and p < 4, FSDP casts the per-token fp32 cos/sin to the
    compute dtype at every block's input, and each block keeps its copy in every AC mode
    (p * head_dim per token; whole sequence under TP)."""
    mode = mode or cfg.activation_checkpoint.mode
    rope = a.n_layers * p * a.head_dim * tokens if a.positions == "document" and p < FP32 else 0
    full, ckpt_input = block_split(a, p, tp), p * a.dim * sp_tokens(tokens, tp)
    if mode == "none":
        return a.n_layers * split_bytes(full, tokens, tp) + rope
    if mode == "full":
        return a.n_layers * ckpt_input + rope
    if cfg.activation_checkpoint.selective_ac_option == "op":
        return a.n_layers * split_bytes(op_sac_split(a, p, tp), tokens, tp) + rope
    ckpt = checkpointed_blocks(cfg, a.n_layers)
    return ckpt * ckpt_input + (a.n_layers - ckpt) * split_bytes(full, tokens, tp) + rope


def head_saved(a: ModelArgs, p: int) -> int:
    """Per token: the final RMSNorm ((4 + p) * dim) and the output head's input (p * dim)."""
    return (4 + 2 * p) * a.dim


def head_activations(a: ModelArgs, p: int, tokens: int, tp: int = 1) -> int:
    """`head_saved` for one microbatch; under TP the final norm sees 1/tp of the sequence and
    the head's input is the all-gathered whole sequence."""
    return split_bytes(((4 + p) * a.dim, p * a.dim), tokens, tp)


def loss_region(cfg: JobConfig, a: ModelArgs, p: int, tokens: int, tp: int = 1,
                loss_parallel: bool = True) -> dict[str, int]:
    """What the loss (trainer/loss.py) holds for one microbatch: `at_loss`, at its widest;
    `at_head`, in the head's backward; `after`, through the rest of the backward.

    eager: the [batch, seq, vocab] logits in the compute dtype are counted as held through the
    whole backward; cross-entropy upcasts them to fp32, its log-softmax saves an fp32 output,
    and its backward holds that output, the incoming and the produced fp32 gradient at once:
    p + 12 bytes per logit at the peak, 2p in the head's backward.
    chunked: dh (p per token and dim) and the fp32 dW ([vocab, dim]) live from the loss's
    forward to the head's backward, which casts dW to the compute dtype (p * vocab * dim more,
    none in fp32). One chunk of c tokens holds its logits in the compute dtype and in fp32,
    then the fp32 softmax and its cast (both (4 + p) * c * vocab in bf16, 4 * c * vocab in
    fp32), then the cast and dW's product in the compute dtype (bf16 only). Nothing is held
    after the head's backward.
    With tp > 1 the loss sees every token of the microbatch (the head's input is gathered):
    under loss parallel each rank's vocab is vocab / tp (logits, chunks and dW all shrink by
    tp); with `disable_loss_parallel` the head's weight is all-gathered over tp (p * vocab *
    dim more, held at the loss and in the head's backward) and the loss is over the full vocab.
    """
    v = a.vocab_size // tp if loss_parallel else a.vocab_size
    gathered_w = p * a.vocab_size * a.dim if tp > 1 and not loss_parallel else 0
    if cfg.training.loss == "eager":
        held = p * v * tokens
        return {"at_loss": held + 3 * FP32 * v * tokens + gathered_w,
                "at_head": 2 * held + gathered_w, "after": held}
    c = min(cfg.training.loss_chunk_size, tokens)
    grads = p * tokens * a.dim + FP32 * v * a.dim
    cast = p * v * a.dim if p < FP32 else 0
    chunk = max((FP32 + p) * c * v, p * c * v + cast) if p < FP32 else FP32 * c * v
    return {"at_loss": grads + chunk + gathered_w, "at_head": grads + cast + gathered_w,
            "after": 0}


# --------------------------------------------------------------------------- the plan


def memory_plan(cfg: JobConfig, world_size: int) -> dict[str, int]:
    """Bytes per device by category, for rank 0 (the largest shard), and the peak `total`.

    Resident: `parameters`, `gradients` (fp32, sharded over dp_shard; replicated over
    dp_replicate under HSDP; with tp > 1 each rank holds the dp_shard shard of its tp part, see
    `fsdp_groups`: the matmul weights are 1/(tp x dp_shard), the norms 1/dp_shard), `optimizer_state` (AdamW's exp_avg and exp_avg_sq like the
    parameters, plus one fp32 step scalar per tensor), `buffers_and_inputs` (the fp32 RoPE
    tables and the int64 inputs, labels and, for block_causal, document ids). Per microbatch:
    `activations` (the configured AC mode; `activations_no_ac` and `activations_full_ac` for
    comparison; all include the final norm and head input, and `attention_inputs`: the
    block-causal mask and document RoPE tables, trainer.attention.memory_bytes), `ac_recompute` (one block's full activations while it is recomputed),
    `logits_loss`. Transient: `fsdp_*` (see `fsdp_buffers`), `grad_accumulation` (unsharded
    grads kept between microbatches when sync is 'last' with accumulation: FSDP2 keeps them in
    the reduce dtype), `optimizer_step_temp` (foreach AdamW computes sqrt(exp_avg_sq) for all
    tensors at once: one fp32 copy of the shard; for-loop: two of the largest tensor; fused:
    none). `peak_*`: the device total at each moment in the module docstring; `total` the max.
    """
    pd, accum = cfg.resolve(world_size)
    vocab, _ = resolve_vocab(cfg)
    a = plan_args(cfg, vocab)
    groups, shard, tp = fsdp_groups(a, pd.tp), pd.dp_shard, pd.tp
    p, r = BYTES[cfg.training.mixed_precision_param], BYTES[cfg.training.mixed_precision_reduce]
    tokens = cfg.training.local_batch_size * cfg.training.seq_len
    shapes = [s for g in groups.values() for s in g]
    b = {"parameters": FP32 * sum(shard_numel(s, shard) for s in shapes)}
    b["gradients"] = b["parameters"]
    b["optimizer_state"] = 2 * b["parameters"] + FP32 * len(shapes)
    documents = a.attn_mask_type != "causal" or a.positions != "sequence"
    b["buffers_and_inputs"] = (2 * FP32 * a.max_seq_len * (a.head_dim // 2)
                               + (2 + documents) * INT64 * tokens)  # + the document ids

    head_act = head_activations(a, p, tokens, tp)
    # the block-causal mask and per-document RoPE tables, once per microbatch (all layers)
    b["attention_inputs"] = attention_bytes(a, cfg.training.local_batch_size,
                                            cfg.training.seq_len, p)
    act = head_act + b["attention_inputs"]
    b["activations_no_ac"] = blocks_activations(cfg, a, p, tokens, "none", tp) + act
    b["activations_full_ac"] = blocks_activations(cfg, a, p, tokens, "full", tp) + act
    b["activations"] = blocks_activations(cfg, a, p, tokens, tp=tp) + act
    recompute = cfg.activation_checkpoint.mode != "none"
    b["ac_recompute"] = split_bytes(block_split(a, p, tp), tokens, tp) if recompute else 0
    loss = loss_region(cfg, a, p, tokens, tp, pd.loss_parallel)
    b["logits_loss"], held_logits = loss["at_loss"], loss["after"]
    b.update(fsdp_buffers(cfg, groups, shard, p, r))
    sync_last = cfg.training.gradient_accumulation_sync == "last"
    b["grad_accumulation"] = r * gathered_numel(shapes, shard) if accum > 1 and sync_last else 0
    impl = implementation(cfg.optimizer.implementation, "cuda")  # the plan is for GPUs
    largest = max(FP32 * shard_numel(s, shard) for s in shapes)
    b["optimizer_step_temp"] = {"foreach": b["parameters"], "for-loop": 2 * largest}.get(impl, 0)
    # With fsdp_offload the sharded state (params, grads, optimizer) is in host memory
    # (trainer/plan_host.py); the device holds the staging copies of `offload_staging`.
    on_device = 0 if cfg.parallelism.fsdp_offload == "cpu" else 1
    b["offload_staging"] = (1 - on_device) * offload_staging(
        {k: sum(shard_numel(s, shard) for s in g) for k, g in groups.items()}, p, r)

    resident = (on_device * (b["parameters"] + b["optimizer_state"]) + b["buffers_and_inputs"]
                + b["offload_staging"])
    in_backward = resident + b["grad_accumulation"]
    blocks_act = b["activations"] - head_act
    b["peak_loss"] = in_backward + b["activations"] + b["logits_loss"] + b["fsdp_loss"]
    b["peak_head_backward"] = (in_backward + b["activations"] + loss["at_head"]
                               + b["fsdp_head"])
    b["peak_block_backward"] = (in_backward + blocks_act + b["ac_recompute"] + held_logits
                                + b["fsdp_block"])
    emb_grad = FP32 * sum(shard_numel(s, shard) for s in groups["embedding"])
    b["peak_end_of_backward"] = (in_backward + on_device * (b["gradients"] - emb_grad)
                                 + held_logits + b["fsdp_embedding"])
    b["peak_optimizer_step"] = resident + on_device * (b["gradients"] + b["optimizer_step_temp"])
    b["total"] = max(v for k, v in b.items() if k.startswith("peak_"))
    b.update(host_memory(cfg, b, [FP32 * shard_numel(s, shard) for s in shapes]))
    return b


def fsdp_buffers(cfg: JobConfig, groups, shard: int, p: int, r: int) -> dict[str, int]:
    """Unsharded parameters, gradients and reduce-scatter buffers live in each backward phase.

    A group being backpropagated holds its all-gathered params (p bytes, padded), its unsharded
    grads (p) and the flat reduce-scatter input (r: FSDP2 copies the grads into a buffer of the
    reduce dtype even when it equals p); the next group's params are prefetched (p), and on
    CUDA the previous group's reduce-scatter may still be in flight (r). The head is kept
    unsharded after forward under 'default' and 'never' and re-gathered under 'always': in its
    backward it is there in every policy. Under 'never' every group stays unsharded from its
    forward to its backward (counted until the embedding's backward, when the blocks have
    been resharded after theirs). An integer N keeps 1/N of those params per rank over the
    same span (FSDP2's post-forward shards over groups of N ranks). The embedding's backward also materialises its weight gradient
    in fp32 when computing in bf16 (CPU kernels accumulate in fp32; counted to stay safe).
    """
    g = {k: gathered_numel(v, shard) for k, v in groups.items()}
    block = max(n for k, n in g.items() if k.startswith("layers."))
    head, emb = g["head"], g["embedding"]
    policy, kept = cfg.parallelism.fsdp_reshard_after_forward, 0
    if policy == "never":
        kept = p * (sum(n for k, n in g.items() if k.startswith("layers.")) + emb)
    elif policy.isdigit():  # hpZ: each rank keeps 1/N of every block and the embedding
        kept = p * (sum(n for k, n in g.items() if k.startswith("layers.")) + emb) // int(policy)
    head_kept = p * head if policy != "always" else 0
    emb_temp = FP32 * emb if p < FP32 else 0
    return {
        "fsdp_loss": head_kept + kept,
        "fsdp_head": (2 * p + r) * head + p * block + kept,
        "fsdp_block": (3 * p + 2 * r) * block + kept,
        "fsdp_embedding": (2 * p + r) * emb + emb_temp + r * block,
    }


def device_need(total: int) -> int:
    """Bytes of device memory a plan peak needs: + the CUDA context and fragmentation."""
    return int(total + CONTEXT_GIB * GIB + FRAGMENTATION * total)


def largest_local_batch(cfg: JobConfig, world_size: int, mem_gib: float,
                        limit: int = 1024) -> int:
    """The largest `training.local_batch_size` whose plan fits `mem_gib` (0 if none does).
    With a fixed `global_batch_size`, only local batches that divide it are candidates."""

    def fits(batch: int) -> bool | None:  # None: not a valid local batch for this config
        trial = dataclasses.replace(cfg, training=dataclasses.replace(
            cfg.training, local_batch_size=batch))
        try:
            return device_need(memory_plan(trial, world_size)["total"]) <= mem_gib * GIB
        except ConfigError:
            return None

    lo, hi = 0, 1  # the plan grows with the batch: double, then bisect
    while hi <= limit and fits(hi) is not False:
        lo, hi = hi, hi * 2
    hi = min(hi, limit + 1)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) is not False else (lo, mid)
    return next((b for b in range(lo, 0, -1) if fits(b)), 0)


def throughput(cfg: JobConfig, peak_tflops: float, mfu: float) -> tuple[float, float]:
    """(model FLOPs per token, tokens/s per device) at the assumed MFU of the bf16 peak."""
    vocab, _ = resolve_vocab(cfg)
    a = plan_args(cfg, vocab)
    fpt = flops_per_token(a, cfg.training.seq_len)
    return fpt, mfu * peak_tflops * 1e12 / fpt


def main(argv: list[str]) -> int:
    """`python -m trainer.plan ...`: the report and its command line are trainer/plan_report.py."""
    from trainer.plan_report import main as report_main

    return report_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
