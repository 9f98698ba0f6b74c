"""DeepSeek-V3's attention (MLA with YaRN, as released) under every kernel the trainer can run
it with, against an fp32 reference computed here by hand: outputs, gradients and QK-clip's
per-head logit maxima, and each kernel's time, one process.

    python benchmarks/gpu/gpu_mla_attention.py                  # CUDA, bf16, 16 heads x 4,096
    python benchmarks/gpu/gpu_mla_attention.py --heads 128 --seq 4096 --repeats 10
    python benchmarks/gpu/gpu_mla_attention.py --device cpu --heads 2 --seq 96 --dim 256

q, k and v come from the trainer's own MLA layer (trainer/models/common/mla.py) of the
`deepseek-v3-671b` flavor (YaRN factor 40: the queries carry its softmax gain, cos/sin its
rope gain; queries and keys 192 wide, values 128), with --heads heads instead of 128. Each
kernel runs the trainer's `attend` (trainer/models/common/attention.py) on the same bf16 tensors:
causal under SDPA with one backend allowed at a time (cudnn, flash, efficient, math) and under
`model.sdpa_backends = auto`; block_causal (three documents a row) under FlexAttention, SDPA's
additive mask and one SDPA call per document. The reference is the textbook formula in
fp32 on the same inputs: softmax(q k^T / sqrt(192) + mask) v, its gradients by autograd.
Errors are relative: |kernel - reference|_F / |reference|_F. A kernel torch will not run for
these shapes is reported `n/a` with torch's reason (flash takes no values narrower than the
keys); a kernel that runs and is off by more than --tol, or any other error (a compile, out
of memory), is a FAIL (exit 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from trainer.models.common import sdpa
from trainer.models.common.attention import attend, build_mask
from trainer.models.common.layers import rope_tables
from trainer.models.common.mla import MLA
from trainer.models.flavors import model_args

FLAVOR = "deepseek-v3-671b"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--heads", type=int, default=16, help="attention heads (the release: 128)")
    ap.add_argument("--dim", type=int, default=7168, help="model width (the release: 7168)")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5, help="timed forward+backward runs")
    ap.add_argument("--tol", type=float, default=2e-2, help="largest relative error passed")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def mla_inputs(args, device, dtype):
    """(q, k, v [b, s, h, d], doc_ids [b, s], softmax gain) from the flavor's MLA layer."""
    margs = model_args(FLAVOR, max_seq_len=args.seq)
    margs = dataclasses.replace(margs, n_heads=args.heads, n_kv_heads=args.heads, dim=args.dim)
    torch.manual_seed(args.seed)
    layer = MLA(margs).to(device)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(
                torch.ones_like(p)
                if name.endswith("norm.weight")
                else torch.randn_like(p) * p.shape[-1] ** -0.5
            )
    layer = layer.to(dtype)
    cos, sin = rope_tables(
        margs.mla.qk_rope_head_dim,
        args.seq,
        margs.rope_theta,
        device=device,
        scaling=margs.rope_scaling,
    )
    x = torch.randn(args.batch, args.seq, args.dim, device=device, dtype=dtype)
    with torch.no_grad():
        q, k, v = layer.project(x, cos, sin)
    # three documents a row, of uneven lengths (a block-causal window)
    cuts = torch.tensor([0, args.seq // 5, (args.seq * 3) // 5], device=device)
    pos = torch.arange(args.seq, device=device)
    doc_ids = (pos[None, :, None] >= cuts[None, None, :]).sum(-1).expand(args.batch, -1)
    return q, k, v, doc_ids.contiguous(), layer.softmax_gain


def reference(q, k, v, doc_ids, grad_out):
    """The formula in fp32: (out [b, h, s, dv], dq, dk, dv, per-head logit maxima)."""
    qf, kf, vf = (t.detach().float().transpose(1, 2).requires_grad_() for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) / qf.shape[-1] ** 0.5
    s = q.shape[1]
    idx = torch.arange(s, device=q.device)
    allowed = idx[:, None] >= idx[None, :]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])[:, None]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.softmax(scores, -1) @ vf
    out.backward(grad_out.float())
    maxima = scores.detach().amax(dim=(0, 2, 3))
    return (
        out.detach(),
        qf.grad.transpose(1, 2),
        kf.grad.transpose(1, 2),
        vf.grad.transpose(1, 2),
        maxima,
    )


