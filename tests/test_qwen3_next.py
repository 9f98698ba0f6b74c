"""Qwen3-Next's hybrid layers against transformers 5.24 (fp32, CPU, one process):

- the chunked Gated DeltaNet equals the token-by-token recurrence and transformers' torch
  kernels (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), with and without an
  initial state, at lengths that are not multiples of the chunk;
- packed documents: the kernel, and a Gated DeltaNet layer, on a packed window give each
  document's own outputs (state and convolution restarted); a window split in two with the state
  passed on gives the unsplit outputs (what context parallelism will do);
- a small Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM, saved by transformers and read through
  trainer/hf/qwen3_next.py into our model, give the same logits; our export holds the same
  tensors under the same names.
"""

from __future__ import annotations

import json

import pytest
import torch

from trainer.hf.qwen3_next import args_from_config, from_release, to_release
from trainer.models.deltanet import (chunk_gated_delta_rule, kernel_name,
                                     recurrent_gated_delta_rule)
from trainer.models.qwen3_next import GatedDeltaNet, Qwen3Next

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n  # noqa: E402

TINY = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=32, shared_expert_intermediate_size=48,
            full_attention_interval=2, max_position_embeddings=256)


def _inputs(b=2, s=150, hk=2, hv=4, dk=16, dv=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(b, s, hk, dk, generator=gen), torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, hv, dv, generator=gen)
    g = -0.3 * torch.rand(b, s, hv, generator=gen)  # slow decays: the state carries far
    beta = torch.rand(b, s, hv, generator=gen)
    return q, k, v, g, beta, torch.randn(b, hv, dk, dv, generator=gen)


@pytest.mark.parametrize("seq", [37, 150])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrence_and_transformers(seq, with_state):
    q, k, v, g, beta, h0 = _inputs(s=seq)
    init = h0 if with_state else None
    kw = dict(initial_state=init, output_final_state=True)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, **kw)
    refs = [recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, **kw),
            hf_q3n.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                **kw),
            hf_q3n.torch_recurrent_gated_delta_rule(q, k, v, g, beta,
                                                    use_qk_l2norm_in_kernel=True, **kw)]
    for ref_o, ref_state in refs:
        torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)
    assert kernel_name("cpu").startswith("torch chunked")


def test_documents_restart_the_kernel_state():
    """Boundaries inside a chunk, exactly at a chunk's start (64) and a one-token document: the
    chunked kernel equals the recurrence with resets, and each document run alone."""
    q, k, v, g, beta, h0 = _inputs(s=150)
    docs = torch.tensor([[0] * 30 + [1] * 34 + [2] + [3] * 85, [7] * 64 + [8] * 86])
    kw = dict(initial_state=h0, output_final_state=True, doc_ids=docs, use_qk_l2norm=True)
    o, state = chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    ref_o, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    torch.testing.assert_close(o, ref_o, atol=1e-5, rtol=0)
    torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)
    for row, (a, b) in [(0, (0, 30)), (0, (30, 64)), (0, (64, 65)), (0, (65, 150)),
                        (1, (64, 150))]:
        part = [x[row:row + 1, a:b] for x in (q, k, v, g, beta)]
        init = h0[row:row + 1] if a == 0 else None  # the initial state enters the first document
        alone, last = chunk_gated_delta_rule(*part, initial_state=init, output_final_state=True,
                                             use_qk_l2norm=True)
        torch.testing.assert_close(o[row:row + 1, a:b], alone, atol=1e-6, rtol=0)
        if b == 150:
            torch.testing.assert_close(state[row:row + 1], last, atol=1e-6, rtol=0)


@pytest.fixture(scope="module")
def layer():
    """A Gated DeltaNet layer of the tiny config, initialised by our init, with slow decays
    (A = exp(A_log) ~ 0.02) so that any state or convolution tap across documents shows."""
    args = args_from_config(transformers.Qwen3NextConfig(**TINY, intermediate_size=96).to_dict())
    model = Qwen3Next(args)
    model.init_weights(seed=3)
    net = model.layers["0"].linear_attention
    with torch.no_grad():
        net.A_log.fill_(-4.0)
    return net.eval()


def test_packed_documents_equal_each_document_alone(layer: GatedDeltaNet):
    x = torch.randn(2, 90, 64, generator=torch.Generator().manual_seed(1))
    docs = torch.tensor([[0] * 20 + [1] * 2 + [2] * 68, [5] * 90])
    with torch.no_grad():
        packed = layer(x, docs)
        spans = [(0, 0, 20), (0, 20, 22), (0, 22, 90), (1, 0, 90)]
        for row, a, b in spans:
            alone = layer(x[row:row + 1, a:b])
            torch.testing.assert_close(packed[row:row + 1, a:b], alone, atol=1e-6, rtol=0)
        assert (packed[0, 22:] - layer(x[:1])[0, 22:]).abs().max() > 1e-3  # documents matter


def test_split_window_with_state_equals_whole(layer: GatedDeltaNet):
    """The convolutions' prefixes and the recurrent state passed from the first half give the
    unsplit window's outputs (documents crossing the split included)."""
    x = torch.randn(2, 100, 64, generator=torch.Generator().manual_seed(2))
    docs = torch.tensor([[0] * 45 + [1] * 55, [3] * 70 + [4] * 30])
    with torch.no_grad():
        whole = layer(x, docs)
        empty = ((None, None, None), None)
        first, state = layer.mix(x[:, :50], docs[:, :50], empty)
        second, _ = layer.mix(x[:, 50:], docs[:, 50:], state)
    torch.testing.assert_close(torch.cat((first, second), 1), whole, atol=1e-5, rtol=0)


def _hf_model(family: str):
    if family == "qwen3_next":
        cfg = transformers.Qwen3NextConfig(**TINY, intermediate_size=96, decoder_sparse_step=2)
        model = transformers.Qwen3NextForCausalLM(cfg)
    else:
        cfg = transformers.Qwen3_5MoeTextConfig(**TINY)
        model = transformers.Qwen3_5MoeForCausalLM(cfg)
    with torch.no_grad():  # away from the init's zeros and ones: every norm and gate counts
        for name, p in model.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe_text"])
def test_logits_equal_transformers(tmp_path, family):
    from safetensors.torch import load_file

    torch.manual_seed(0)
    hf_model = _hf_model(family)
    hf_model.save_pretrained(tmp_path)
    released = load_file(tmp_path / "model.safetensors")
    args = args_from_config(json.loads((tmp_path / "config.json").read_text()))
    ours = from_release(released, args)
    model = Qwen3Next(args)
    model.load_state_dict(ours, strict=True)
    model.init_rope()
    tokens = torch.randint(0, 128, (2, 80))
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), hf_model(tokens).logits,
                                   atol=1e-4, rtol=0)
    back = to_release(ours, args, family)
    assert back.keys() == released.keys()
    assert all(torch.equal(back[k], released[k]) for k in released)
    # a run's import (checkpoint.initial_load_in_hf): the folder, a layer at a time
    from trainer.hf.load import load_hf

    imported = Qwen3Next(args)
    load_hf(imported, str(tmp_path), flavor="tiny")
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in imported.state_dict().items())
