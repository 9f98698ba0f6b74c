"""Qwen3-Next / Qwen3.5 folders in and out of a run (trainer/hf/qwen3_next.py converts the
tensors): the import reads a release's tensors a layer at a time and each rank keeps its block
of ours; the export writes Qwen3NextForCausalLM's tensors and config.json."""

from __future__ import annotations

import os

import torch

from trainer.errors import ConfigError
from trainer.hf.weights import DTYPES, INDEX, SINGLE, plan_shards, write_json
from trainer.models.qwen3_next import hf as qwen3_next


class _Folder:
    """An HFFolder as the mapping `release_parts` reads (`in`, `[]`)."""

    def __init__(self, hf):
        self.hf = hf

    def __contains__(self, key: str) -> bool:
        return self.hf.has(key)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.hf.tensor(key)


def release_into(model, hf, folder: str, flavor: str, log=print):
    """(our tensor, its full value) for every parameter (a DTensor shard or a plain tensor; a
    pipeline stage's only) and balancing bias of `model`, read from the folder `hf`
    (trainer/hf/weights.HFFolder) a layer at a time: the caller copies each into place. The
    release's MTP module goes into ours (model.mtp_layers = 1); `log` says where either
    lacks it (a module the folder lacks keeps its init)."""
    args = model.args
    problem = args.mtp_export_problem()
    if problem:
        raise ConfigError(f"{folder}: {problem}")
    qwen3_next.check_release_config(hf.config, args, folder, flavor)
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    wanted = {n for n in qwen3_next.hybrid_shapes(args, buffers=True) if n in tensors}
    note = mtp_note(qwen3_next.has_mtp(_Folder(hf)), args.mtp_layers)
    if note:
        log(f"{folder}: {note}")
    if not qwen3_next.has_mtp(_Folder(hf)):
        wanted = {n for n in wanted if not n.startswith("mtp.")}
    for part in qwen3_next.release_parts(_Folder(hf), args):
        for name, full in part.items():
            if name not in wanted:
                continue
            if tuple(full.shape) != tuple(tensors[name].shape):
                raise ConfigError(
                    f"{folder} does not fit model.flavor = {flavor!r}: {name} "
                    f"has shape {list(full.shape)} there and "
                    f"{list(tensors[name].shape)} here; choose the flavor and "
                    "model.vocab_size the checkpoint was made with"
                )
            yield tensors[name], full
            wanted.discard(name)
    if wanted:
        raise ConfigError(
            f"{folder} lacks {len(wanted)} of this model's tensors (e.g. "
            f"{sorted(wanted)[0]}); is it a {flavor} checkpoint?"
        )


def mtp_note(has_mtp: bool, depths: int) -> str | None:
    """What an import does with the release's MTP module, or None when nothing to say."""
    if has_mtp and not depths:
        return "its MTP module (mtp.*) is not loaded (model.mtp_layers = 0)"
    if depths:
        return "multi-token prediction (model.mtp_layers = 1): module 0 " + (
            "from the release's mtp.*"
            if has_mtp
            else "starts from its seeded init (the folder has no mtp.* tensors)"
        )
    return None


def write_release(
    out_dir: str, args, fetch, *, dtype: str, max_shard_bytes: int, log=print
) -> list[str]:
    """Write the release's tensors (Qwen3NextForCausalLM's names and fused projections) from
    `fetch(names)` (our full tensors), in safetensors files of at most max_shard_bytes. A
    non-zero balancing bias has no place there: said, and left out."""
    from safetensors.torch import save_file

    from trainer.hf.mapping import routing_bias_note

    problem = qwen3_next.export_problem(args)
    if problem:
        raise ConfigError(problem)
    ours = fetch(list(qwen3_next.hybrid_shapes(args, buffers=True)))
    biases = {n: ours.pop(n) for n in [n for n in ours if n.endswith("router.expert_bias")]}
    note = routing_bias_note(biases, "Qwen3NextForCausalLM")
    if note:
        log(note)
    if args.mtp_layers:
        log(
            "multi-token prediction: module 0 exported under the release's names (mtp.fc, "
            "mtp.pre_fc_norm_*, mtp.layers.0, mtp.norm; num_nextn_predict_layers = 1; "
            "transformers skips them)"
        )
    target = DTYPES[dtype]
    release = {
        k: t.to(target, copy=True).contiguous()
        for k, t in qwen3_next.to_release(ours, args, "qwen3_next").items()  # no shared storage
    }
    shards = plan_shards(
        {k: t.numel() for k, t in release.items()}, target.itemsize, max_shard_bytes
    )
    files = (
        [SINGLE]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for names, fname in zip(shards, files, strict=True):
        save_file(
            {k: release[k] for k in names}, os.path.join(out_dir, fname), metadata={"format": "pt"}
        )
    if len(files) > 1:
        write_json(
            os.path.join(out_dir, INDEX),
            {
                "metadata": {
                    "total_size": sum(t.numel() * target.itemsize for t in release.values())
                },
                "weight_map": {k: f for names, f in zip(shards, files, strict=True) for k in names},
            },
        )
    return files
