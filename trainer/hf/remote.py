"""Hugging Face folders at s3:// / gs:// URLs.

Reading (`checkpoint.initial_load_path` with `initial_load_in_hf`): a safetensors file is an
8-byte header length, a JSON header (each tensor's dtype, shape and byte range) and the raw
bytes. `RemoteSafetensors` reads the header with two ranged GETs and each tensor with one, so
a rank fetches only the tensors it loads (of a layer's experts, those it holds) and nothing is
staged on local disk. It answers the part of safetensors' `safe_open` handle that
weights.HFFolder uses: keys(), get_slice(key).get_shape(), get_tensor(key).

Writing (`trainer.convert to-hf ... s3://...`, `checkpoint.last_save_in_hf` with a URL
checkpoint.folder): the folder is written locally as always, then uploaded file by file
(storage.upload_folder; large files go up in parts).
"""

from __future__ import annotations

import json
import struct

import torch

from trainer.checkpoint import storage

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
for _name, _attr in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)


class _Slice:
    def __init__(self, shape):
        self.shape = list(shape)

    def get_shape(self) -> list[int]:
        return self.shape


class RemoteSafetensors:
    """A safetensors object at a URL, read tensor by tensor with ranged GETs."""

    def __init__(self, url: str):
        self.url, self.fs = url, storage.filesystem(url)
        (n,) = struct.unpack("<Q", self.fs.cat_file(url, start=0, end=8))
        header = json.loads(self.fs.cat_file(url, start=8, end=8 + n))
        header.pop("__metadata__", None)
        self.header, self.base = header, 8 + n

    def keys(self) -> list[str]:
        return list(self.header)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self.header[key]["shape"])

    def get_tensor(self, key: str) -> torch.Tensor:
        entry = self.header[key]
        start, end = entry["data_offsets"]
        if entry["dtype"] not in DTYPES:
            raise OSError(f"tensor {key} has dtype {entry['dtype']}, not read here")
        data = self.fs.cat_file(self.url, start=self.base + start, end=self.base + end)
        if end == start:
            return torch.empty(entry["shape"], dtype=DTYPES[entry["dtype"]])
        return torch.frombuffer(bytearray(data), dtype=DTYPES[entry["dtype"]]).reshape(
            entry["shape"]
        )


def read_json(path: str) -> dict | None:
    """A small JSON file of a local folder or a URL; None if it is not there."""
    if storage.is_url(path):
        try:
            return json.loads(storage.filesystem(path).cat_file(path))
        except FileNotFoundError:
            return None
    import os

    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return json.load(fh)