def only_backend(name: str | None):
    """SDPA with one backend allowed; None: the order `model.sdpa_backends = auto` set."""
    if name is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(
        [
            {
                "cudnn": SDPBackend.CUDNN_ATTENTION,
                "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "math": SDPBackend.MATH,
            }[name]
        ]
    )


def cases(device, dtype, doc_ids):
    """(label, mask or None, backend or None, mask type) of every kernel to run here."""
    backends = ("cudnn", "flash", "efficient", "math") if device.type == "cuda" else ("math",)
    out = [(f"causal sdpa[{b}]", None, b, "causal") for b in backends]
    out.append(("causal sdpa[auto]", None, None, "causal"))
    if device.type == "cuda":  # FlexAttention has no backward on the CPU
        out.append(("block_causal flex", "flex", None, "block_causal"))
    out.append(("block_causal sdpa-mask", "sdpa", None, "block_causal"))
    out.append(("block_causal per_document", "per_document", None, "block_causal"))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_case(q, k, v, mask, backend, grad_out, repeats, device):
    """(out, dq, dk, dv, logit maxima, median ms of forward+backward) under one kernel."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    times, result = [], None
    for i in range(repeats + 2):  # the first: the result (with the logit maxima, compiled
        # apart under FlexAttention); the second: compiled without them, untimed
        for t in leaves:
            t.grad = None
        maxima = torch.full((q.shape[2],), float("-inf"), device=device)
        sync(device)
        t0 = time.perf_counter()
        with only_backend(backend):
            out = attend(*leaves, mask, logit_max=maxima if i == 0 else None)
            out.backward(grad_out)
        sync(device)
        if i == 0:
            result = (out.detach(), *(t.grad for t in leaves), maxima)
        elif i > 1:
            times.append((time.perf_counter() - t0) * 1e3)
    return (*result, statistics.median(times) if times else float("nan"))


def rel(a, b) -> float:
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv) -> int:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    q, k, v, doc_ids, gain = mla_inputs(args, device, dtype)
    grad_out = torch.randn(
        args.batch, args.heads, args.seq, v.shape[-1], device=device, dtype=dtype
    )
    sdpa.apply("auto", device)  # as a run does: the cases without a backend run under it
    picked = sdpa.chosen(
        dataclasses.replace(model_args(FLAVOR), n_heads=args.heads, n_kv_heads=args.heads),
        device,
        dtype,
        args.seq,
    )
    refs = {
        "causal": reference(q, k, v, None, grad_out),
        "block_causal": reference(q, k, v, doc_ids, grad_out),
    }
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"{FLAVOR} attention (YaRN softmax gain {gain:.4f}), {args.heads} heads, q/k "
        f"{q.shape[-1]} v {v.shape[-1]}, batch {args.batch} x {args.seq}, {args.dtype}, "
        f"{name}, torch {torch.__version__}; auto runs the causal call on {picked}"
    )
    print(
        f"{'kernel':<28}{'out':>10}{'dq':>10}{'dk':>10}{'dv':>10}{'maxima':>10}"
        f"{'fwd+bwd ms':>12}  verdict"
    )
    failed = 0
    for label, impl, backend, mask_type in cases(device, dtype, doc_ids):
        mask = None if impl is None else build_mask(doc_ids, impl, dtype)
        try:
            *got, ms = run_case(q, k, v, mask, backend, grad_out, args.repeats, device)
        except Exception as err:  # noqa: BLE001 - each row says what happened
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:90]
            if backend is not None and "No available kernel" in str(err):
                print(f"{label:<28}{'n/a':>10}  ({reason})")  # torch's own refusal
            else:  # a path the trainer runs (or a forced kernel) broke: a failure
                failed += 1
                print(f"{label:<28}{'FAIL':>10}  ({type(err).__name__}: {reason})", flush=True)
            continue
        errs = [rel(a, b) for a, b in zip(got, refs[mask_type], strict=True)]
        ok = all(e <= args.tol for e in errs)
        failed += not ok
        print(
            f"{label:<28}"
            + "".join(f"{e:>10.2e}" for e in errs)
            + f"{ms:>12.2f}  "
            + ("ok" if ok else f"FAIL (> {args.tol:g})"),
            flush=True,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
