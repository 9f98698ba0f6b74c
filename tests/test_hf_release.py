"""DeepSeek-V3 / Kimi K2 folders as released (docs/deepseek.md, "Loading the released
folders"): fp8 weights in blocks with float32 `weight_scale_inv`, the MTP module as layer
num_hidden_layers, Kimi K2's model_type.

The release-shaped folder is made here from a debug_dsv3 model's export: every projection
block-quantized for real (blocks of 32 x 48, so the debug shapes end in partial blocks), the
embedding, head, router, norms and MTP projection left unquantized as in the release, the
weights spread over three files with an index. Through ./run_train.sh on 2 ranks (EP 2): it is
imported with model.mtp_layers = 1, trained one step at lr 1e-12 without bias balancing and
exported; every exported tensor equals the dequantized one (the test's own dequantization),
the MTP layer's included, and transformers loads the export. A folder quantized otherwise is
refused in one line, exit 2.
"""

import json
import shutil

import pytest
import torch

from tests.helpers import REPO, run_train
from trainer.models.build import build_model
from trainer.models.flavors import model_args

CONFIG = str(REPO / "configs" / "debug_dsv3.toml")
VOCAB, SEQ, BLOCK = 512, 64, (32, 48)
LAYERS = 4  # debugmodel-dsv3's: the MTP module is layer 4
# The names under DeepSeek-V3's MTP layer (model.layers.61.* of its model.safetensors.index.json;
# experts per expert), written here by hand rather than taken from the code under test
RELEASE_MTP = {
    "embed_tokens.weight",
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "self_attn.q_a_proj.weight",
    "self_attn.q_a_layernorm.weight",
    "self_attn.q_b_proj.weight",
    "self_attn.kv_a_proj_with_mqa.weight",
    "self_attn.kv_a_layernorm.weight",
    "self_attn.kv_b_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate.weight",
    "mlp.gate.e_score_correction_bias",
    *(f"mlp.shared_experts.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"mlp.experts.{e}.{p}_proj.weight" for e in range(8) for p in ("gate", "up", "down")),
    "shared_head.norm.weight",
    "shared_head.head.weight",
}
RUN = (
    "--data.dataset",
    "synthetic",
    "--data.vocab_size",
    str(VOCAB),
    "--model.vocab_size",
    str(VOCAB),
    "--training.seq_len",
    str(SEQ),
    "--training.steps",
    "1",
    "--training.mixed_precision_param",
    "float32",
    "--optimizer.lr",
    "1e-12",
    "--moe.load_balance_coeff",
    "0",
    "--checkpoint.enable",
    "false",
    "--metrics.log_freq",
    "1",
    "--checkpoint.initial_load_in_hf",
    "true",
)


def quantized(key: str) -> bool:
    """The release's fp8 tensors: the projections (not the MTP's eh_proj, embedding, head,
    router or norms)."""
    return key.endswith(("_proj.weight", "_proj_with_mqa.weight")) and ".eh_proj." not in key


def quantize(w: torch.Tensor, block=BLOCK):
    """DeepSeek's block quantization: per block, scale = amax / 448 and w / scale in fp8."""
    (rows, cols), (br, bc) = w.shape, block
    nr, nc = -(-rows // br), -(-cols // bc)
    padded = torch.zeros(nr * br, nc * bc)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, br, nc, bc)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
    q = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    return q.view(nr * br, nc * bc)[:rows, :cols].contiguous(), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block=BLOCK) -> torch.Tensor:
    (rows, cols), (br, bc) = q.shape, block
    full = torch.kron(scale, torch.ones(br, bc))[:rows, :cols]
    return q.float() * full


def source_folder(out, mtp_layers: int = 1):
    """A debugmodel-dsv3 (vocab 512) with every parameter and routing bias random (norms away
    from 1), exported by this trainer's code: the unquantized original."""
    from trainer.config.job import load_config
    from trainer.hf.export import write_hf_folder

    args = model_args("debugmodel-dsv3", vocab_size=VOCAB, max_seq_len=SEQ, mtp_layers=mtp_layers)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    gen = torch.Generator().manual_seed(1)
    state = model.state_dict()
    with torch.no_grad():
        for name, t in state.items():
            if t.dim() == 1:  # norms and the routing biases
                t.copy_(
                    torch.rand(t.shape, generator=gen) + 0.5
                    if "norm" in name
                    else torch.randn(t.shape, generator=gen) * 0.1
                )
    cfg = load_config(["--job.config_file", CONFIG, *RUN[:6]])
    write_hf_folder(
        str(out),
        args,
        lambda names: {n: state[n] for n in names},
        cfg,
        dtype="float32",
        log=lambda line: None,
    )
    return model


