"""The chunked loss against eager cross-entropy: forward and both gradients, in process.

fp32 must agree to rounding (<= 1e-5 relative), with ignored tokens and an uneven last chunk,
with and without the z-loss; bf16 within bf16's own rounding. Without a z-loss both give the
results of the implementation before the z-loss existed, bit for bit. The FSDP path (loss inside the
head's forward, tied and untied, reshard after forward) is checked on real ranks in
tests/scripts/loss_probe.py.
"""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import REPO, torchrun
from trainer.models.common.loss import (
    IGNORE_INDEX,
    add_product,
    build_loss,
    chunked_loss,
    eager_loss,
)

Z = 1e-2  # a z-loss weight that moves the loss by ~5% and the gradients by ~10% here


def inputs(tokens=37, dim=24, vocab=101, dtype=torch.float32, ignored=(0, 5, 36), seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(1, tokens, dim, generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(vocab, dim, generator=gen) * 0.3).to(dtype).requires_grad_()
    y = torch.randint(0, vocab, (1, tokens), generator=gen)
    y[0, list(ignored)] = IGNORE_INDEX
    return h, w, y


def loss_and_grads(fn, h, w, y, scale=0.37):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(h, w, y)
    (loss * scale).backward()  # a scalar after the loss, as train.py scales it
    return loss.detach(), h.grad, w.grad


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])  # uneven last chunk (8), one chunk (37, 64)
def test_fp32_matches_eager(chunk):
    h, w, y = inputs()
    ref = loss_and_grads(eager_loss, h, w, y)
    got = loss_and_grads(build_loss("chunked", chunk), h, w, y)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) <= 1e-5
    assert (got[1][0, [0, 5, 36]] == 0).all()  # ignored tokens get no gradient


@pytest.mark.parametrize("z", [0.0, Z])
def test_bf16_matches_eager_within_bf16_rounding(z):
    h, w, y = inputs(tokens=64, dim=32, vocab=256, dtype=torch.bfloat16)
    ref = loss_and_grads(build_loss("eager", 0, z_loss_weight=z), h, w, y)
    got = loss_and_grads(build_loss("chunked", 16, z_loss_weight=z), h, w, y)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel(got[0], ref[0]) <= 1e-5  # the same bf16 logits, reduced in fp32
    assert rel(got[1], ref[1]) <= 2e-2 and rel(got[2], ref[2]) <= 2e-2


def test_no_grad_and_all_ignored():
    h, w, y = inputs()
    with torch.no_grad():
        assert torch.allclose(chunked_loss(h, w, y, chunk_size=8), eager_loss(h, w, y), rtol=1e-6)
    y = torch.full_like(y, IGNORE_INDEX)
    loss, gh, gw = loss_and_grads(build_loss("chunked", 8), h, w, y)
    assert loss == 0 and not gh.any() and not gw.any()


@pytest.mark.parametrize("chunk", [1, 8, 37, 64])
def test_z_loss_chunked_matches_eager(chunk):
    """Loss, both gradients and the kept z-loss term agree; the term is w * sum(lse^2) over
    the non-ignored tokens, added to the cross-entropy."""
    h, w, y = inputs()
    eager, chunked = (
        build_loss("eager", 0, z_loss_weight=Z),
        build_loss("chunked", chunk, z_loss_weight=Z),
    )
    ref, got = loss_and_grads(eager, h, w, y), loss_and_grads(chunked, h, w, y)
    z_ref, z_got = eager.take_z_loss(), chunked.take_z_loss()
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) <= 1e-5
    assert rel(z_got, z_ref) <= 1e-5 and chunked.take_z_loss() is None  # taken: reset
    lse = F.linear(h.detach(), w.detach()).double().logsumexp(-1)[y != IGNORE_INDEX]
    assert float(z_ref) == pytest.approx(Z * float(lse.square().sum()), rel=1e-6)
    plain = loss_and_grads(build_loss("chunked", chunk), h, w, y)
    assert float(got[0] - plain[0]) == pytest.approx(float(z_got), rel=1e-5)
    assert rel(got[1], plain[1]) > 1e-2 and rel(got[2], plain[2]) > 1e-2
    assert (got[1][0, [0, 5, 36]] == 0).all()  # ignored tokens: no z-loss gradient either
    with torch.no_grad():  # the forward-only path (validation-style) adds the same term
        assert rel(chunked(h, w, y), ref[0]) <= 1e-5
        assert rel(chunked.take_z_loss(), z_ref) <= 1e-5


