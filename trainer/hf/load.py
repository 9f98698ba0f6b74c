"""Import: start a run from Hugging Face Llama weights (`checkpoint.initial_load_path` with
`initial_load_in_hf = true`), or from the model of another run's DCP checkpoint. Export at the
end of a run: `checkpoint.last_save_in_hf = true` writes `{dump_folder}/hf/`.

Every rank reads each full tensor from the safetensors files (memory-mapped, one at a time) and
keeps its own shard of it, so any FSDP/HSDP layout loads the same weights without collectives.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist

from trainer.errors import ConfigError
from trainer.hf.mapping import (check_hf_config, export_shapes, from_hf_keys, hf_keys,
                                stacked_experts)
from trainer.hf.weights import HFFolder


def load_initial(model, cfg, *, log=print) -> bool:
    """Load `cfg.checkpoint.initial_load_path` into the (sharded, initialised) model, for a
    run that has no checkpoint of its own to resume; False when none is configured."""
    path = cfg.checkpoint.initial_load_path
    if not path:
        return False
    t0 = time.monotonic()
    path = os.path.expanduser(path)
    if not os.path.isdir(path):
        raise ConfigError(f"checkpoint.initial_load_path = {path!r}: no such folder")
    if cfg.checkpoint.initial_load_in_hf:
        load_hf(model, path, flavor=cfg.model.flavor, log=log)
    else:
        load_dcp_model(model, path, cfg.checkpoint.allow_pickle)
    log(f"initialised the model from {path} in {time.monotonic() - t0:.2f}s")
    return True


def load_hf(model, folder: str, *, flavor: str, log=print) -> None:
    """Copy a Hugging Face Llama, Qwen3-MoE or DeepSeek-V3 folder's weights into `model`
    (plain or sharded). DeepSeek-V3's routing biases load into the balancing bias; MTP
    modules, which the folder does not hold, keep their seeded init."""
    hf = HFFolder(folder)
    args = model.args
    check_hf_config(hf.config, args, folder, flavor)
    shapes = export_shapes(args)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    params = {n: t for n, t in tensors.items() if n in shapes}
    if args.mtp_layers:
        from trainer.hf.deepseek import MTP_NOTE

        log(MTP_NOTE.format(n=args.mtp_layers, what="they start from their seeded init"))
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
                    "made with")
    for name, param in params.items():
        full = from_hf_keys(name, [hf.tensor(k) for k in hf_keys(name, args)], args)
        copy_full(param, full)


@torch.no_grad()
def copy_full(param: torch.Tensor, full: torch.Tensor) -> None:
    """Set a parameter (a DTensor shard or a plain tensor) from the full tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    local = param.to_local() if isinstance(param, DTensor) else param
    full = full.to(device=local.device, dtype=local.dtype)
    if isinstance(param, DTensor):  # each rank cuts its own shard: no communication
        full = distribute_tensor(full, param.device_mesh, param.placements,
                                 src_data_rank=None).to_local()
    local.copy_(full)


def load_dcp_model(model, path: str, allow_pickle: bool = False) -> None:
    """The model (not the optimizer or data position) of a DCP `step-N` folder."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from trainer.checkpoint import safe_load

    meta = os.path.join(path, ".metadata")
    if not os.path.isfile(meta):
        raise ConfigError(f"checkpoint.initial_load_path = {path!r} is not a DCP checkpoint "
                          "(no .metadata); set checkpoint.initial_load_in_hf = true for a "
                          "Hugging Face folder")
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
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    out = os.path.join(cfg.job.dump_folder, "hf")
    if dist.get_rank() == 0:
        write_hf_folder(out, model.args, lambda names: {n: full.pop(n) for n in names}, cfg,
                        dtype="float32", log=log)
    dist.barrier()
    log(f"saved a Hugging Face model in {out} in {time.monotonic() - t0:.2f}s")


def _gather_stages(model) -> dict:
    """Pipeline parallelism: every stage's full tensors on rank 0 (an empty dict elsewhere).
    Each parameter is gathered over its stage's mesh in turn (one full tensor at a time on
    the device), then the ranks that share rank 0's place in their stage send their stage's
    tensors to rank 0 over the pp group."""
    mine = 0 in dist.get_process_group_ranks(model.pp_group)
    full = {}
    from trainer.hf.mapping import buffer_shapes

    buffers = set(buffer_shapes(model.args))  # MoE balancing biases: the export reads them
    tensors = [*model.named_parameters(),
               *((n, b) for n, b in model.named_buffers() if n in buffers)]
    for name, param in tensors:
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        if mine:
            full[name] = tensor.detach().cpu()
    if not mine:
        return {}
    parts = [None] * dist.get_world_size(model.pp_group) if dist.get_rank() == 0 else None
    dist.gather_object(full, parts, dst=0, group=model.pp_group)
    return {k: v for part in parts for k, v in part.items()} if parts else {}
