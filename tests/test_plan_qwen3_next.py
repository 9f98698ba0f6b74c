"""The memory plan of the hybrid blocks (trainer/models/qwen3_next/plan.py): its per-token
terms against what autograd saves for a Gated DeltaNet layer, a gated attention layer and a
zero-centred norm at a small bf16 shape, and the debug config's plan against its traced step."""

import dataclasses

import pytest
import torch

from tests.helpers import REPO
from trainer.config.job import load_config
from trainer.models.build import build_model
from trainer.models.flavors import FLAVORS
from trainer.models.qwen3_next import plan as hybrid
from trainer.plan.memory import memory_plan
from trainer.plan.trace import trace_step

B, S = 2, 512  # 8 chunks of 64


def small_hybrid():
    """A hybrid whose widths differ from each other (keys != values, h_k != h_v, d_k != d_v),
    so that a term counted on the wrong width shows; bf16 as on a GPU."""
    a = FLAVORS["debugmodel-qwen3-next"]
    h = dataclasses.replace(
        a.hybrid, linear_k_heads=2, linear_v_heads=6, linear_k_head_dim=16, linear_v_head_dim=24
    )
    a = dataclasses.replace(
        a,
        dim=80,
        n_layers=2,
        n_heads=5,
        n_kv_heads=1,
        explicit_head_dim=16,
        vocab_size=256,
        max_seq_len=S,
        hybrid=h,
    )
    model = build_model(a)
    model.to_empty(device="cpu")
    model.init_weights(0)
    return a, model.to(torch.bfloat16)


def saved_per_token(model, run) -> float:
    """Bytes per token of the distinct storages autograd saves during `run()`, parameters
    excluded (what stays allocated from the forward to the backward)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values()) / (B * S)


@pytest.mark.parametrize("documents", [False, True])
def test_hybrid_terms_equal_what_autograd_saves(documents):
    torch.manual_seed(0)
    a, model = small_hybrid()
    x = torch.randn(B, S, a.dim, dtype=torch.bfloat16, requires_grad=True)
    docs = (torch.arange(S) * 4 // S).expand(B, S).contiguous() if documents else None
    linear, full = model.layers["0"], model.layers["1"]
    assert (linear.layer_type, full.layer_type) == ("linear_attention", "full_attention")
    cos, sin = (t[:S].to(torch.bfloat16) for t in (model.rope_cos, model.rope_sin))
    p = 2
    measured = {
        "deltanet": saved_per_token(model, lambda: linear.linear_attention(x, docs)),
        "gated attention": saved_per_token(model, lambda: full.attention(x, cos, sin)),
        "norm": saved_per_token(model, lambda: linear.attention_norm(x)),
    }
    planned = {
        "deltanet": hybrid.deltanet_bytes(a, p, S, documents=documents),
        "gated attention": hybrid.gated_attention_bytes(a, p),
        "norm": hybrid.norm_bytes(a.dim),
    }
    for key, want in measured.items():  # within 0.5%: the RoPE tables and [h] scalars
        assert abs(planned[key] / want - 1) < 0.005, (key, planned[key], want)
    # the kernel's terms are most of a DeltaNet layer: 12 [h, d_k] + 6 [h, d_v] fp32 ...
    assert measured["deltanet"] > 10 * measured["gated attention"]


def test_debug_config_plan_within_10_percent_of_its_trace():
    """configs/debug_qwen3_next.toml on 2 ranks (EP 2), documents kept apart (SDPA with the
    window's mask: FlexAttention is not traced on a CPU), no AC: the blocks' saved tensors
    are a fifth of the peak (under full AC the loss dominates at this size)."""
    cfg = load_config(
        [
            "--job.config_file",
            str(REPO / "configs" / "debug_qwen3_next.toml"),
            "--model.attn_implementation",
            "sdpa",
            "--training.seq_len",
            "512",
        ]
    )
    traced = trace_step(cfg, 2).peak
    plan = memory_plan(cfg, 2)["total"]
    assert abs(plan / traced - 1) <= 0.10, (plan, traced)
