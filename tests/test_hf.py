"""Hugging Face interchange, checked against the real transformers on CPU (fp32):
export (DCP checkpoint -> LlamaForCausalLM folder), import (initial_load_path), the round trip,
the Llama-3.2 features (tied embeddings, llama3 RoPE scaling) and the exported tokenizer."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from tests.data_fixtures import corpus_dir, json_cfg, stdlib_texts, tokenizer_path  # noqa: F401
from tests.helpers import BASE_FP32, TINY, losses, run_train

transformers = pytest.importorskip("transformers")
VOCAB = 512


def convert(ckpt, out, *extra) -> None:
    """The CLI, `python -m trainer.convert to-hf CKPT OUT ...`, called in this process."""
    from trainer.convert import main

    assert main(["to-hf", str(ckpt), str(out), *extra]) == 0


def trainer_model(flavor: str, state: dict, seq_len: int):
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    blocks = len({k.split(".")[1] for k in state if k.startswith("layers.")})  # model.n_layers
    model = build_model(
        model_args(
            flavor,
            vocab_size=state["tok_embeddings.weight"].shape[0],
            max_seq_len=seq_len,
            n_layers=blocks,
        )
    )
    model.to_empty(device="cpu")
    model.init_weights(0)  # the RoPE tables
    model.load_state_dict(state, strict=True)
    return model.eval()


def max_diff(ours, hf_model, tokens) -> float:
    with torch.no_grad():
        return (ours(tokens) - hf_model(tokens).logits).abs().max().item()


def real_lines(n: int = 1000) -> list[str]:
    lines = [line for text in stdlib_texts(60) for line in text.splitlines(keepends=True)]
    return lines[1000 : 1000 + n]


@pytest.mark.needs_datasets
def test_trained_debug_model_exports_to_transformers(tmp_path, json_cfg):  # noqa: F811
    """The debug flavor trained 3 steps on 2 ranks, checkpointed, converted on one process
    (sharded safetensors): transformers' logits equal ours; its tokenizer equals ours."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from trainer.convert import dcp_fetch, saved_shapes
    from trainer.data.tokenizer import Tokenizer

    dump = tmp_path / "run"
    run_train(
        dump,
        *TINY,
        "--model.flavor",
        "debugmodel",
        "--training.steps",
        "3",
        "--checkpoint.enable",
        "--data.dataset",
        "json",
        "--data.data_files",
        json_cfg.data_files[0],
        "--data.tokenizer_path",
        json_cfg.tokenizer_path,
        "--model.vocab_size",
        str(VOCAB),
    )
    ckpt, out = dump / "checkpoint" / "step-3", tmp_path / "hf"
    convert(ckpt, out, "--dtype", "float32", "--max-shard-size", "0.002")
    assert (out / "model.safetensors.index.json").is_file()  # 2 MiB shards: an index

    shapes = saved_shapes(str(ckpt))
    ours = trainer_model("debugmodel", dcp_fetch(str(ckpt), shapes)(list(shapes)), 64)
    hf_model = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    tokens = torch.tensor([hf_tok("def main(argv):\n    return 0\n")["input_ids"][:64]])
    assert max_diff(ours, hf_model, tokens) < 1e-4

    # Token for token on 1,000 real lines, BOS prepended as the trainer does (EOS is the
    # document separator in training: not added by the HF tokenizer, but it is its eos).
    tok = Tokenizer(json_cfg.tokenizer_path)
    lines = real_lines()
    assert len(lines) == 1000
    assert hf_tok(lines)["input_ids"] == tok.encode_docs(lines, add_eos=False)
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (tok.bos_id, tok.eos_id)
    assert hf_model.generation_config.eos_token_id == tok.eos_id
    assert hf_tok.decode(hf_tok(lines[7])["input_ids"], skip_special_tokens=True) == lines[7]


def test_random_llama32_1b_exports_to_transformers(tmp_path):
    """The released Llama-3.2-1B shape (tied, llama3 RoPE scaling), random weights; 2 of its
    16 layers (every tensor shape of the 1B model at a quarter of its 1.2B parameters)."""
    from transformers import LlamaForCausalLM

    from trainer.config.job import JobConfig
    from trainer.hf.export import write_hf_folder
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    args = dataclasses.replace(model_args("llama3.2-1B", max_seq_len=32), n_layers=2)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_rope()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a fast random fill (the seeded init is slow on 0.4B weights),
        for name, p in model.named_parameters():  # of bf16 values: a bf16 export is lossless
            p.uniform_(-0.04, 0.04, generator=gen).add_(name.endswith("norm.weight"))
            p.copy_(p.bfloat16())
    cfg = JobConfig()
    cfg.data.dataset = "synthetic"
    sd = model.state_dict()
    write_hf_folder(
        str(tmp_path),
        args,
        lambda names: {n: sd[n] for n in names},
        cfg,
        dtype="bfloat16",
        log=lambda _: None,
    )
    sd.clear()
    hf_model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    tokens = torch.randint(0, args.vocab_size, (1, 12), generator=gen)
    assert max_diff(model.eval(), hf_model, tokens) < 1e-4


