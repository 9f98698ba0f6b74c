"""gpt-oss (trainer/models/gpt_oss/, docs/gpt_oss.md) against transformers 5.24's
GptOssForCausalLM and the releases' own files, in one process.

The debug flavor with a sliding window (16) shorter than the sequence, biases and sinks drawn
away from zero: logits equal transformers'; a training step (loss, every gradient, the AdamW
update) equals transformers' step on the same batch; with the releases' YaRN the RoPE tables
equal transformers' from the released config.json; packed documents each give their own loss
(windows and documents both masked); an MXFP4 folder (the release format, quantized here from
the model's experts) imports to exactly what transformers dequantizes; the released
config.json files check against their flavors, and a folder of another shape is one line.
"""

import dataclasses
import json
import math

import pytest
import torch

from tests.helpers import REPO
from trainer.errors import ConfigError
from trainer.models.build import build_model
from trainer.models.flavors import model_args
from trainer.models.gpt_oss import hf as release
from trainer.models.gpt_oss.flavors import GPT_OSS_YARN

FLAVOR = "debugmodel-gpt-oss"
RELEASES = REPO / "tests" / "data" / "releases"


def _ours(seq=64, vocab=512, **changes):
    torch.manual_seed(0)
    args = dataclasses.replace(model_args(FLAVOR, vocab_size=vocab, max_seq_len=seq), **changes)
    model = build_model(args).to_empty(device="cpu")
    model.init_weights(0)
    with torch.no_grad():  # biases and sinks start at zero: make them count
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith((".bias", "sinks", ".b1", ".b2", ".b3")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _theirs(model):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = release.release_config(model.args, dtype="float32", bos_id=None, eos_id=None)
    cfg.pop("torch_dtype")
    ref = GptOssForCausalLM(GptOssConfig(**cfg))
    ours = {n: p.detach().clone() for n, p in model.named_parameters()}
    missing, unexpected = ref.load_state_dict(release.to_release(ours, model.args), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return ref


def _batch(vocab=512, seq=48, seed=2):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, seq + 1), generator=gen)


@pytest.mark.parametrize(
    "flavor, total, active",
    [("gpt-oss-20b", 20.9e9, 3.6e9), ("gpt-oss-120b", 116.8e9, 5.1e9), (FLAVOR, None, None)],
)
def test_the_parameter_count_is_the_models(flavor, total, active):
    """As the model card counts them (20b: 20.9B, 3.6B active; 120b: 116.8B, 5.1B)."""
    args = model_args(flavor)
    with torch.device("meta"):
        model = build_model(args)
    assert args.num_params() == sum(p.numel() for p in model.parameters())
    if total:
        assert abs(args.num_params() - total) / total < 0.005, args.num_params()
        active_blocks = args.num_params(embeddings=False, active=True)  # as the card counts
        assert abs(active_blocks - active) / active < 0.02, active_blocks


@pytest.mark.parametrize("yarn", [False, True])
def test_logits_equal_transformers_with_sinks_and_windows(yarn):
    """A window of 16 in layers 0 and 2 over 48 tokens, 2 query heads per key head."""
    model = _ours(rope_scaling=GPT_OSS_YARN if yarn else None).eval()
    ref = _theirs(model).eval()
    tokens = _batch()[:, :-1]
    with torch.no_grad():
        ours, theirs = model(tokens), ref(tokens).logits
    assert (ours - theirs).abs().max() < 1e-5, (ours - theirs).abs().max()
    assert [b.attention.window for b in model.layers.values()] == [16, 0, 16, 0]
    with torch.no_grad():  # the windows matter: without them later tokens see more keys
        for block in model.layers.values():
            block.attention.window = 0
        assert (model(tokens) - ours).abs().max() > 1e-3


def test_a_training_step_equals_transformers():
    """Loss, every parameter's gradient and the AdamW update on the same batch."""
    model = _ours().train()
    ref = _theirs(model).train()
    batch = _batch()
    inputs, labels = batch[:, :-1], batch[:, 1:]
    ours_loss = torch.nn.functional.cross_entropy(model(inputs).flatten(0, 1), labels.flatten())
    theirs_loss = ref(inputs, labels=None).logits.flatten(0, 1)
    theirs_loss = torch.nn.functional.cross_entropy(theirs_loss, labels.flatten())
    assert abs(ours_loss.item() - theirs_loss.item()) < 1e-6
    ours_loss.backward()
    theirs_loss.backward()
    grads = release.to_release({n: p.grad for n, p in model.named_parameters()}, model.args)
    for name, p in ref.named_parameters():
        scale = p.grad.abs().max().item()
        assert (grads[name] - p.grad).abs().max().item() <= 1e-5 * max(scale, 1e-3), name
    sinks = model.layers["0"].attention.sinks.grad
    assert sinks.abs().max() > 0  # the sinks learn
    for m in (model, ref):
        # eps 1e-6: an update g / (|g| + eps) moves by 1/eps per unit of g, so near-zero
        # gradients that agree to 1e-12 give updates that agree to 1e-6 of the lr
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6, weight_decay=0.1)
        opt.step()
    after = release.to_release({n: p.detach() for n, p in model.named_parameters()}, model.args)
    for name, p in ref.named_parameters():
        assert (after[name] - p.detach()).abs().max() < 1e-5, name


