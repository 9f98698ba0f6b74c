"""Which kernel runs `scaled_dot_product_attention`: the backend order, and the one chosen.

`[model] sdpa_backends`: `auto`, or a comma-separated list of `cudnn`, `flash`, `efficient`,
`math`. A list enables exactly those backends, tried in that order (each must take the call's
shapes and dtype; torch falls through to the next): e.g. `flash,efficient,math` is torch's
own order without cuDNN. `auto`:
- CUDA, Hopper (sm 9.x): `cudnn,flash,efficient,math`, what torch 2.11 itself picks on an
  H100 at the 1B shape (32 query heads, 8 kv heads, head dim 64, seq 4,096, bf16, causal)
  though its priority list names flash first; made explicit so that it holds whatever a
  torch version's heuristics do. Measured there (benchmarks/RESULTS.md): cuDNN's forward +
  backward 4.45 ms a layer against flash's 7.04 ms; the compiled 1B step at batch 7 spends
  82 ms in attention with cuDNN and 123 ms with flash (57.1k against 53.4k tokens/s). cuDNN
  also takes query/key and value head sizes that differ, which flash does not.
- other CUDA devices and the CPU: torch's own choice, unchanged.
The order is process-wide (torch's SDPA priority), set once before the model is compiled, so
compiled graphs trace the same choice. It is also part of torch.compile's cache key: the
kernel is traced into the compiled graph, and a warm compile cache would otherwise serve a
graph traced under another order. `chosen` asks torch's own selector which kernel a causal
call of the model's shape gets, for the startup summary.
"""

from __future__ import annotations

import torch

from trainer.errors import ConfigError

NAMES = ("cudnn", "flash", "efficient", "math")
HOPPER_ORDER = ("cudnn", "flash", "efficient", "math")
CPU_NAMES = ("flash", "math")  # the CPU's SDPA has these two
_LABELS = {
    "flex": "FlexAttention (not SDPA)",
    "cudnn": "cuDNN attention",
    "flash": "flash attention",
    "efficient": "memory-efficient attention",
    "math": "math (unfused)",
}


def _backend(name: str):
    from torch.nn.attention import SDPBackend

    return {
        "cudnn": SDPBackend.CUDNN_ATTENTION,
        "flash": SDPBackend.FLASH_ATTENTION,
        "efficient": SDPBackend.EFFICIENT_ATTENTION,
        "math": SDPBackend.MATH,
    }[name]


def parse(spec: str) -> tuple[str, ...] | None:
    """The backends of `model.sdpa_backends` in order (None for 'auto'); ConfigError names
    what is wrong."""
    if spec.strip() == "auto":
        return None
    names = tuple(n.strip() for n in spec.split(","))
    bad = [n for n in names if n not in NAMES]
    if bad or not names:
        raise ConfigError(
            f"model.sdpa_backends = {spec!r}: {', '.join(map(repr, bad))} is not "
            f"a backend; use 'auto' or a comma-separated order of "
            f"{', '.join(NAMES)} (e.g. 'cudnn,flash,efficient,math')"
        )
    if len(set(names)) != len(names):
        raise ConfigError(
            f"model.sdpa_backends = {spec!r} names a backend twice; list each "
            "once, in the order to try"
        )
    return names


def resolve(spec: str, device: torch.device) -> tuple[str, ...] | None:
    """The order this device uses (None: torch's own, left as it is)."""
    names = parse(spec)
    if names is None:
        if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9:
            return HOPPER_ORDER
        return None
    if device.type != "cuda" and not set(names) & set(CPU_NAMES):
        raise ConfigError(
            f"model.sdpa_backends = {spec!r} has no backend the CPU runs (it has "
            f"{' and '.join(CPU_NAMES)}); add one, or use 'auto'"
        )
    return names


def apply(spec: str, device: torch.device) -> tuple[str, ...] | None:
    """Enable exactly the listed backends, in their order (the rest after them, disabled),
    for the whole process; 'auto' on a device without a measured order leaves torch's."""
    order = resolve(spec, device)
    if order is None:
        return None
    enable = {
        "cudnn": torch.backends.cuda.enable_cudnn_sdp,
        "flash": torch.backends.cuda.enable_flash_sdp,
        "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
        "math": torch.backends.cuda.enable_math_sdp,
    }
    for name, switch in enable.items():
        switch(name in order)
    rest = [
        b for b in torch._C._get_sdp_priority_order() if b not in {int(_backend(n)) for n in order}
    ]
    torch._C._set_sdp_priority_order([int(_backend(n)) for n in order] + rest)
    _tag_compile_cache(order)
    return order


def _tag_compile_cache(order: tuple[str, ...]) -> None:
    """Make the order part of torch.compile's cache key. The choice of SDPA kernel is traced
    into the compiled graph, and the on-disk caches do not key on these switches: without the
    tag, a run that allows only `math` was served the `flash` graph an earlier run compiled
    (reproduced on CPU with torch 2.13, tests/test_sdpa.py; on an H100, a flash-only run got
    the cuDNN graph of the run before it)."""
    config = torch.compiler.config
    if not hasattr(config, "cache_key_tag"):
        return
    mine = "sdpa=" + ",".join(order)
    kept = [t for t in config.cache_key_tag.split(";") if t and not t.startswith("sdpa=")]
    config.cache_key_tag = ";".join(kept + [mine])


def chosen(args, device: torch.device, dtype: torch.dtype, seq_len: int) -> str:
    """The kernel torch picks for one SDPA call of the model's heads in `dtype` (batch 1, up
    to 4,096 positions: the choice depends on shapes, dtype and mask, not the batch): causal,
    or block_causal's additive mask with `attn_implementation = 'sdpa'`; 'flex' for
    FlexAttention, which is not SDPA."""
    from torch.nn.attention import SDPBackend

    masked = args.attn_mask_type == "block_causal"
    if masked and args.attn_implementation == "flex":
        return "flex"
    s = min(seq_len, 4096)
    q = torch.zeros(1, args.n_heads, s, args.head_dim, device=device, dtype=dtype)
    kv = torch.zeros(1, args.n_kv_heads, s, args.head_dim, device=device, dtype=dtype)
    # MLA's narrower values: as trainer/models/common/attention.py pads them on the CPU
    v = torch.zeros(
        1,
        args.n_kv_heads,
        s,
        args.head_dim if device.type == "cpu" else args.v_head_dim,
        device=device,
        dtype=dtype,
    )
    mask = (
        torch.zeros(1, 1, s, s, device=device, dtype=dtype)
        if masked and args.attn_implementation == "sdpa"
        else None
    )
    picked = SDPBackend(
        torch._fused_sdp_choice(
            q,
            kv,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=args.n_heads != args.n_kv_heads,
        )
    )
    names = {int(_backend(n)): n for n in NAMES}
    return names.get(int(picked), picked.name.lower())


def describe(spec: str, order, kernel: str) -> str:
    """One line of the startup summary: the kernel that runs and the order it came from."""
    how = f"order {' > '.join(order)}" if order else "torch's own order"
    how += " (auto: measured fastest first on this GPU)" if order and spec == "auto" else ""
    return f"SDPA kernel: {_LABELS.get(kernel, kernel)} ({how}; model.sdpa_backends = {spec!r})"


def setup(spec: str, args, device: torch.device, dtype_name: str, seq_len: int) -> str:
    """Apply `model.sdpa_backends` on this rank (before the model is compiled) and return the
    startup summary's line naming the kernel a step of this model runs."""
    order = apply(spec, device)
    return describe(spec, order, chosen(args, device, getattr(torch, dtype_name), seq_len))