def llama32_style(folder) -> torch.nn.Module:
    """A random transformers Llama-3.2-style model in the debugmodel-3.2 shape, saved."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norms too: a swapped norm would show
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(folder)
    return model


def hf_loss(model) -> float:
    """transformers' loss on the batch a run's step 1 trains on (synthetic data, seed 0)."""
    from trainer.data.synthetic import SyntheticLoader

    loader = SyntheticLoader(
        vocab_size=VOCAB,
        seq_len=64,
        local_batch_size=8,
        global_batch_size=8,
        dp_rank=0,
        dp_size=1,
        seed=0,
    )
    inputs, labels = loader.next_microbatch()
    with torch.no_grad():
        logits = model(inputs).logits
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten()).item()


IMPORT = [
    *BASE_FP32,
    "--model.flavor",
    "debugmodel-3.2",
    "--data.vocab_size",
    str(VOCAB),
    "--checkpoint.initial_load_in_hf",
    "--training.steps",
    "1",
]


@pytest.fixture(scope="module")
def llama32(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama32")
    return folder, hf_loss(llama32_style(folder))


def test_import_on_hsdp_2x2_and_round_trip_is_bitwise(tmp_path, llama32):
    """HSDP 2x2 import: transformers' loss at step 1; with lr 0 the weights stay put, and both
    the run's own HF save and the converted checkpoint equal the imported files bit for bit."""
    from safetensors.torch import load_file

    folder, expected = llama32
    run_train(
        tmp_path,
        *IMPORT,
        "--checkpoint.initial_load_path",
        str(folder),
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--checkpoint.enable",
        "--checkpoint.last_save_in_hf",
        "--optimizer.lr",
        "0",
        nproc=4,
    )
    assert abs(losses(tmp_path)[1] - expected) < 1e-4
    convert(tmp_path / "checkpoint" / "step-1", tmp_path / "converted")
    original = load_file(folder / "model.safetensors")
    for out in (tmp_path / "hf", tmp_path / "converted"):
        exported = load_file(out / "model.safetensors")
        assert exported.keys() == original.keys()
        for key, tensor in original.items():
            assert torch.equal(exported[key], tensor), key


def test_import_shape_mismatch_is_one_config_error(llama32):
    """(What run_train prints as its one line; tested here on the model, without torchrun.)"""
    from trainer.config.job import load_config
    from trainer.errors import ConfigError
    from trainer.hf.load import load_initial
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    folder, _ = llama32
    cfg = load_config(
        [
            "--model.flavor",
            "debugmodel-3.2",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path",
            str(folder),
        ]
    )
    model = build_model(model_args("debugmodel-3.2", vocab_size=1024, max_seq_len=64))
    model.to_empty(device="cpu")
    with pytest.raises(ConfigError) as err:
        load_initial(model, cfg)
    line = err.value.one_line()
    assert line.startswith("config error: ") and "\n" not in line
    assert "model.embed_tokens.weight has shape [512, 256] there and [1024, 256] here" in line


def test_import_into_fewer_blocks_is_one_config_error(llama32):
    """model.n_layers below the folder's num_hidden_layers would load only its first blocks:
    one line naming both depths (not a silently truncated model)."""
    from trainer.config.job import load_config
    from trainer.errors import ConfigError
    from trainer.hf.load import load_initial
    from trainer.models.build import build_model
    from trainer.models.flavors import model_args

    folder, _ = llama32
    cfg = load_config(
        [
            "--model.flavor",
            "debugmodel-3.2",
            "--model.n_layers",
            "1",
            "--checkpoint.initial_load_in_hf",
            "--checkpoint.initial_load_path",
            str(folder),
        ]
    )
    model = build_model(model_args("debugmodel-3.2", vocab_size=512, max_seq_len=64, n_layers=1))
    model.to_empty(device="cpu")
    with pytest.raises(ConfigError) as err:
        load_initial(model, cfg)
    depth = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    assert f"num_hidden_layers is {depth} there and 1 here" in err.value.one_line()
    assert "model.n_layers = 0" in err.value.one_line()
