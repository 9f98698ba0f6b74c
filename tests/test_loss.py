"""The chunked loss against eager cross-entropy: forward and both gradients, in process.

fp32 must agree to rounding (<= 1e-5 relative), with ignored tokens and an uneven last chunk;
bf16 within bf16's own rounding. The FSDP path (loss inside the head's forward, tied and
untied, reshard after forward) is checked on real ranks in tests/scripts/loss_probe.py.
"""

import pytest
import torch

from tests.helpers import REPO, torchrun
from trainer.loss import IGNORE_INDEX, build_loss, chunked_loss, eager_loss


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
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert rel(a, b) <= 1e-5
    assert (got[1][0, [0, 5, 36]] == 0).all()  # ignored tokens get no gradient


def test_bf16_matches_eager_within_bf16_rounding():
    h, w, y = inputs(tokens=64, dim=32, vocab=256, dtype=torch.bfloat16)
    ref = loss_and_grads(eager_loss, h, w, y)
    got = loss_and_grads(build_loss("chunked", 16), h, w, y)
    assert got[0].dtype == torch.float32 and got[1].dtype == got[2].dtype == torch.bfloat16
    assert rel(got[0], ref[0]) <= 1e-5  # the same bf16 logits, reduced in fp32
    assert rel(got[1], ref[1]) <= 2e-2 and rel(got[2], ref[2]) <= 2e-2


def test_no_grad_and_all_ignored():
    h, w, y = inputs()
    with torch.no_grad():
        assert torch.allclose(chunked_loss(h, w, y, chunk_size=8), eager_loss(h, w, y),
                              rtol=1e-6)
    y = torch.full_like(y, IGNORE_INDEX)
    loss, gh, gw = loss_and_grads(build_loss("chunked", 8), h, w, y)
    assert loss == 0 and not gh.any() and not gw.any()


def test_fsdp_head_tied_and_untied(tmp_path):
    """On 2 FSDP ranks with the head resharded after forward, the trainer's model returns the
    same loss and the same sharded gradients with either loss, tied or untied."""
    out = torchrun(REPO / "tests" / "scripts" / "loss_probe.py", nproc=2, timeout=120,
                   fork=True)
    assert out.stdout.count("loss probe ok") == 8, out.stdout