def test_rope_tables_equal_transformers_from_the_released_config():
    """YaRN 32 over 4,096 positions, truncate false: cos and sin as transformers builds them
    from gpt-oss-20b's config.json."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    cfg = json.loads((RELEASES / "gpt-oss-20b" / "config.json").read_text())
    cfg.pop("quantization_config")
    rotary = GptOssRotaryEmbedding(GptOssConfig(**cfg))
    positions = torch.arange(0, 8192, 7)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    from trainer.models.common.layers import rope_tables

    args = model_args("gpt-oss-20b")
    ours_cos, ours_sin = rope_tables(
        args.rope_dim, 8192, args.rope_theta, scaling=args.rope_scaling
    )
    assert (ours_cos[positions[0]] - cos[0]).abs().max() < 1e-5
    assert (ours_sin[positions[0]] - sin[0]).abs().max() < 1e-5


def test_packed_documents_each_give_their_own_loss():
    """Three documents (30, 1, 33 tokens) in one window under block_causal: each token's
    loss equals its document's alone (the windows of 16 inside the long ones)."""
    model = _ours(attn_mask_type="block_causal").eval()
    lengths = (30, 1, 33)
    tokens = _batch(seq=sum(lengths))[:1]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]
    ce = torch.nn.functional.cross_entropy
    with torch.no_grad():
        packed = ce(model(inputs, doc_ids=doc_ids)[0], labels[0], reduction="none")
        start = 0
        for n in lengths:
            piece = slice(start, start + n)
            alone = model(inputs[:, piece], doc_ids=torch.zeros(1, n, dtype=torch.long))
            own = ce(alone[0], labels[0, piece], reduction="none")
            assert (packed[piece] - own).abs().max() < 1e-5, n
            start += n


def test_windowed_layers_count_their_window_in_the_flops():
    from trainer.models.flops import block_attention_flops

    args = model_args("gpt-oss-20b")
    d = args.head_dim
    assert block_attention_flops(args, 0, 4096) == 12 * 64 * d * 128  # sliding: 128 keys
    assert block_attention_flops(args, 1, 4096) == 12 * 64 * d * 4096  # full
    half = block_attention_flops(args, 0, 4096, causal_half=True)
    assert half == pytest.approx(12 * 64 * d * (128 - 127 * 128 / 2 / 4096))


# ------------------------------------------------------------------------------ MXFP4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (blocks [E, out, in / 32, 16] uint8, scales [E, out, in / 32] uint8):
    per group of 32 an e8m0 exponent putting the largest magnitude at most 6, each value the
    nearest e2m1 (the OCP MX format, as the releases store their experts)."""
    groups = rows.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    nearest = (scaled.abs()[..., None] - E2M1).abs().argmin(-1)
    codes = nearest + 8 * (scaled < 0)
    pairs = codes.unflatten(-1, (16, 2))
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def _write_folder(folder, model, mxfp4: bool):
    from safetensors.torch import save_file

    ours = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors = release.to_release(ours, model.args)
    cfg = release.release_config(model.args, dtype="float32", bos_id=None, eos_id=None)
    if mxfp4:
        cfg["quantization_config"] = {"quant_method": "mxfp4"}
        for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))]:
            blocks, scales = quantize_mxfp4(tensors.pop(key).transpose(1, 2))
            tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
    folder.mkdir()
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return tensors


def test_an_mxfp4_folder_imports_as_transformers_dequantizes_it(tmp_path):
    """Every tensor of the import equals transformers' own dequantization of the folder's
    MXFP4 experts (convert_moe_packed_tensors), the rest the folder's bf16/fp32 tensors."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from trainer.hf.load import load_hf

    model = _ours()
    stored = _write_folder(tmp_path / "mxfp4", model, mxfp4=True)
    fresh = _ours()
    fresh.init_weights(7)  # not the folder's: every tensor must come from it
    load_hf(fresh, str(tmp_path / "mxfp4"), flavor=FLAVOR, log=lambda line: None)
    got = release.to_release({n: p.detach() for n, p in fresh.named_parameters()}, fresh.args)
    for key, t in got.items():
        if key.endswith(("gate_up_proj", "down_proj")):
            want = convert_moe_packed_tensors(
                stored[key + "_blocks"], stored[key + "_scales"], dtype=torch.float32
            )
            assert torch.equal(t, want), key
            assert (
                t
                - release.to_release(
                    {n: p.detach() for n, p in model.named_parameters()}, model.args
                )[key]
            ).abs().max() > 0  # quantized: not the original weights
        else:
            assert torch.equal(t, stored[key]), key


