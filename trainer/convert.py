"""Convert a committed DCP checkpoint into a Hugging Face LlamaForCausalLM folder (a Qwen3-MoE
flavor: Qwen3MoeForCausalLM; a deepseek_v3 one: DeepseekV3ForCausalLM with its MTP layers):

    python -m trainer.convert to-hf OUTPUTS/checkpoint/step-1000 OUT_DIR [--dtype bfloat16]
    python -m trainer.convert to-hf s3://ckpt/run1/step-1000 s3://models/run1 \\
        --config OUTPUTS/config.toml

Either folder may be an s3:// or gs:// URL: a checkpoint there is read by DCP's fsspec reader,
an output there is written locally to a temporary folder and uploaded.

The model shape and tokenizer come from the run's saved config (`{dump_folder}/config.toml`,
two levels above the step folder, or --config). Runs on one process, whatever world size
saved the checkpoint: DCP reads the full tensors, a shard's worth at a time (`--max-shard-size`
GiB per safetensors file), so the whole model is never held twice.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from trainer.errors import CheckpointError, UserError
from trainer.hf.weights import DTYPES

PREFIX = "model_optim.model."


def read_run_config(checkpoint_dir: str, config_path: str | None):
    from trainer.config.job import load_config

    if not config_path and "://" in checkpoint_dir:
        raise CheckpointError(
            f"{checkpoint_dir} is in an object store, away from its run's "
            "config.toml: pass --config {dump_folder}/config.toml"
        )
    path = config_path or os.path.join(checkpoint_dir, os.pardir, os.pardir, "config.toml")
    if not os.path.isfile(path):
        raise CheckpointError(
            f"no run config {os.path.normpath(path)} (the dump folder's config.toml); pass --config"
        )
    return load_config(["--job.config_file", path])


def saved_shapes(checkpoint_dir: str, allow_pickle: bool = False) -> dict[str, tuple[int, ...]]:
    """Our parameter names and shapes as saved in the DCP metadata."""
    from trainer.checkpoint import safe_load, storage

    if not storage.exists(storage.join(checkpoint_dir, ".metadata")):
        raise CheckpointError(
            f"{checkpoint_dir} is not a committed DCP checkpoint (no "
            ".metadata); give a {dump_folder}/checkpoint/step-N folder"
        )
    meta = safe_load.read_metadata(checkpoint_dir, allow_pickle).state_dict_metadata
    return {k[len(PREFIX) :]: tuple(m.size) for k, m in meta.items() if k.startswith(PREFIX)}


def dcp_fetch(checkpoint_dir: str, shapes: dict, allow_pickle: bool = False):
    """fetch(names) -> our full fp32 tensors, read from the DCP checkpoint on this process."""
    import torch

    from trainer.checkpoint import safe_load

    def fetch(names: list[str]) -> dict:
        model = {n: torch.empty(shapes[n], dtype=torch.float32) for n in names}
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, meant
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            safe_load.load(
                {"model_optim": {"model": model}},
                checkpoint_dir,
                no_dist=True,
                allow_pickle=allow_pickle,
            )
        return model

    return fetch


def to_hf(
    checkpoint_dir: str,
    out_dir: str,
    *,
    dtype: str,
    max_shard_gib: float,
    config_path: str | None = None,
    allow_pickle: bool = False,
) -> None:
    from trainer.hf.export import write_hf_folder
    from trainer.hf.mapping import buffer_shapes, export_problem, param_shapes
    from trainer.models.common.attention import rope_args
    from trainer.models.flavors import model_args

    saved = saved_shapes(checkpoint_dir, allow_pickle)
    cfg = read_run_config(checkpoint_dir, config_path)
    vocab = saved.get("tok_embeddings.weight", (0,))[0]
    mtp = {k: v for k, v in saved.items() if k.startswith("mtp.")}
    args = model_args(
        cfg.model.flavor,
        vocab_size=vocab,
        max_seq_len=cfg.training.seq_len,
        n_layers=cfg.model.n_layers,
        moe_config=cfg.moe,
        mtp_layers=len({k.split(".")[1] for k in mtp}),
        **rope_args(cfg.model),
    )
    problem = export_problem(args)
    if problem:
        raise CheckpointError(f"{checkpoint_dir}: {problem}")
    expected = {**param_shapes(args), **buffer_shapes(args)}
    if saved != expected:
        diff = sorted(set(saved.items()) ^ set(expected.items()))[:2]
        raise CheckpointError(
            f"{checkpoint_dir} does not hold a {cfg.model.flavor} model as "
            f"its run config says (first differences: {diff})"
        )
    write_hf_folder(
        out_dir,
        args,
        dcp_fetch(checkpoint_dir, saved, allow_pickle),
        cfg,
        dtype=dtype,
        max_shard_bytes=int(max_shard_gib * 1024**3),
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.convert",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("to-hf", help="DCP step-N folder -> Hugging Face LlamaForCausalLM folder")
    p.add_argument("checkpoint_dir")
    p.add_argument("out_dir")
    p.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="dtype of the written weights (default float32: lossless)",
    )
    p.add_argument(
        "--max-shard-size",
        type=float,
        default=5.0,
        metavar="GIB",
        help="split the weights into files of at most this many GiB (default 5)",
    )
    p.add_argument(
        "--config", help="the run's config.toml (default: two levels above CHECKPOINT_DIR)"
    )
    p.add_argument(
        "--allow-pickle",
        "--allow_pickle",
        action="store_true",
        help="load a checkpoint whose metadata names classes outside DCP's own "
        "(older torch): it can run code, so only for your own checkpoints",
    )
    a = parser.parse_args(argv)
    try:
        from trainer.checkpoint import storage

        for key, path in (("checkpoint_dir", a.checkpoint_dir), ("out_dir", a.out_dir)):
            storage.check_path(path, key)  # s3:// or gs:// (read and written through fsspec)
            storage.probe(path, key)
        source = (
            a.checkpoint_dir.rstrip("/")
            if storage.is_url(a.checkpoint_dir)
            else os.path.abspath(a.checkpoint_dir)
        )
        to_hf(
            source,
            a.out_dir,
            dtype=a.dtype,
            max_shard_gib=a.max_shard_size,
            config_path=a.config,
            allow_pickle=a.allow_pickle,
        )
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
