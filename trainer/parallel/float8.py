"""`[float8]`: float8 matmuls in the transformer blocks through torchao's Float8Linear.

Off by default. It needs a GPU that computes float8 (CUDA compute capability >= 8.9: L4/L40S,
H100/H200, B200) and torchao (`pip install -e ".[float8]"`); anything else is one `config
error:` line before training starts: the CPU and torchao checks in `python -m trainer.config
--check` (torch-free), the compute capability on each rank once it has its GPU.

Measured on one H100 (torch 2.11, torchao 0.17; benchmarks/RESULTS.md): Llama 1B at 4,096,
compiled, tensorwise 62.1k tokens/s against bf16's 55.4k (1.12x), rowwise 54.0k; both train
the debug model with a falling loss (benchmarks/gpu/gpu_paths.py).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from trainer.config.base import opt
from trainer.errors import ConfigError

INSTALL_HINT = 'pip install -e ".[float8]"'


@dataclass
class Float8:
    """float8 training of the blocks' linear layers on CUDA (docs/performance.md)."""

    enable: bool = opt(
        False,
        "Train the blocks' linear layers in float8 (torchao Float8Linear; CUDA sm >= 89, torchao)",
    )
    recipe: str = opt(
        "tensorwise",
        "Scaling: tensorwise (one scale per tensor) or rowwise",
        choices=("tensorwise", "rowwise"),
    )
    enable_fsdp_float8_all_gather: bool = opt(
        True, "tensorwise: all-gather the FSDP-sharded weights in float8 (half the bytes)"
    )
    filter_fqns: list[str] = opt(
        ["output"],
        "Linear layers whose name contains one of these stay in bf16 (the output head by default)",
    )
    moe: bool = opt(
        False,
        "MoE experts' grouped GEMMs in rowwise float8 (torch._scaled_grouped_mm, "
        "CUDA sm 9.x or 10.x, bf16 compute; trainer/parallel/float8_moe.py); independent of enable",
    )
    moe_emulate: bool = opt(
        False,
        "With moe: quantize as float8 but multiply dequantized values "
        "in fp32 (any device: tests of the numerics, no speed)",
    )


def check_config(f8: Float8, device: str, param_dtype: str = "auto") -> None:
    """Torch-free checks: not on the CPU, bf16 compute for the float8 experts, and torchao
    importable."""
    if f8.moe_emulate and not f8.moe:
        raise ConfigError(
            "float8.moe_emulate = true emulates float8.moe, which is off; set "
            "float8.moe = true too, or turn moe_emulate off"
        )
    if f8.moe and not f8.moe_emulate and device == "cpu":
        raise ConfigError(
            "float8.moe = true needs a CUDA GPU with compute capability >= 9.0 "
            "(H100, H200, B200); training.device is 'cpu' (float8.moe_emulate = "
            "true checks the numerics on any device, without the speed)"
        )
    if f8.moe and not f8.moe_emulate and param_dtype == "float32":
        raise ConfigError(
            "float8.moe = true needs bf16 compute: the float8 grouped GEMM writes bfloat16 "
            "only; training.mixed_precision_param is 'float32' (set 'bfloat16' or 'auto')"
        )
    if not f8.enable:
        return
    if device == "cpu":
        raise ConfigError(
            "float8.enable = true needs a CUDA GPU with compute capability >= 8.9 "
            "(H100, H200, L40S, B200); training.device is 'cpu'"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            f"float8.enable = true needs torchao, which is not installed: {INSTALL_HINT}"
        )


def check_device(f8: Float8, device) -> None:
    """On the rank's device (a torch.device): float8 matmuls need CUDA sm >= 89."""
    import torch

    if f8.moe and not f8.moe_emulate:
        check_grouped_device(device)
    if not f8.enable:
        return
    if device.type != "cuda":
        raise ConfigError(
            f"float8.enable = true needs a CUDA GPU with compute capability >= "
            f"8.9; this run is on {device.type}"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ConfigError(
            f"float8.enable = true needs compute capability >= 8.9; "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )


GROUPED_MAJORS = (9, 10)  # the compute capabilities torch._scaled_grouped_mm has kernels for


def check_grouped_device(device) -> None:
    """float8.moe on the rank's device: torch's rowwise float8 grouped GEMM needs CUDA sm 9.x
    or 10.x."""
    import torch

    if device.type != "cuda":
        raise ConfigError(
            f"float8.moe = true needs a CUDA GPU with compute capability >= 9.0; "
            f"this run is on {device.type}"
        )
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise ConfigError(
            f"float8.moe = true needs torch._scaled_grouped_mm, which torch "
            f"{torch.__version__} lacks (torch >= 2.8)"
        )
    major, minor = torch.cuda.get_device_capability(device)
    if major not in GROUPED_MAJORS:
        raise ConfigError(
            f"float8.moe = true needs compute capability 9.x or 10.x (H100, H200, B200: "
            f"torch's float8 grouped GEMM runs on those only); "
            f"{torch.cuda.get_device_name(device)} has {major}.{minor}"
        )


def apply_float8(model, f8: Float8) -> None:
    """Swap the blocks' nn.Linear layers for torchao's Float8Linear (before AC, compile and
    FSDP, as torchao expects). Unverified on a GPU: see the module docstring."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if f8.recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=f8.enable_fsdp_float8_all_gather)
    else:
        config = Float8LinearConfig.from_recipe_name(f8.recipe)
    # MoE routers stay in bf16, as in torchtitan: few outputs (E experts, 8 in debugmodel-moe,
    # below float8 GEMMs' multiple of 16) and the top-k choice is sensitive to their precision.
    skip = (*f8.filter_fqns, "router.gate")
    convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda mod, fqn: not any(name in fqn for name in skip),
    )


def after_optimizer_step(model, f8: Float8) -> None:
    """tensorwise with float8 all-gather: one amax all-reduce for every weight's next scale."""
    if f8.enable and f8.recipe == "tensorwise" and f8.enable_fsdp_float8_all_gather:
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(model)