def previous_chunked(h, w, y, chunk, scale=0.37):
    """The chunked loss as it was before the z-loss (loss, dh, dW after the backward's
    `scale`), kept as the reference for z_loss_weight = 0."""
    hf, yf = h.detach().reshape(-1, h.shape[-1]), y.reshape(-1)
    grad_h = torch.empty_like(hf)
    grad_w = torch.zeros(w.shape, dtype=torch.float32)
    loss = torch.zeros((), dtype=torch.float32)
    for start in range(0, hf.shape[0], chunk):
        hc, yc = hf[start : start + chunk], yf[start : start + chunk]
        logits = F.linear(hc, w.detach()).float()
        valid = yc != IGNORE_INDEX
        target = torch.where(valid, yc, 0)[:, None]
        lse = torch.logsumexp(logits, dim=-1)
        loss += torch.where(valid, lse - logits.gather(1, target).squeeze(1), 0.0).sum()
        probs = logits.sub_(lse[:, None]).exp_()
        probs.scatter_add_(1, target, -valid[:, None].to(probs.dtype))
        g = probs.mul_(valid[:, None]).to(hc.dtype)
        torch.mm(g, w.detach(), out=grad_h[start : start + chunk])
        if g.dtype == torch.float32:
            grad_w.addmm_(g.t(), hc)
        else:
            grad_w += torch.mm(g.t(), hc)
    s = torch.tensor(scale, dtype=torch.float32)
    return loss, grad_h.view(h.shape).mul_(s.to(h.dtype)), grad_w.mul_(s).to(w.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_without_z_loss_results_are_unchanged_bit_for_bit(dtype):
    h, w, y = inputs(dtype=dtype)
    for chunk in (8, 37):
        loss = build_loss("chunked", chunk, z_loss_weight=0.0)
        got = loss_and_grads(loss, h, w, y)
        for a, b in zip(got, previous_chunked(h, w, y, chunk), strict=True):
            assert torch.equal(a, b)
        assert loss.take_z_loss() is None
    hh, ww = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(
        F.linear(hh, ww).flatten(0, 1).float(),
        y.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    (ref * 0.37).backward()
    got = loss_and_grads(build_loss("eager", 0), h, w, y)
    for a, b in zip(got, (ref.detach(), hh.grad, ww.grad), strict=True):
        assert torch.equal(a, b)


def test_fsdp_head_tied_and_untied(tmp_path):
    """On 2 FSDP ranks with the head resharded after forward, the trainer's model returns the
    same loss and the same sharded gradients with either loss, tied or untied."""
    out = torchrun(REPO / "tests" / "scripts" / "loss_probe.py", nproc=2, timeout=120, fork=True)
    assert out.stdout.count("loss probe ok") == 8, out.stdout


def test_add_product_accumulates_in_fp32_on_this_device():
    """The chunked loss's head-gradient accumulation: fp32 inputs go through addmm_; bf16 inputs
    form the product in bf16 and add it in fp32 on CPU (no mixed-dtype GEMM here)."""
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(24, 40, generator=gen), torch.randn(40, 16, generator=gen)
    acc = torch.randn(24, 16, generator=gen)
    want = acc + a32 @ b32
    add_product(acc, a32, b32)
    torch.testing.assert_close(acc, want, rtol=1e-6, atol=1e-5)
    a, b = a32.bfloat16(), b32.bfloat16()
    acc = torch.zeros(24, 16)
    add_product(acc, a, b)
    add_product(acc, a, b)
    assert acc.dtype == torch.float32
    assert torch.equal(acc, 2 * (a @ b).float())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fp32-accumulator GEMM is CUDA's")
def test_cuda_add_product_is_one_gemm_more_exact_than_a_bf16_product():
    """On CUDA, bf16 inputs accumulate straight into the fp32 gradient (cuBLAS, out_dtype):
    closer to the fp32 product than a bf16 product added in fp32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(512, 4096, device="cuda", generator=gen).bfloat16()
    b = torch.randn(4096, 256, device="cuda", generator=gen).bfloat16()
    exact = a.double() @ b.double()
    acc = torch.zeros(512, 256, device="cuda")
    add_product(acc, a, b)
    fused_err = (acc.double() - exact).norm() / exact.norm()
    old_err = ((a @ b).double() - exact).norm() / exact.norm()
    assert fused_err < old_err / 4, (fused_err, old_err)