def make_release(src, out):
    """`src` as DeepSeek publishes: fp8 + float32 scales, quantization_config, three files."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(src / "model.safetensors")
    out.mkdir()
    stored = {}
    for key, t in tensors.items():
        if quantized(key):
            stored[key], stored[key + "_scale_inv"] = quantize(t)
        else:
            stored[key] = t
    keys = sorted(stored)
    files = {f"model-{i + 1:05d}-of-00003.safetensors": keys[i::3] for i in range(3)}
    for fname, names in files.items():
        save_file({k: stored[k] for k in names}, out / fname, metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: f for f, ks in files.items() for k in ks}})
    )
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    }
    (out / "config.json").write_text(json.dumps(config))
    return {
        k: dequantize(stored[k], stored[k + "_scale_inv"]) if quantized(k) else stored[k]
        for k in tensors
    }


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    source_folder(root / "src")
    want = make_release(root / "src", root / "release")
    dump = root / "run"
    proc = run_train(
        dump,
        *RUN,
        "--checkpoint.initial_load_path",
        str(root / "release"),
        "--checkpoint.last_save_in_hf",
        "true",
        nproc=2,
        config=CONFIG,
    )
    return root, want, dump, proc.stdout


def test_the_release_folder_has_the_releases_names(release):
    root, want, _, _ = release
    index = json.loads((root / "release" / "model.safetensors.index.json").read_text())
    mtp = {
        k[len(f"model.layers.{LAYERS}.") :]
        for k in index["weight_map"]
        if k.startswith(f"model.layers.{LAYERS}.") and not k.endswith("_scale_inv")
    }
    assert mtp == RELEASE_MTP
    # quantized, with a partial edge block (96 x 32 in 32 x 48 blocks: 3 x 1 scales)
    assert f"model.layers.{LAYERS}.self_attn.q_b_proj.weight_scale_inv" in index["weight_map"]


def test_an_fp8_release_imports_trains_and_exports_its_dequantized_weights(release):
    """Every exported tensor within 1% of its max |w| of the dequantized one (fp8 values read
    without their scales are off by up to 448 / max |w|, ~10^4 here), the MTP layer's
    included; no quantization_config in the export; the startup says what it read."""
    from safetensors.torch import load_file

    root, want, dump, stdout = release
    got = load_file(dump / "hf" / "model.safetensors")
    assert set(got) == set(want)
    for key, w in want.items():
        tol = 0.01 * float(w.abs().max())
        assert got[key].shape == w.shape and (got[key] - w).abs().max() <= tol, key
    assert any(k.startswith(f"model.layers.{LAYERS}.") for k in got)
    config = json.loads((dump / "hf" / "config.json").read_text())
    assert "quantization_config" not in config and config["num_nextn_predict_layers"] == 1
    assert "fp8 weights in 32 x 48 blocks" in stdout
    assert "module(s) 0..0 loaded from the folder's layer(s) 4..4" in stdout
    assert "unquantized: no quantization_config" in stdout
    assert "warning:" not in stdout  # the MTP layer's embedding and head copies are the model's


def test_transformers_loads_the_export_and_skips_the_mtp_layer(release):
    """transformers builds 4 layers from the export (ignoring layer 4) and gives the logits of
    our model loaded from the fp8 folder."""
    from transformers import AutoModelForCausalLM

    from trainer.hf.load import load_hf

    root, _, dump, _ = release
    theirs = AutoModelForCausalLM.from_pretrained(dump / "hf", dtype=torch.float32).eval()
    assert len(theirs.model.layers) == LAYERS
    ours = build_model(
        model_args("debugmodel-dsv3", vocab_size=VOCAB, max_seq_len=SEQ, mtp_layers=1)
    )
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    load_hf(ours, str(root / "release"), flavor="debugmodel-dsv3", log=lambda line: None)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (theirs(tokens).logits - ours.eval()(tokens)).abs().max() < 1e-4


def test_the_mtp_layer_is_deepseeks_formula(release):
    """The loaded MTP module computes the release's h' = eh_proj([enorm(emb); hnorm(h)]),
    written here from the folder's tensors by name."""
    from trainer.hf.load import load_hf

    root, want, _, _ = release
    ours = build_model(
        model_args("debugmodel-dsv3", vocab_size=VOCAB, max_seq_len=SEQ, mtp_layers=1)
    )
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    load_hf(ours, str(root / "release"), flavor="debugmodel-dsv3", log=lambda line: None)
    layer = {
        k.split(f"model.layers.{LAYERS}.")[1]: v
        for k, v in want.items()
        if k.startswith(f"model.layers.{LAYERS}.")
    }

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    emb, h = torch.randn(3, 64), torch.randn(3, 64)
    ref = (
        torch.cat([rms(emb, layer["enorm.weight"]), rms(h, layer["hnorm.weight"])], -1)
        @ layer["eh_proj.weight"].T
    )
    m = ours.mtp["0"]
    with torch.no_grad():
        have = m.proj(torch.cat([m.embed_norm(emb), m.hidden_norm(h)], -1))
        assert (have - ref).abs().max() < 1e-5
        assert torch.equal(m.norm.weight, layer["shared_head.norm.weight"])


