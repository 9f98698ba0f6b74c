"""float8 experts (`float8.moe`, trainer/parallel/float8_moe.py): the rowwise quantization, the
padded expert groups, the GEMMs' numerics against fp32 (emulated: the CPU has no float8 GEMM),
the config's refusals, and a run through run_train.sh under expert parallelism."""

import pytest
import torch

from trainer.config.__main__ import main
from trainer.models.common.moe import GroupedExperts
from trainer.parallel.float8_moe import (
    E4M3_MAX,
    Float8GroupedExperts,
    _Float8GroupedLinear,
    padded_layout,
    quantize_rows,
)


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


def test_rows_are_scaled_to_the_float8_range():
    t = torch.randn(6, 40) * torch.tensor([1e-3, 1, 30, 1e4, 0, 2])[:, None]
    q, scale = quantize_rows(t)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6,)
    back = q.float() * scale[:, None]
    amax = t.abs().amax(-1)
    assert torch.allclose(q.float().abs().amax(-1)[amax > 0], torch.tensor(E4M3_MAX))
    # e4m3 keeps 3 mantissa bits: every value within 1/16 of itself or of 2^-9 of the row max
    assert ((back - t).abs() <= t.abs() / 16 + amax[:, None] * 2**-9 + 1e-30).all()
    assert back[4].abs().max() == 0  # a zero row stays zero (no division by zero)


def test_groups_are_padded_to_16_rows_without_reading_counts_on_the_host():
    counts = torch.tensor([5, 0, 17, 3])
    dest, offs, size = padded_layout(counts, 27)  # 25 routed rows + 2 of capacity's padding
    assert offs.tolist() == [16, 16, 48, 64] and size == 27 + 16 * 5
    assert dest.tolist() == [*range(5), *range(16, 33), *range(48, 51), 64, 65]


def experts_pair(dim=64, hidden=96, n=4):
    torch.manual_seed(0)
    ref = GroupedExperts(dim, hidden, n)
    for p in ref.parameters():
        torch.nn.init.normal_(p, std=dim**-0.5)
    f8 = GroupedExperts(dim, hidden, n)
    f8.load_state_dict(ref.state_dict())
    f8.__class__, f8.emulate = Float8GroupedExperts, True
    return ref, f8


def test_one_grouped_linear_quantizes_forward_and_input_gradient_only():
    torch.manual_seed(0)
    w = (torch.randn(3, 48, 32) * 0.2).requires_grad_()
    x = torch.randn(64, 32, requires_grad=True)
    offs = torch.tensor([16, 32, 64], dtype=torch.int32)
    y = _Float8GroupedLinear.apply(x, w, offs, True)
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    rdx, rdw = torch.autograd.grad(ref, (x, w), dy)
    assert 1e-3 < rel(y, ref) < 0.06 and 1e-3 < rel(dx, rdx) < 0.06  # float8, not fp32
    assert rel(dw, rdw) < 1e-6  # the weight gradient is exact


def test_float8_experts_are_close_to_fp32_with_padding_rows_zero():
    ref, f8 = experts_pair()
    counts = torch.tensor([50, 0, 37, 30])
    x = torch.randn(120, 64)  # 117 routed + 3 rows of capacity's padding
    dy = torch.randn(120, 64)
    dy[117:] = 0
    outs = []
    for m in (ref, f8):
        xx = x.clone().requires_grad_()
        y = m(xx, counts)
        (y * dy).sum().backward()
        outs.append((y[:117], xx.grad[:117], m.w1.grad, m.w2.grad))
    assert f8(x, counts)[117:].abs().max() == 0
    for got, want in zip(outs[1], outs[0], strict=True):
        assert 1e-3 < rel(got, want) < 0.1  # e4m3: ~6% on a SwiGLU (bf16: ~0.5%)


def check(capsys, *argv):
    code = main(["--check", "--world-size", "1", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            (
                "--model.flavor",
                "debugmodel-moe",
                "--float8.moe",
                "true",
                "--training.device",
                "cpu",
            ),
            "float8.moe = true needs a CUDA GPU with compute capability >= 9.0 (H100, H200, B200); "
            "training.device is 'cpu'",
        ),
        (
            (
                "--model.flavor",
                "debugmodel-moe",
                "--float8.moe",
                "true",
                "--training.device",
                "cuda",
                "--training.mixed_precision_param",
                "float32",
            ),
            "float8.moe = true needs bf16 compute: the float8 grouped GEMM writes bfloat16 only",
        ),
        (
            ("--float8.moe", "true", "--float8.moe_emulate", "true"),
            "float8.moe = true is set, but model.flavor 'debugmodel' has no experts",
        ),
        (
            ("--model.flavor", "debugmodel-moe", "--float8.moe_emulate", "true"),
            "float8.moe_emulate = true emulates float8.moe, which is off",
        ),
    ],
)
def test_impossible_float8_expert_settings_are_one_line(capsys, argv, needle):
    code, err = check(capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and needle in err, err


def test_float8_experts_train_under_ep_close_to_full_precision(tmp_path):
    """One rank in fp32 against EP 2 with the experts emulated in float8 (the rank-local
    experts through DTensor.to_local), 3 steps: close at every step, not equal."""
    from tests.helpers import losses, run_train
    from tests.test_moe import COMMON

    common = [*COMMON, "--training.steps", "3", "--checkpoint.enable", "false"]
    run_train(tmp_path / "ref", *common, nproc=1)
    out = run_train(
        tmp_path / "f8",
        *common,
        "--parallelism.expert_parallel_degree",
        "2",
        "--float8.moe",
        "true",
        "--float8.moe_emulate",
        "true",
        nproc=2,
    ).stdout
    assert "float8 experts: 2 MoE layers as rowwise float8 grouped GEMMs" in out
    ref, f8 = losses(tmp_path / "ref"), losses(tmp_path / "f8")
    assert sorted(ref) == sorted(f8) == [1, 2, 3]
    assert abs(ref[1] - f8[1]) < 5e-3, (ref, f8)
    assert all(abs(ref[s] - f8[s]) < 3e-2 for s in ref), (ref, f8)
    assert any(ref[s] != f8[s] for s in ref)  # the experts really ran in float8


@pytest.mark.parametrize(
    "capability, ok", [((9, 0), True), ((10, 0), True), ((8, 9), False), ((12, 0), False)]
)
def test_float8_experts_run_on_the_capabilities_torchs_kernel_has(monkeypatch, capability, ok):
    """torch._scaled_grouped_mm has float8 kernels for compute capability 9.x and 10.x only:
    an L40S (8.9) or a consumer Blackwell (12.0) is told so at startup, in one line."""
    from trainer.errors import ConfigError
    from trainer.parallel.float8 import check_grouped_device

    if not hasattr(torch, "_scaled_grouped_mm"):
        pytest.skip("this torch has no _scaled_grouped_mm")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "a GPU")
    if ok:
        check_grouped_device(torch.device("cuda"))
    else:
        with pytest.raises(ConfigError, match="needs compute capability 9.x or 10.x"):
            check_grouped_device(torch.device("cuda"))
