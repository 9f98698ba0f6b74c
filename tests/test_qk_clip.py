"""QK-clip (optimizer.muon_qk_clip): the per-head maxima against the full score matrix, and the
clipped weights against a hand computation (trainer/models/common/logits.py,
trainer/optim/qk_clip.py)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.models.build import build_model
from trainer.models.common import logits
from trainer.models.common.attention import attend, build_mask
from trainer.models.flavors import model_args
from trainer.optim.qk_clip import QKClip


def full_scores(q, k):
    """[b, heads, s, S] scaled scores, k heads repeated for GQA: the plain formula."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bshd,bthd->bhst", q.double(), k.double()) / math.sqrt(q.shape[-1])


def masked_max(scores, allowed):  # allowed [b or 1, s, S]
    return scores.masked_fill(~allowed[:, None], float("-inf")).amax(dim=(0, 2, 3))


@pytest.mark.parametrize("heads,kv", [(4, 4), (4, 2)])
def test_maxima_equal_the_masked_score_matrix(monkeypatch, heads, kv):
    monkeypatch.setattr(logits, "CHUNK", 5)  # several chunks, a partial last one
    gen = torch.Generator().manual_seed(0)
    b, s, d = 2, 12, 8
    q, k = torch.randn(b, s, heads, d, generator=gen), torch.randn(b, s, kv, d, generator=gen)
    scores = full_scores(q, k)
    causal = torch.ones(s, s).tril().bool()[None]
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 3 + [1] * 4 + [2] * 5])
    same = docs[:, :, None] == docs[:, None, :]
    for mask, allowed in (
        (None, causal),
        (docs, same & causal),
        (build_mask(docs, "sdpa", torch.float32), same & causal),
    ):
        got = logits.max_logits(q, k, logits.allowed_for(mask, s))
        torch.testing.assert_close(got.double(), masked_max(scores, allowed), atol=1e-5, rtol=0)
    # context parallelism's shape: the last 4 queries over all 12 keys, causal
    got = logits.max_logits(q[:, -4:], k)
    want = masked_max(full_scores(q[:, -4:], k), causal[:, -4:])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)


def test_attend_raises_the_buffer_on_every_path():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 10, 4, 8, generator=gen) for _ in range(3))
    docs = torch.tensor([[0] * 4 + [1] * 6, [0] * 10])
    for mask in (None, docs, build_mask(docs, "sdpa", torch.float32)):
        buf = torch.full((4,), float("-inf"))
        out = attend(q, k, v, mask, logit_max=buf)
        torch.testing.assert_close(out, attend(q, k, v, mask))  # the output is untouched
        want = logits.max_logits(q, k, logits.allowed_for(mask, 10))
        torch.testing.assert_close(buf, want)
        before = buf.clone()
        attend(q * 0.5, k, v, mask, logit_max=buf)  # a smaller microbatch: the max stays
        torch.testing.assert_close(buf, before)


def _model(flavor: str):
    torch.manual_seed(0)
    model = build_model(model_args(flavor, vocab_size=256, max_seq_len=32))
    model.to_empty(device="cpu")
    model.init_weights(0)
    return model


def _hand_maxima(model, tokens):
    """Each layer's per-head max logit, from the modules' own projections and the full score
    matrix (causal)."""
    out, h = [], model.tok_embeddings(tokens)
    cos, sin, _ = model.attention_inputs(tokens.shape[1], None, None, h.dtype)
    causal = torch.ones(tokens.shape[1], tokens.shape[1]).tril().bool()[None]
    for layer in model.layers.values():
        q, k, _ = layer.attention.project(layer.attention_norm(h), cos, sin)
        out.append(masked_max(full_scores(q, k), causal))
        h = layer(h, cos, sin)
    return torch.stack(out).float()


