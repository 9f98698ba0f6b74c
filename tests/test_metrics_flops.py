"""The analytic FLOPs/token against torch's FlopCounterMode, and the peak-FLOPS table.

FlopCounterMode counts a real forward+backward of the model. Large shapes run on the meta
device (no memory, same ops), with the real dim / heads / GQA / FFN width / vocab and fewer
layers: every term of the formula is per layer or per head, so that checks the formula for the
full model. Two caveats found while writing these tests (torch 2.13):
- on meta tensors SDPA falls back to the math path (q@k^T and attn@v as `aten.bmm`), which the
  counter counts in full even with `is_causal=True`;
- on real CPU tensors SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which has no
  FLOP formula registered, so the counter would see no attention FLOPs at all; the real-tensor
  test pins the math backend.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from trainer.models.args import ModelArgs
from trainer.models.build import build_model
from trainer.models.flavors import model_args
from trainer.models.flops import (
    attention_flops_per_token,
    flops_per_token,
    matmul_params,
    resolve_peak,
    table_peak_tflops,
)

# (name, args, seq_len, batch): real dims of each flavor, fewer layers where the model is big.
SHAPES = [
    ("debugmodel", model_args("debugmodel"), 256, 2),  # GQA 8q/4kv
    ("1B", dataclasses.replace(model_args("1B"), n_layers=2), 512, 1),  # GQA 32q/8kv
    ("8B", dataclasses.replace(model_args("8B"), n_layers=2), 512, 1),  # GQA 32q/8kv
    ("70B", dataclasses.replace(model_args("70B"), n_layers=1), 256, 1),  # GQA 64q/8kv
    (
        "MQA-odd",
        ModelArgs(
            dim=384,
            n_layers=3,
            n_heads=12,
            n_kv_heads=1,
            vocab_size=1000,
            multiple_of=32,
            ffn_dim_multiplier=1.3,
        ),
        96,
        3,
    ),
    (
        "MHA",
        ModelArgs(dim=256, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=512, multiple_of=64),
        128,
        2,
    ),
]


def counted(args: ModelArgs, seq_len: int, batch: int, device: str = "meta") -> dict[str, int]:
    """FlopCounterMode's totals by op for one forward+backward of `batch` x `seq_len` tokens."""
    args = dataclasses.replace(args, max_seq_len=seq_len)
    model = build_model(args)
    if device != "meta":
        model.to_empty(device=device)
        model.init_weights(0)
    tokens = torch.randint(0, args.vocab_size, (batch, seq_len), device=device)
    with FlopCounterMode(display=False) as fc:
        model(tokens).float().sum().backward()
    return {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}


def rel(a: float, b: float) -> float:
    return abs(a - b) / b


@pytest.mark.parametrize("name,args,seq_len,batch", SHAPES, ids=[s[0] for s in SHAPES])
def test_flops_per_token_matches_flop_counter(name, args, seq_len, batch):
    ops = counted(args, seq_len, batch)
    tokens = batch * seq_len
    total = sum(ops.values()) / tokens
    assert rel(flops_per_token(args, seq_len), total) < 0.02, (name, ops)
    # Each term on its own, so an error in one cannot hide behind the other (the output head
    # dominates small models): Linears are aten.mm, attention products are aten.bmm here.
    assert rel(6 * matmul_params(args), ops["aten.mm"] / tokens) < 0.02
    assert rel(attention_flops_per_token(args, seq_len), ops["aten.bmm"] / tokens) < 0.02


def test_real_forward_backward_on_cpu_agrees():
    """The debug model on real CPU tensors (math SDPA, see the module docstring)."""
    args = dataclasses.replace(model_args("debugmodel"), n_layers=2)
    with sdpa_kernel(SDPBackend.MATH):
        ops = counted(args, seq_len=128, batch=1, device="cpu")
    assert rel(flops_per_token(args, 128), sum(ops.values()) / 128) < 0.02