def test_an_unquantized_folder_imports_bit_for_bit(tmp_path):
    from trainer.hf.load import load_hf

    model = _ours()
    _write_folder(tmp_path / "bf16", model, mxfp4=False)
    fresh = _ours()
    fresh.init_weights(7)
    load_hf(fresh, str(tmp_path / "bf16"), flavor=FLAVOR, log=lambda line: None)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name


# ------------------------------------------------------------------------------ config.json


@pytest.mark.parametrize("size", ["20b", "120b"])
def test_the_released_config_json_is_its_flavor(size):
    cfg = json.loads((RELEASES / f"gpt-oss-{size}" / "config.json").read_text())
    release.check_config(cfg, model_args(f"gpt-oss-{size}"), "folder", f"gpt-oss-{size}")


def test_a_folder_of_another_size_is_one_line():
    cfg = json.loads((RELEASES / "gpt-oss-20b" / "config.json").read_text())
    with pytest.raises(ConfigError, match="num_hidden_layers is 24, the flavor's 36"):
        release.check_config(cfg, model_args("gpt-oss-120b"), "folder", "gpt-oss-120b")
    other = {**cfg, "sliding_window": 256}
    with pytest.raises(ConfigError, match="sliding_window is 256"):
        release.check_config(other, model_args("gpt-oss-20b"), "folder", "gpt-oss-20b")


def test_mxfp4_refuses_blocks_that_do_not_fit_their_scales():
    blocks = torch.zeros(2, 4, 3, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="16 bytes per scale"):
        release.dequantize_mxfp4(blocks, torch.zeros(2, 4, 2, dtype=torch.uint8))
    ones = release.dequantize_mxfp4(
        torch.full((1, 1, 1, 16), 0x22, dtype=torch.uint8),
        torch.full((1, 1, 1), 128, dtype=torch.uint8),
    )
    assert torch.equal(ones, torch.full((1, 1, 32), 2.0))  # code 2 = 1.0, x 2^(128 - 127)
    assert math.isfinite(ones.sum().item())


def test_the_120b_config_is_traced_to_fit_h100s():
    """configs/gpt_oss_120b.toml at its world size (8 nodes of 8): rank 0's step on fake
    tensors fits an H100 with the reserve, the plan within 10% of the trace."""
    import subprocess

    from tests.helpers import fork_python

    python, env = fork_python()
    out = subprocess.run(
        [
            python,
            "-m",
            "trainer.plan",
            *("--config", str(REPO / "configs" / "gpt_oss_120b.toml")),
            *("--ngpu", "8", "--nnodes", "8", "--gpu", "h100", "--host-gib", "2048"),
            "--trace",
            *("--model.attn_mask_type", "causal"),  # block_causal's FlexAttention needs CUDA
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "trace verdict: FITS" in text and "agreement: the plan is within 10%" in text, text


def test_the_plan_books_what_a_block_saves():
    """The memory plan's per-token bytes of a block (trainer/models/gpt_oss/plan.py) against
    the tensors autograd saves in one full-attention block's forward (fp32, 256 tokens; the CPU
    kernel's K/V repeated to the query heads taken out: on CUDA FlexAttention keeps them at
    the key heads)."""
    from trainer.models.gpt_oss.plan import block_split

    model = _ours(seq=256)
    a = model.args
    params = {t.data_ptr() for t in [*model.parameters(), *model.buffers()]}
    tokens = 256
    x = torch.randn(1, tokens, a.dim, requires_grad=True)
    cos, sin, masks = model.attention_inputs(tokens, None, None, x.dtype)
    saved = {}

    def pack(t):
        if t.data_ptr() not in params and t.numel() >= tokens:  # per-token tensors
            saved[(t.data_ptr(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers["1"](x, cos, sin, masks)
    q, kv = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
    measured = sum(saved.values()) / tokens - 2 * (q - kv) * 4
    planned = sum(block_split(a, 4, 1, 1))
    assert abs(planned / measured - 1) < 0.04, (planned, measured)
