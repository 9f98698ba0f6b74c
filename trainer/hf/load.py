"""Import: start a run from Hugging Face Llama weights (`checkpoint.initial_load_path` with
`initial_load_in_hf = true`), or from the model of another run's DCP checkpoint. Export at the
end of a run: `checkpoint.last_save_in_hf = true` writes `{dump_folder}/hf/` (and uploads it to
`{checkpoint.folder}/hf/` when that is an s3:// or gs:// URL). A Hugging Face folder at a URL
is read with ranged requests (trainer/hf/remote.py).

Every rank reads each full tensor from the safetensors files (memory-mapped, one at a time;
an fp8 one dequantized to float32) and keeps its own block of it, so any layout loads the same
weights without collectives; of a layer's experts it reads only those it holds.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from trainer.errors import ConfigError
from trainer.hf.mapping import (
    adapter,
    check_hf_config,
    export_shapes,
    from_hf_keys,
    hf_keys,
    stacked_experts,
)
from trainer.hf.weights import HFFolder
from trainer.models import registry


def load_initial(model, cfg, *, log=print) -> bool:
    """Load `cfg.checkpoint.initial_load_path` into the (sharded, initialised) model, for a
    run that has no checkpoint of its own to resume; False when none is configured."""
    path = cfg.checkpoint.initial_load_path
    if not path:
        return False
    t0 = time.monotonic()
    from trainer.checkpoint import storage

    if storage.is_url(path):  # a DCP checkpoint on object storage (docs/checkpoints.md)
        storage.check_path(path, "checkpoint.initial_load_path")
        storage.probe(path, "checkpoint.initial_load_path")
    else:
        path = os.path.expanduser(path)
    if not storage.isdir(path):
        raise ConfigError(f"checkpoint.initial_load_path = {path!r}: no such folder")
    if cfg.checkpoint.initial_load_in_hf:
        load_hf(model, path, flavor=cfg.model.flavor, log=log)
    else:
        load_dcp_model(model, path, cfg.checkpoint.allow_pickle)
    log(f"initialised the model from {path} in {time.monotonic() - t0:.2f}s")
    return True


def load_hf(model, folder: str, *, flavor: str, log=print) -> None:
    """Copy a Hugging Face Llama, Qwen3-MoE, DeepSeek-V3 / Kimi K2 or Qwen3-Next / Qwen3.5
    folder's weights into `model` (plain or sharded): fp8 blocks dequantized, DeepSeek-V3's
    routing biases into the balancing bias, its MTP layers into the MTP modules (those it
    lacks keep their init)."""
    hf = HFFolder(folder)
    args = model.args
    own = registry.hooks(args).hf_load(model, hf, folder, flavor, log)
    if own is not None:  # the family's own release format
        for param, full in own:
            copy_full(param, full)
        return
    check_hf_config(hf.config, args, folder, flavor)
    if hf.block is not None:
        log(
            f"{folder} holds fp8 weights in {hf.block[0]} x {hf.block[1]} blocks "
            "(quantization_config): each is dequantized to float32 as it is read"
        )
    release = adapter(args)
    depths, lines = release.import_notes(hf, args, folder)
    for line in lines:
        log(line)
    shapes = {
        n: s
        for n, s in export_shapes(args).items()
        if release.mtp_depth(n) is None or release.mtp_depth(n) < depths
    }
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    params = {n: t for n, t in tensors.items() if n in shapes}
    for name, shape in shapes.items():  # every shape first: one error, no half-load
        keys = hf_keys(name, args)
        want = shape[1:] if stacked_experts(name) else shape  # experts: one tensor each
        for key in keys:
            theirs = hf.shape(key)
            if theirs != want:
                raise ConfigError(
                    f"{folder} does not fit model.flavor = {flavor!r}: {key} has shape "
                    f"{list(theirs) if theirs else 'none (missing)'} there and {list(want)} "
                    f"here ({name}); choose the flavor and model.vocab_size the checkpoint was "
                    "made with"
                )
    for name, param in params.items():
        load_param(param, name, hf, args)
    if depths and (not dist.is_initialized() or dist.get_rank() == 0):
        for line in release.load_warnings(hf, args, depths):
            log(line)


@torch.no_grad()
def load_param(param: torch.Tensor, name: str, hf: HFFolder, args) -> None:
    """Set our parameter `name` (a DTensor shard or a plain tensor) from the folder, reading
    only this rank's experts of a stacked expert tensor."""
    from torch.distributed.tensor import DTensor

    keys = hf_keys(name, args)
    region = local_region(param)
    if region is None:  # a strided layout (FSDP over TP on one dim): cut from the full tensor
        copy_full(param, from_hf_keys(name, [hf.tensor(k) for k in keys], args))
        return
    local = param.to_local() if isinstance(param, DTensor) else param
    if local.numel() == 0:
        return
    if stacked_experts(name):
        piece = torch.stack([hf.tensor(keys[e])[region[1:]] for e in range(len(keys))[region[0]]])
    else:
        piece = from_hf_keys(name, [hf.tensor(keys[0])], args)[region]
    local.copy_(piece.to(dtype=local.dtype))