@pytest.mark.parametrize("flavor", ["debugmodel-tiny", "debugmodel-dsv3"])
def test_clip_scales_the_heads_over_the_threshold_and_no_other(flavor):
    model = _model(flavor)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        hand = _hand_maxima(model, tokens)
    tau = float(hand.flatten().sort().values[hand.numel() // 2])  # about half the heads
    clip = QKClip(model, model.args, tau)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        model(tokens)
    stats = clip.step()
    assert math.isclose(stats["qk_clip/max_logit"].item(), hand.max().item(), rel_tol=1e-5)
    over = hand > tau
    assert 0 < int(stats["qk_clip/heads_clipped"]) == int(over.sum())
    gamma = torch.where(over, tau / hand, torch.ones_like(hand))
    a = model.args
    for i, layer in enumerate(model.layers.values()):
        att, name = layer.attention, f"layers.{i}.attention"
        g = gamma[i]
        if a.mla is not None:
            m = a.mla
            q_rows = torch.cat(
                [
                    g.sqrt()[:, None].expand(-1, m.qk_nope_head_dim),
                    g[:, None].expand(-1, m.qk_rope_head_dim),
                ],
                1,
            ).reshape(-1)
            k_rows = torch.cat(
                [
                    g.sqrt()[:, None].expand(-1, m.qk_nope_head_dim),
                    torch.ones(a.n_heads, m.v_head_dim),
                ],
                1,
            ).reshape(-1)
            q_name = "wq_b" if m.q_lora_rank else "wq"
            expect = {f"{name}.{q_name}.weight": q_rows, f"{name}.wkv_b.weight": k_rows}
        elif a.n_kv_heads == a.n_heads:
            rows = g.sqrt().repeat_interleave(a.head_dim)
            expect = {f"{name}.wq.weight": rows, f"{name}.wk.weight": rows}
        else:  # GQA: the query heads alone
            expect = {f"{name}.wq.weight": g.repeat_interleave(a.head_dim)}
        for pname, rows in expect.items():
            got = dict(model.named_parameters())[pname]
            torch.testing.assert_close(got, before[pname] * rows[:, None], rtol=1e-6, atol=0)
        for pname, p in att.named_parameters(prefix=name):
            if pname not in expect:
                assert torch.equal(p, before[pname]), pname  # values, wo, norms, latents
    # the same inputs now give at most tau on the clipped heads, and the rest as before
    with torch.no_grad():
        after = _hand_maxima(model, tokens)
    torch.testing.assert_close(
        after[0][over[0]], torch.full_like(after[0][over[0]], tau), rtol=1e-5, atol=0
    )


def test_a_skipped_step_and_a_non_finite_maximum_clip_nothing():
    model = _model("debugmodel-tiny")
    clip = QKClip(model, model.args, 1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tokens = torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        model(tokens)
    assert int(clip.step(skip=torch.ones(()))["qk_clip/heads_clipped"]) == 0
    model.layers["0"].attention.logit_max.fill_(float("inf"))
    clip.step()
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n


def test_a_qk_normed_layer_clips_its_norms_to_tau_and_leaves_wq_alone():
    """Qwen3's per-head q/k RMSNorm divides out any scale of wq's rows: the clip scales the
    norms' weights instead (the layer as one), so the same inputs give exactly tau after one
    clip, and wq/wk never shrink however often the clip runs."""
    model = _model("debugmodel-moe-narrow")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hand = _hand_maxima(model, tokens)
    tau = 0.5 * float(hand[0].max())
    clip = QKClip(model, model.args, tau)
    att = model.layers["0"].attention
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for _ in range(4):
        with torch.no_grad():
            model(tokens)
        clip.step()
    for name, p in model.named_parameters():
        if not name.endswith(("q_norm.weight", "k_norm.weight")):
            assert torch.equal(p, before[name]), name  # wq, wk and the rest untouched
    factor = math.sqrt(tau / float(hand[0].max()))
    for norm in ("q_norm", "k_norm"):  # one clip of layer 0: its inputs never changed
        got = getattr(att, norm).weight
        torch.testing.assert_close(got, before[f"layers.0.attention.{norm}.weight"] * factor)
    with torch.no_grad():
        after = _hand_maxima(model, tokens)
    assert math.isclose(float(after[0].max()), tau, rel_tol=1e-5)
    assert bool((after <= tau * (1 + 1e-5)).all()), (after, tau)


def test_qwen3_next_gated_attention_records_and_clips():
    """Qwen3-Next's gated full-attention layers record their maxima and clip through their
    zero-centred q/k norms (1 + w scaled); the DeltaNet layers have no softmax logits."""
    model = _model("debugmodel-qwen3-next")
    a = model.args
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(4))
    clip = QKClip(model, a, 1e9)
    full = [r for r, _, _ in clip.layers]
    assert full == [i for i in range(a.n_layers) if a.hybrid.layer_type(i) == "full_attention"]
    with torch.no_grad():
        model(tokens)
    seen = clip.maxima()
    first = full[0]
    assert bool(torch.isfinite(seen[first]).all()), seen
    tau = 0.5 * float(seen[first].max())
    clip.threshold = tau
    with torch.no_grad():
        model(tokens)
    stats = clip.step()
    assert int(stats["qk_clip/heads_clipped"]) > 0
    with torch.no_grad():  # the layers before the first full attention are DeltaNets: the
        model(tokens)  # same inputs reach it, so its largest logit is now tau
    assert math.isclose(float(clip.maxima()[first].max()), tau, rel_tol=1e-4)


def test_evaluation_forwards_do_not_feed_the_clip():
    model = _model("debugmodel-tiny")
    clip = QKClip(model, model.args, 1e-3)
    with torch.no_grad():
        model.eval()(torch.randint(0, 256, (1, 8)))
    assert not bool(torch.isfinite(clip.maxima()).any())
