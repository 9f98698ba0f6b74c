"""Safetensors files of a Hugging Face model folder: written shard by shard (so at most one
shard of converted tensors is in memory), read tensor by tensor (block-scaled fp8 weights
dequantized: trainer/hf/quant.py)."""

from __future__ import annotations

import json
import os
from typing import Callable

import torch

from trainer.errors import ConfigError
from trainer.hf.mapping import adapter, hf_name, hf_tensors
from trainer.hf.quant import FP8, SCALE_SUFFIX, dequantize, quant_block
from trainer.models.args import ModelArgs

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def plan_shards(numels: dict[str, int], itemsize: int, max_shard_bytes: int) -> list[list[str]]:
    """Consecutive parameter names grouped into shards of at most max_shard_bytes (a tensor
    larger than the limit gets a shard of its own); `numels`: the elements each name writes."""
    shards, current, size = [], [], 0
    for name, numel in numels.items():
        nbytes = itemsize * numel
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        size += nbytes
    if current:
        shards.append(current)
    return shards


def write_weights(
    out_dir: str,
    args: ModelArgs,
    shapes: dict[str, tuple[int, ...]],
    fetch: Callable[[list[str]], dict[str, torch.Tensor]],
    *,
    dtype: str,
    max_shard_bytes: int,
) -> list[str]:
    """Write `model.safetensors`, or numbered shards and their index when the weights exceed
    max_shard_bytes. `fetch(names)` returns our full tensors for those parameter names; they
    are converted (names, q/k layout, dtype) one by one. Returns the files written."""
    from safetensors.torch import save_file

    target = DTYPES[dtype]
    copies = adapter(args).copies
    numels = {
        n: int(torch.Size(s).numel()) * (1 + len(copies(hf_name(n, args), args)))
        if n in ("tok_embeddings.weight", "output.weight")
        else int(torch.Size(s).numel())
        for n, s in shapes.items()
    }  # the release's copies of the embedding and head (DeepSeek-V3's MTP layers)
    shards = plan_shards(numels, target.itemsize, max_shard_bytes)
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map, total = {}, 0
    for names, fname in zip(shards, files, strict=True):
        tensors = fetch(names)
        out = {}
        for name in names:
            for key, t in hf_tensors(name, tensors.pop(name), args).items():
                out[key] = t = t.to(target).contiguous()
                weight_map[key] = fname
                total += t.numel() * t.element_size()
        save_file(out, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del out
    if len(files) > 1:
        write_json(
            os.path.join(out_dir, INDEX),
            {"metadata": {"total_size": total}, "weight_map": weight_map},
        )
    return files


def write_json(path: str, obj: dict) -> None:
    with open(path, "w") as fh:
        json.dump(obj, fh, indent=2)
        fh.write("\n")


class HFFolder:
    """A Hugging Face model folder opened for reading: config.json and where each tensor is."""

    def __init__(self, folder: str):
        self.folder = folder
        self._open: dict[str, object] = {}  # file name -> safe_open handle
        from trainer.checkpoint import storage
        from trainer.hf.remote import read_json

        self.config = read_json(storage.join(folder, "config.json"))  # a URL: read remotely
        if self.config is None:
            raise ConfigError(
                f"checkpoint.initial_load_path = {folder!r} is not a Hugging Face "
                "model folder (no config.json)"
            )
        index = read_json(storage.join(folder, INDEX))
        if index is not None:
            self.weight_map = index["weight_map"]
        elif storage.exists(storage.join(folder, SINGLE)):
            self.weight_map = {k: SINGLE for k in self._keys(SINGLE)}
        else:
            raise ConfigError(
                f"checkpoint.initial_load_path = {folder!r} has no {SINGLE} or "
                f"{INDEX} (only safetensors weights are read)"
            )
        self.block = quant_block(self.config, folder)  # fp8 blocks, or None

    def _file(self, fname: str):
        if fname not in self._open:
            self._open[fname] = _guarded(_join(self.folder, fname), _safe_open)
        return self._open[fname]

    def _keys(self, fname: str) -> list[str]:
        return list(self._file(fname).keys())

    def shape(self, key: str) -> tuple[int, ...] | None:
        fname = self.weight_map.get(key)
        return None if fname is None else tuple(self._file(fname).get_slice(key).get_shape())

    def has(self, key: str) -> bool:
        return key in self.weight_map

    def tensor(self, key: str) -> torch.Tensor:
        """The stored tensor (memory-mapped); an fp8 weight dequantized to float32 with its
        `_scale_inv` blocks."""
        t = self._read(key)
        scale = key + SCALE_SUFFIX
        if scale in self.weight_map:
            if self.block is None:
                raise ConfigError(
                    f"{self.folder}: {key} has a {scale} but config.json no "
                    "quantization_config with its weight_block_size"
                )
            try:
                return dequantize(t, self._read(scale), self.block)
            except ValueError as e:
                raise ConfigError(f"{self.folder}: {key}: {e}") from None
        if t.dtype in FP8:
            raise ConfigError(
                f"{self.folder}: {key} is {t.dtype} without a {scale}: no scale "
                "to dequantize it with"
            )
        return t

    def _read(self, key: str) -> torch.Tensor:
        fname = self.weight_map[key]
        return _guarded(_join(self.folder, fname), lambda _: self._file(fname).get_tensor(key))


def _join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if "://" in folder else os.path.join(folder, name)


def _safe_open(path: str):
    """safetensors' handle of a local file; ranged reads of an object at a URL."""
    if "://" in path:
        from trainer.hf.remote import RemoteSafetensors

        return RemoteSafetensors(path)
    from safetensors import safe_open

    return safe_open(path, framework="pt")


def _guarded(path: str, read):
    """read(path), with a damaged or truncated safetensors file as one line (the library
    raises SafetensorError: 'MetadataIncompleteBuffer', 'incomplete metadata')."""
    from safetensors import SafetensorError

    try:
        return read(path)
    except FileNotFoundError:
        raise ConfigError(f"{path} is missing (named by the folder's {INDEX})") from None
    except (SafetensorError, OSError) as e:
        raise ConfigError(
            f"{path} cannot be read as safetensors, truncated or damaged "
            f"({e}); copy or export it again"
        ) from None