def local_region(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The block of the full tensor this rank holds (every index for a plain tensor), or None
    where the placements are not plain Shard/Replicate (a strided shard is no block)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return tuple(slice(None) for _ in param.shape)
    if not all(type(p) in (Shard, Replicate) for p in param.placements):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


@torch.no_grad()
def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set a parameter (a DTensor shard or a plain tensor) from the full tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = param.to_local() if isinstance(param, DTensor) else param
    full = full.to(device=local.device, dtype=local.dtype)
    if isinstance(param, DTensor):  # each rank cuts its own shard: no communication
        full = distribute_tensor(
            full, param.device_mesh, param.placements, src_data_rank=None
        ).to_local()
    local.copy_(full)


def load_dcp_model(model, path: str, allow_pickle: bool = False) -> None:
    """The model (not the optimizer or data position) of a DCP `step-N` folder."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from trainer.checkpoint import safe_load, storage

    if not storage.exists(storage.join(path, ".metadata")):
        raise ConfigError(
            f"checkpoint.initial_load_path = {path!r} is not a DCP checkpoint "
            "(no .metadata); set checkpoint.initial_load_in_hf = true for a "
            "Hugging Face folder"
        )
    sd = {"model": get_model_state_dict(model)}
    safe_load.load({"model_optim": sd}, path, allow_pickle=allow_pickle)
    set_model_state_dict(model, sd["model"])


def save_last_hf(model, cfg, *, log=print) -> None:
    """Write the trained model as a Hugging Face folder under `{dump_folder}/hf/` (rank 0
    gathers the full weights; every rank takes part in the gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trainer.hf.export import write_hf_folder

    t0 = time.monotonic()
    # Gathering expert (EP x FSDP) or TP x FSDP parameters whole takes two all-gathers, and
    # torch warns about it on every rank for every parameter: a one-off, not a step's.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if getattr(model, "pp_group", None) is not None:
        full = _gather_stages(model)
    else:
        full = get_model_state_dict(
            model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    out = os.path.join(cfg.job.dump_folder, "hf")
    from trainer.checkpoint import storage

    remote = storage.is_url(cfg.checkpoint.folder)  # and a copy beside the checkpoints
    if dist.get_rank() == 0:
        write_hf_folder(
            out,
            model.args,
            lambda names: {n: full.pop(n) for n in names},
            cfg,
            dtype="float32",
            log=log,
        )
        if remote:
            storage.upload_folder(out, storage.join(cfg.checkpoint.folder, "hf"))
    dist.barrier()
    where = f"{out} and {storage.join(cfg.checkpoint.folder, 'hf')}" if remote else out
    log(f"saved a Hugging Face model in {where} in {time.monotonic() - t0:.2f}s")


def _gather_stages(model) -> dict:
    """Pipeline parallelism: every stage's full tensors on rank 0 (an empty dict elsewhere).
    Each parameter is gathered over its stage's mesh in turn (one full tensor at a time on
    the device), then the ranks that share rank 0's place in their stage send their stage's
    tensors to rank 0 over the pp group."""
    mine = 0 in dist.get_process_group_ranks(model.pp_group)
    full = {}
    from trainer.hf.mapping import buffer_shapes

    buffers = set(buffer_shapes(model.args))  # MoE balancing biases: the export reads them
    tensors = [
        *model.named_parameters(),
        *((n, b) for n, b in model.named_buffers() if n in buffers),
    ]
    for name, param in tensors:
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        if mine:
            full[name] = tensor.detach().cpu()
    if not mine:
        return {}
    parts = [None] * dist.get_world_size(model.pp_group) if dist.get_rank() == 0 else None
    dist.gather_object(full, parts, dst=0, group=model.pp_group)
    return {k: v for part in parts for k, v in part.items()} if parts else {}
