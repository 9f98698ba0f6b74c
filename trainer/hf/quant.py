"""Block-quantized FP8 folders (DeepSeek-V3 and Kimi K2 as released): dequantized on load.

The releases store each projection weight `X.weight` as float8_e4m3fn with a float32
`X.weight_scale_inv` of one entry per `weight_block_size` block ([128, 128]: shape
[ceil(out / 128), ceil(in / 128)], the blocks at the right and bottom edges partial), and say
so in config.json: `quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
"activation_scheme": "dynamic", "weight_block_size": [128, 128]}`. The weight is each fp8
value times the scale of its block (DeepSeek's `weight_dequant`). Norms, the embedding, the
head, the router and its correction bias are stored unquantized. A scale may also be stored
as a power of two: an 8-bit exponent (e8m0, bias 127) in torch's float8_e8m0fnu, or as its raw
byte in uint8 (2 ** (byte - 127)); either is read as that power, never as the byte's value.
Any other `quant_method` (GPTQ, AWQ, compressed-tensors, ...) is refused: this trainer would
read its packed integers as weights.
"""

from __future__ import annotations

import torch

from trainer.errors import ConfigError

SCALE_SUFFIX = "_scale_inv"
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def quant_block(config: dict, folder: str) -> tuple[int, int] | None:
    """The (rows, columns) of one quantization block of the folder's fp8 weights, or None for
    an unquantized folder; a quantization this trainer cannot undo is one config line."""
    q = config.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4":  # gpt-oss's experts: its family's reader dequantizes them
        return None
    if method != "fp8":
        raise ConfigError(
            f"{folder}/config.json: quantization_config.quant_method = "
            f"{method!r} cannot be loaded for training here (only DeepSeek's "
            "block-scaled 'fp8' and gpt-oss's 'mxfp4' experts are dequantized); give "
            "an unquantized (bf16/fp32), fp8 or mxfp4 folder"
        )
    block = q.get("weight_block_size")
    if not (
        isinstance(block, list)
        and len(block) == 2
        and all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ConfigError(
            f"{folder}/config.json: quantization_config.weight_block_size = "
            f"{block!r}; the fp8 folders this trainer dequantizes give two "
            "positive block sizes, e.g. [128, 128]"
        )
    return block[0], block[1]


def scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 scales of a stored scale tensor: floating point as they are, e8m0 bytes
    (uint8) as 2 ** (byte - 127); 255 (e8m0's NaN) or another integer type is refused."""
    if scale_inv.dtype == torch.uint8:
        if bool((scale_inv == 255).any()):
            raise ValueError("an e8m0 scale is 255, the format's NaN")
        return torch.exp2(scale_inv.to(torch.float32) - 127.0)
    if not scale_inv.is_floating_point():
        raise ValueError(f"scales stored as {scale_inv.dtype}: expected floats or e8m0 bytes")
    return scale_inv.float()


@torch.no_grad()
def dequantize(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float32 weight = fp8 value x the scale of its block: converted once, then each row of
    blocks scaled in place (the memory of the result and one row of scales per block row)."""
    rows, cols = weight.shape
    br, bc = block
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"scale of shape {list(scale_inv.shape)} for a {rows} x {cols} weight "
            f"in {br} x {bc} blocks (expected {list(want)})"
        )
    out = weight.to(torch.float32)
    # each row of blocks times its scales spread over the columns (the last block partial)
    scale = scales(scale_inv).repeat_interleave(bc, dim=1)[:, :cols]
    for i in range(want[0]):
        out[i * br : (i + 1) * br].mul_(scale[i])
    return out
