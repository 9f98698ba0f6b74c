"""Qwen3-Next's hybrid layers against transformers 5.24 (fp32, CPU, one process):

- the chunked Gated DeltaNet equals the token-by-token recurrence and transformers' torch
  kernels (torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), with and without an
  initial state, at lengths that are not multiples of the chunk;
- packed documents: the kernel, and a Gated DeltaNet layer, on a packed window give each
  document's own outputs (state and convolution restarted); a window split in two with the state
  passed on gives the unsplit outputs (what context parallelism will do);
- a small Qwen3NextForCausalLM and Qwen3_5MoeForCausalLM, saved by transformers and read through
  trainer/models/qwen3_next/hf.py into our model, give the same logits; our export holds the same
  tensors under the same names.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from trainer.models.qwen3_next.deltanet import (
    chunk_gated_delta_rule,
    kernel_name,
    recurrent_gated_delta_rule,
)
from trainer.models.qwen3_next.hf import args_from_config, from_release, to_release
from trainer.models.qwen3_next.model import GatedDeltaNet, Qwen3Next

transformers = pytest.importorskip("transformers")
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n  # noqa: E402

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    full_attention_interval=2,
    max_position_embeddings=256,
)


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
    refs = [
        recurrent_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, **kw),
        hf_q3n.torch_chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw),
        hf_q3n.torch_recurrent_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw
        ),
    ]
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
    for row, (a, b) in [(0, (0, 30)), (0, (30, 64)), (0, (64, 65)), (0, (65, 150)), (1, (64, 150))]:
        part = [x[row : row + 1, a:b] for x in (q, k, v, g, beta)]
        init = h0[row : row + 1] if a == 0 else None  # the initial state enters the first document
        alone, last = chunk_gated_delta_rule(
            *part, initial_state=init, output_final_state=True, use_qk_l2norm=True
        )
        torch.testing.assert_close(o[row : row + 1, a:b], alone, atol=1e-6, rtol=0)
        if b == 150:
            torch.testing.assert_close(state[row : row + 1], last, atol=1e-6, rtol=0)


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
            alone = layer(x[row : row + 1, a:b])
            torch.testing.assert_close(packed[row : row + 1, a:b], alone, atol=1e-6, rtol=0)
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
        torch.testing.assert_close(model.eval()(tokens), hf_model(tokens).logits, atol=1e-4, rtol=0)
    back = to_release(ours, args, family)
    assert back.keys() == released.keys()
    assert all(torch.equal(back[k], released[k]) for k in released)
    # a run's import (checkpoint.initial_load_in_hf): the folder, a layer at a time
    from trainer.hf.load import load_hf

    imported = Qwen3Next(args)
    load_hf(imported, str(tmp_path), flavor="tiny")
    assert all(torch.equal(t, model.state_dict()[k]) for k, t in imported.state_dict().items())


def _as_released(folder) -> dict:
    """The folder's config.json in the form of the releases' (transformers 4.57): the RoPE
    keys at the top level, no layer_types (only full_attention_interval), and the YaRN
    context extension of the model cards' long-context note as a legacy rope_scaling."""
    cfg = json.loads((folder / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    assert cfg.pop("layer_types") == ["linear_attention", "full_attention"] * 2
    cfg["full_attention_interval"] = 2  # (transformers 5 writes the list instead)
    cfg["rope_theta"], cfg["partial_rotary_factor"] = (
        rope["rope_theta"],
        rope["partial_rotary_factor"],
    )
    cfg["rope_scaling"] = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    return cfg


def test_a_release_form_config_imports_and_equals_transformers(tmp_path):
    from safetensors.torch import load_file

    from trainer.errors import ConfigError
    from trainer.models.common.rope import YarnScaling
    from trainer.models.qwen3_next.hf import check_release_config

    torch.manual_seed(0)
    _hf_model("qwen3_next").save_pretrained(tmp_path)
    cfg = _as_released(tmp_path)
    hf_model = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    args = args_from_config(cfg)
    assert args.rope_scaling == YarnScaling(
        factor=4.0, original_max_position_embeddings=32, mscale=0.0, mscale_all_dim=0.0
    )
    assert [args.hybrid.layer_type(i) for i in range(4)] == hf_model.config.layer_types
    model = Qwen3Next(args)
    model.load_state_dict(from_release(load_file(tmp_path / "model.safetensors"), args))
    model.init_rope()
    tokens = torch.randint(0, 128, (2, 80))  # past the 32 positions YaRN extends
    with torch.no_grad():
        want = hf_model.eval()(tokens).logits
        torch.testing.assert_close(model.eval()(tokens), want, atol=1e-4, rtol=0)
        plain = Qwen3Next(replace(args, rope_scaling=None))
        plain.load_state_dict(model.state_dict())
        plain.init_rope()
        assert (plain.eval()(tokens) - want).abs().max() > 1e-2  # the YaRN counts
    with pytest.raises(ConfigError) as e:  # a run without the YaRN keys is told them
        check_release_config(cfg, replace(args, rope_scaling=None), str(tmp_path), "tiny")
    assert (
        "model.rope_scaling = 'yarn', model.yarn_factor = 4, "
        "model.yarn_original_max_position_embeddings = 32" in str(e.value)
    )
    check_release_config(cfg, args, str(tmp_path), "tiny")


# ------------------------------------------------------------------- multi-token prediction

MTP_TINY = dict(TINY, intermediate_size=96)  # every layer MoE (decoder_sparse_step 1: the release)


@pytest.fixture(scope="module")
def mtp_release(tmp_path_factory):
    """A tiny Qwen3NextForCausalLM folder with the release's MTP module added by hand: its
    block from transformers' own full-attention decoder layer (the release's `mtp.layers.0`
    names and shapes), fc [dim, 2 dim] and three norms; every tensor away from its init."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("mtp_release")
    torch.manual_seed(0)
    cfg = transformers.Qwen3NextConfig(**MTP_TINY)
    _randomised(transformers.Qwen3NextForCausalLM(cfg)).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    block = hf_q3n.Qwen3NextDecoderLayer(cfg, layer_idx=1)  # layer 1: full attention
    assert cfg.layer_types[1] == "full_attention"
    with torch.no_grad():  # a bare layer skips _init_weights: its stacked experts are torch.empty
        for p in (block.mlp.experts.gate_up_proj, block.mlp.experts.down_proj):  # (NaN at times)
            p.normal_(0.0, cfg.initializer_range)
    layer = _randomised(block).state_dict()
    gate, up = layer.pop("mlp.experts.gate_up_proj").chunk(2, dim=1)  # as the release: per expert
    stacked = {"gate_proj": gate, "up_proj": up, "down_proj": layer.pop("mlp.experts.down_proj")}
    layer.update(
        {
            f"mlp.experts.{e}.{w}.weight": t[e]
            for w, t in stacked.items()
            for e in range(cfg.num_experts)
        }
    )
    # the names a main full-attention layer has in the saved folder (layer 1), under mtp.layers.0
    assert {
        k.removeprefix("model.layers.1.") for k in tensors if k.startswith("model.layers.1.")
    } == set(layer)
    mtp = {f"mtp.layers.0.{n}": t.contiguous() for n, t in layer.items()}
    d = cfg.hidden_size
    gen = torch.Generator().manual_seed(5)
    mtp["mtp.fc.weight"] = 0.05 * torch.randn(d, 2 * d, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.2 * torch.randn(d, generator=gen)  # zero-centred
    save_file({**tensors, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, mtp


def _randomised(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or "A_log" in name or "dt_bias" in name:
                p.add_(0.2 * torch.randn_like(p))
    return module.eval()


def _mtp_model(folder):
    from trainer.hf.load import load_hf

    args = args_from_config(json.loads((folder / "config.json").read_text()), mtp_layers=1)
    model = Qwen3Next(args)
    lines = []
    load_hf(model, str(folder), flavor="tiny", log=lines.append)
    model.init_rope()
    return model, lines


def test_the_release_mtp_module_imports_and_exports_bit_for_bit(mtp_release):
    from safetensors.torch import load_file

    folder, mtp = mtp_release
    model, lines = _mtp_model(folder)
    assert any("module 0 from the release's mtp.*" in ln for ln in lines), lines
    ours = model.state_dict()
    pairs = {
        "mtp.0.proj.weight": "mtp.fc.weight",
        "mtp.0.embed_norm.weight": "mtp.pre_fc_norm_embedding.weight",
        "mtp.0.hidden_norm.weight": "mtp.pre_fc_norm_hidden.weight",
        "mtp.0.norm.weight": "mtp.norm.weight",
        "mtp.0.block.attention.wq.weight": "mtp.layers.0.self_attn.q_proj.weight",
        "mtp.0.block.ffn_norm.weight": "mtp.layers.0.post_attention_layernorm.weight",
        "mtp.0.block.feed_forward.shared_expert_gate.weight": "mtp.layers.0.mlp."
        "shared_expert_gate.weight",
    }
    for name, key in pairs.items():
        assert torch.equal(ours[name], mtp[key]), name
    assert torch.equal(
        ours["mtp.0.block.feed_forward.experts.w2"][3],
        mtp["mtp.layers.0.mlp.experts.3.down_proj.weight"],
    )
    released = load_file(folder / "model.safetensors")
    back = to_release({n: t for n, t in ours.items()}, model.args)
    assert back.keys() == released.keys()
    assert all(torch.equal(back[k], released[k]) for k in released)
    # the folder without its MTP module: the module keeps its init, said in one line
    plain = Qwen3Next(model.args)
    plain.init_weights(0)
    before = plain.state_dict()["mtp.0.proj.weight"].clone()
    from safetensors.torch import save_file

    from trainer.hf.load import load_hf

    bare = folder.parent / "bare"
    bare.mkdir(exist_ok=True)
    (bare / "config.json").write_text((folder / "config.json").read_text())
    save_file(
        {k: t for k, t in released.items() if not k.startswith("mtp.")},
        bare / "model.safetensors",
        metadata={"format": "pt"},
    )
    lines = []
    load_hf(plain, str(bare), flavor="tiny", log=lines.append)
    assert torch.equal(plain.state_dict()["mtp.0.proj.weight"], before)
    assert any("starts from its seeded init" in ln for ln in lines), lines


def _zc_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _mtp_by_hand(t, h, next_tokens, cfg):
    """Depth 1's logits [b, s, vocab] with plain torch ops from the release's tensors `t`:
    h (the main model's last layer output after its final norm), the next tokens' embeddings
    -> the fc over the zero-centred norms -> a gated-attention decoder layer with the
    gated-shared MoE -> norm -> lm_head."""
    eps, p = cfg["rms_norm_eps"], "mtp.layers.0."
    b, s, d = h.shape
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    emb = t["model.embed_tokens.weight"][next_tokens]
    x = (
        torch.cat(
            (
                _zc_norm(emb, t["mtp.pre_fc_norm_embedding.weight"], eps),
                _zc_norm(h, t["mtp.pre_fc_norm_hidden.weight"], eps),
            ),
            -1,
        )
        @ t["mtp.fc.weight"].T
    )
    a = _zc_norm(x, t[p + "input_layernorm.weight"], eps)
    qg = (a @ t[p + "self_attn.q_proj.weight"].T).view(b, s, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(b, s, -1)
    k = (a @ t[p + "self_attn.k_proj.weight"].T).view(b, s, nkv, hd)
    v = (a @ t[p + "self_attn.v_proj.weight"].T).view(b, s, nkv, hd)
    q, k = (
        _zc_norm(q, t[p + "self_attn.q_norm.weight"], eps),
        _zc_norm(k, t[p + "self_attn.k_norm.weight"], eps),
    )
    r = int(hd * cfg["rope_parameters"]["partial_rotary_factor"]) // 2
    inv = 1.0 / cfg["rope_parameters"]["rope_theta"] ** (torch.arange(r) * 2.0 / (2 * r))
    ang = torch.arange(s)[:, None] * inv[None]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]

    def rope(z):
        z1, z2 = z[..., :r], z[..., r : 2 * r]
        return torch.cat((z1 * cos - z2 * sin, z2 * cos + z1 * sin, z[..., 2 * r :]), -1)

    q, k = rope(q).transpose(1, 2), rope(k).repeat_interleave(nh // nkv, 2).transpose(1, 2)
    v = v.repeat_interleave(nh // nkv, 2).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)) / hd**0.5
    scores = scores.masked_fill(torch.ones(s, s).triu(1).bool(), float("-inf"))
    att = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, -1)
    x = x + (att * gate.sigmoid()) @ t[p + "self_attn.o_proj.weight"].T
    m = _zc_norm(x, t[p + "post_attention_layernorm.weight"], eps)

    def swiglu(z, pre):
        return (
            torch.nn.functional.silu(z @ t[pre + "gate_proj.weight"].T)
            * (z @ t[pre + "up_proj.weight"].T)
        ) @ t[pre + "down_proj.weight"].T

    probs = (m @ t[p + "mlp.gate.weight"].T).softmax(-1)
    top, idx = probs.topk(cfg["num_experts_per_tok"], -1)
    top = top / top.sum(-1, keepdim=True)
    moe = sum(
        top[..., j : j + 1]
        * torch.stack([swiglu(m, f"{p}mlp.experts.{e}.") for e in range(cfg["num_experts"])], -2)
        .gather(-2, idx[..., j : j + 1, None].expand(b, s, 1, d))
        .squeeze(-2)
        for j in range(cfg["num_experts_per_tok"])
    )
    shared = (m @ t[p + "mlp.shared_expert_gate.weight"].T).sigmoid() * swiglu(
        m, p + "mlp.shared_expert."
    )
    x = x + moe + shared
    return _zc_norm(x, t["mtp.norm.weight"], eps) @ t["lm_head.weight"].T


def test_the_mtp_loss_equals_a_hand_computation(mtp_release):
    """Depth 1 predicts token i + 2 at position i from the hidden state after the last layer
    (before the final norm) and token i + 1's embedding: the model's MTP loss (its sum, and
    its weighted share of the training loss) equals the same forward by hand."""
    from safetensors.torch import load_file

    from trainer.models.common.loss import build_loss

    folder, _ = mtp_release
    model, _ = _mtp_model(folder)
    release = load_file(folder / "model.safetensors")
    cfg = json.loads((folder / "config.json").read_text())
    tokens = torch.randint(0, 128, (2, 41), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    last = {}
    model.layers["3"].register_forward_hook(lambda mod, args, out: last.update(h=out))
    loss_fn = build_loss("chunked", 16)
    total = model.train()(inputs, labels=labels, loss_fn=loss_fn).detach()  # a training forward
    got = loss_fn.take_mtp_loss()
    with torch.no_grad():
        main = model.eval()(inputs, labels=labels, loss_fn=loss_fn)
        # the MTP module takes the last layer's output after the final norm (vLLM's, SGLang's)
        h = _zc_norm(last["h"], release["model.norm.weight"], cfg["rms_norm_eps"])
        logits = _mtp_by_hand(release, h, labels, cfg)
    want = torch.nn.functional.cross_entropy(
        logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), reduction="sum"
    )
    assert abs(got - want) <= 1e-5 * want, (got, want)
    assert abs((total - main) - model.args.mtp_loss_weight * want) <= 1e-5 * want


def test_packed_documents_give_their_documents_mtp_loss():
    """tests/test_mtp_documents.py's check on the hybrid (block_causal, 2 depths): a packed
    window's MTP loss equals its documents' taken alone, and it keeps exactly their targets."""
    from types import SimpleNamespace

    from tests.test_mtp_documents import EOS, documents_by_hand, mtp_sum, windows
    from trainer.data.documents import Delimiters, document_ids, split_window
    from trainer.models.build import build_model
    from trainer.models.common.loss import build_loss
    from trainer.models.common.mtp import IGNORE_INDEX, future_labels
    from trainer.models.flavors import model_args
    from trainer.parallel.forward_backward import microbatch_documents

    depth = 2
    model = build_model(
        model_args(
            "debugmodel-qwen3-next", max_seq_len=64, mtp_layers=depth, attn_mask_type="block_causal"
        )
    )
    model.to_empty(device="cpu").init_weights(0)
    model.train()
    d, win = Delimiters(None, EOS), windows(None, EOS)
    inputs, labels = split_window(win, d, True)
    loader = SimpleNamespace(
        document_ids=lambda x: document_ids(x, d), delimiters=d, predict_document_start=True
    )
    doc_ids, window = microbatch_documents(model, loader)(inputs, labels)
    loss_fn = build_loss("chunked", 16)
    future = future_labels(labels, depth, window)
    packed = mtp_sum(model, loss_fn, inputs, labels, doc_ids, future)
    alone, targets = 0.0, 0
    for row in win.tolist():
        for doc in documents_by_hand(row, None, EOS):
            if len(doc) < 3:
                continue
            t = torch.tensor([doc])
            alone += mtp_sum(model, loss_fn, t[:, :-1], t[:, 1:], torch.zeros_like(t[:, :-1]))
            targets += sum(max(len(doc) - 1 - k, 0) for k in range(1, depth + 1))
    assert abs(packed - alone) <= 1e-6 * alone, (packed, alone)
    assert int((future != IGNORE_INDEX).sum()) == targets
    crossing = mtp_sum(model, loss_fn, inputs, labels, doc_ids)  # targets not cut: differs
    assert abs(crossing - alone) > 1e-3 * alone


def test_more_mtp_modules_than_the_release_holds_are_refused_for_hugging_face():
    """The release has one fc and one set of norms: model.mtp_layers = 2 trains, but an
    export or import of it is one config error, before any rank starts."""
    from tests.helpers import REPO
    from trainer.config.job import load_config
    from trainer.errors import ConfigError

    base = ["--job.config_file", str(REPO / "configs" / "debug_qwen3_next.toml")]
    assert load_config([*base, "--model.mtp_layers", "2"]).model.mtp_layers == 2
    for hf in (
        ["--checkpoint.last_save_in_hf", "true"],
        [
            "--checkpoint.initial_load_in_hf",
            "true",
            "--checkpoint.initial_load_path",
            "/nonexistent",
        ],
    ):
        with pytest.raises(ConfigError, match="holds one MTP module"):
            load_config([*base, "--model.mtp_layers", "2", *hf])


@pytest.mark.parametrize(
    "version, used",
    [("0.6.0", True), ("0.7.2.dev1", True), ("0.4.2", False), ("", False)],
)
def test_fla_is_used_only_at_a_version_with_grouped_value_heads(monkeypatch, version, used):
    """fla < 0.6 took one value head per key head (half of Qwen3-Next's output heads left
    unwritten): it is not used, and the startup line says so; nor an fla of unknown version
    (a source install without metadata); 0.6 and later are."""
    import sys
    import types

    from trainer.models.qwen3_next import deltanet

    def kernel(*a, **k):
        return None

    fla = types.ModuleType("fla")
    if version:
        fla.__version__ = version
    ops = types.ModuleType("fla.ops")
    rule = types.ModuleType("fla.ops.gated_delta_rule")
    rule.chunk_gated_delta_rule = kernel
    for name, module in (("fla", fla), ("fla.ops", ops), ("fla.ops.gated_delta_rule", rule)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(deltanet, "_fla_version", lambda f: getattr(f, "__version__", None))
    deltanet._fla_found.cache_clear()
    try:
        assert (deltanet._fla() is kernel) == used
        line = deltanet.kernel_name("cuda")
        assert line.startswith("fla chunk_gated_delta_rule" if used else "torch chunked"), line
        if not used:
            assert "needs fla-core >= 0.6" in line, line
    finally:
        deltanet._fla_found.cache_clear()