def test_a_folder_quantized_otherwise_is_one_line(release, tmp_path):
    root = release[0]
    bad = tmp_path / "gptq"
    shutil.copytree(root / "release", bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    proc = run_train(
        tmp_path / "run",
        *RUN,
        "--checkpoint.initial_load_path",
        str(bad),
        "--parallelism.expert_parallel_degree",
        "1",
        nproc=1,
        config=CONFIG,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("config error: ") and "quant_method = 'gptq'" in lines[-1], (
        proc.stderr[-2000:]
    )
    assert "Traceback" not in proc.stderr


def test_a_kimi_k2_folder_imports_its_weights(tmp_path):
    """model_type kimi_k2 with DeepseekV3ForCausalLM through auto_map, no MTP layer
    (num_nextn_predict_layers 0) and a tiktoken tokenizer: the weights load, the MTP module
    starts from its init, and one line says how to pass the tokenizer."""
    from safetensors.torch import load_file

    from trainer.hf.load import load_hf

    source_folder(tmp_path, mtp_layers=0)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(
        model_type="kimi_k2",
        num_nextn_predict_layers=0,
        auto_map={
            "AutoConfig": "configuration_deepseek.DeepseekV3Config",
            "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
        },
    )
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "tiktoken.model").write_text("IQ== 0\n")
    ours = build_model(
        model_args("debugmodel-dsv3", vocab_size=VOCAB, max_seq_len=SEQ, mtp_layers=1)
    )
    ours.to_empty(device="cpu")
    ours.init_weights(0)
    lines = []
    load_hf(ours, str(tmp_path), flavor="debugmodel-dsv3", log=lines.append)
    stored = load_file(tmp_path / "model.safetensors")
    assert torch.equal(
        ours.layers["1"].attention.wkv_b.weight, stored["model.layers.1.self_attn.kv_b_proj.weight"]
    )
    assert any(
        "the folder holds none; module(s) 0..0 start from their seeded init" in ln for ln in lines
    ), lines
    assert any("tiktoken.model" in ln and "data.tokenizer_path" in ln for ln in lines), lines


def test_keys_left_out_of_config_json_take_transformers_defaults(tmp_path):
    """The table the config check fills missing keys from is transformers' DeepseekV3Config:
    a config.json without norm_topk_prob (transformers: true) fits the flavor, one without
    n_group (transformers: 8) does not fit a flavor with 2 groups."""
    from transformers import DeepseekV3Config

    from trainer.errors import ConfigError
    from trainer.hf.mapping import check_hf_config
    from trainer.models.deepseek_v3.hf import HF_DEFAULTS

    theirs = DeepseekV3Config().to_dict()
    theirs["rope_theta"] = theirs.get("rope_parameters", {}).get("rope_theta")
    assert {k: theirs[k] for k in HF_DEFAULTS} == HF_DEFAULTS
    args = model_args("debugmodel-dsv3", vocab_size=VOCAB)
    source_folder(tmp_path, mtp_layers=0)
    config = json.loads((tmp_path / "config.json").read_text())
    check_hf_config(config, args, str(tmp_path), "debugmodel-dsv3")
    del config["norm_topk_prob"]  # transformers' True: the flavor's
    check_hf_config(config, args, str(tmp_path), "debugmodel-dsv3")
    del config["n_group"]
    with pytest.raises(ConfigError, match="n_group is 8 there and 2 here"):
        check_hf_config(config, args, str(tmp_path), "debugmodel-dsv3")


def test_power_of_two_scales_stored_as_e8m0_bytes_are_read_as_powers():
    """A block's scale stored as its e8m0 byte (uint8 110 for 2^-17) dequantizes as the float
    scale does, not as the number 110."""
    from trainer.hf.quant import dequantize

    torch.manual_seed(0)
    q = (torch.randn(256, 384) * 4).to(torch.float8_e4m3fn)
    exponents = torch.randint(100, 140, (2, 3))
    as_float = torch.exp2(exponents.float() - 127)
    want = dequantize(q, as_float, (128, 128))
    assert torch.equal(dequantize(q, exponents.to(torch.uint8), (128, 128)), want)
    if hasattr(torch, "float8_e8m0fnu"):
        assert torch.equal(dequantize(q, as_float.to(torch.float8_e8m0fnu), (128, 128)), want)
    with pytest.raises(ValueError, match="NaN"):
        dequantize(q, torch.full((2, 3), 255, dtype=torch.uint8), (128, 128))
    with pytest.raises(ValueError, match="expected floats"):
        dequantize(q, exponents.to(torch.int32), (128, 128))