def test_gqa_shrinks_projections_but_not_attention_products():
    """Against the two classic mistakes: counting wk/wv at full width, or attention by kv heads."""
    mha = ModelArgs(dim=512, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=1024)
    gqa = dataclasses.replace(mha, n_kv_heads=2)
    kv_saved = 2 * mha.n_layers * mha.dim * (8 - 2) * mha.head_dim
    assert matmul_params(mha) - matmul_params(gqa) == kv_saved
    assert attention_flops_per_token(mha, 1024) == attention_flops_per_token(gqa, 1024)
    assert (
        attention_flops_per_token(gqa, 1024, causal_half=True)
        == attention_flops_per_token(gqa, 1024) / 2
    )


def test_matmul_params_is_num_params_without_embedding_and_norms():
    for args in (model_args("debugmodel"), model_args("8B")):
        norms = (2 * args.n_layers + 1) * args.dim
        assert matmul_params(args) == args.num_params(embeddings=False) - norms


@pytest.mark.parametrize(
    "name,tflops",
    [
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("NVIDIA A100 80GB PCIe", 312.0),
        ("NVIDIA H100 80GB HBM3", 989.5),
        ("NVIDIA H100 PCIe", 756.5),
        ("NVIDIA H100 NVL", 835.5),
        ("NVIDIA H200", 989.5),
        ("NVIDIA H200 NVL", 835.5),
        ("NVIDIA B200", 2250.0),
        ("NVIDIA L40S", 362.05),
        ("AMD Instinct MI300X", 1307.4),
        ("AMD Instinct MI300X VF", 1307.4),
    ],
)
def test_peak_table_dense_bf16(name, tflops):
    assert table_peak_tflops(name)[0] == tflops


@pytest.mark.parametrize(
    "name", ["NVIDIA L40", "NVIDIA GH200 480GB", "NVIDIA GeForce RTX 4090", "NVIDIA H800", ""]
)
def test_unknown_devices_get_no_peak(name):
    assert table_peak_tflops(name) is None


def test_resolve_peak_never_invents_one(monkeypatch):
    cpu = torch.device("cpu")
    none = resolve_peak(0.0, cpu)
    assert none.tflops is None and "MFU not reported" in none.source
    configured = resolve_peak(2.5, cpu)
    assert configured.tflops == 2.5 and "peak_tflops" in configured.source

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    table = resolve_peak(0.0, cuda)
    assert table.tflops == 756.5 and "device table" in table.source
    assert resolve_peak(500.0, cuda).tflops == 500.0  # the config overrides the table
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Mystery GPU")
    unknown = resolve_peak(0.0, cuda)
    assert unknown.tflops is None and "Mystery GPU" in unknown.source


@pytest.mark.parametrize("flavor", ["debugmodel-moe", "debugmodel-moe-shared"])
def test_moe_counts_the_active_experts(flavor):
    """A MoE model's FLOPs/token counts the router and the top_k (+ shared) experts a token
    goes through, not all E: FlopCounterMode on a real forward+backward through the
    per-expert loop (its matmuls are aten.mm) agrees, with no balance assumed."""
    from trainer.models.common.moe import moe_layers

    args = dataclasses.replace(model_args(flavor), max_seq_len=64)
    model = build_model(args)
    model.to_empty(device="cpu")
    model.init_weights(0)
    for layer in moe_layers(model).values():
        layer.experts.grouped = False
    tokens = torch.randint(0, args.vocab_size, (2, 64))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as fc:
        model(tokens).float().sum().backward()
    ops = {str(op): n for op, n in fc.get_flop_counts()["Global"].items()}
    assert rel(6 * matmul_params(args), ops["aten.mm"] / 128) < 0.02, ops
    assert rel(flops_per_token(args, 64), sum(ops.values()) / 128) < 0.02, ops
    assert matmul_params(args) < args.num_params() * 0.8  # fewer than all the experts
