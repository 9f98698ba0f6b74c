"""Write a Hugging Face folder (LlamaForCausalLM, Qwen3MoeForCausalLM, DeepseekV3ForCausalLM
with its MTP layers, or a family's own release format: its hooks' `hf_export`): unquantized
weights in the chosen dtype, config.json, generation_config.json and the run's tokenizer."""

from __future__ import annotations

import os

from trainer.hf.mapping import adapter, export_shapes, hf_config
from trainer.hf.tokenizer import export_tokenizer
from trainer.hf.weights import write_json, write_weights
from trainer.models import registry

DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3  # as Hugging Face's own save_pretrained


def run_tokenizer_path(data) -> str | None:
    """The tokenizer file a run with this `[data]` config trained with (None: synthetic)."""
    if data.dataset == "synthetic":
        return None
    if data.tokenizer_path:
        return os.path.expanduser(data.tokenizer_path)
    if data.store_path:
        from trainer.data.store import TOKENIZER_FILE

        if "://" in data.store_path:  # the store's tokenizer, copied into the cache once
            from trainer.data.remote import cached_tokenizer
            from trainer.data.store import read_remote_manifest

            url = data.store_path.rstrip("/")
            sha = read_remote_manifest(url)["tokenizer"]["sha256"]
            return cached_tokenizer(f"{url}/{TOKENIZER_FILE}", sha, data.cache_dir)
        return os.path.join(os.path.expanduser(data.store_path), TOKENIZER_FILE)
    from trainer.data.cache import stdlib_cache_dir

    return str(stdlib_cache_dir(data) / f"tokenizer-bpe{data.vocab_size}.model")


def write_hf_folder(
    out_dir: str,
    args,
    fetch,
    cfg,
    *,
    dtype: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    log=print,
) -> None:
    """`fetch(names)` gives our full tensors by parameter name (see weights.write_weights);
    `cfg` is the run's JobConfig (for the tokenizer and the sequence length). An s3:// or
    gs:// `out_dir` is written to a local temporary folder, then uploaded (trainer/hf/remote.py)."""
    from trainer.checkpoint import storage

    if storage.is_url(out_dir):
        import tempfile

        with tempfile.TemporaryDirectory(prefix="hf-export-") as tmp:
            write_hf_folder(
                tmp,
                args,
                fetch,
                cfg,
                dtype=dtype,
                max_shard_bytes=max_shard_bytes,
                log=lambda line: log(line.replace(tmp, out_dir)),
            )
            storage.upload_folder(tmp, out_dir)
        return
    os.makedirs(out_dir, exist_ok=True)
    own = registry.hooks(args).hf_export(
        out_dir, args, fetch, dtype=dtype, max_shard_bytes=max_shard_bytes, log=log
    )
    if own is not None:  # the family's own release format
        config_of, files = own
    else:
        config_of, files = (
            hf_config,
            _write_llama_like(
                out_dir, args, fetch, dtype=dtype, max_shard_bytes=max_shard_bytes, log=log
            ),
        )
    ids = {}
    tok_path = run_tokenizer_path(cfg.data)
    if tok_path is None:
        log("no tokenizer to export: the run trained on synthetic tokens")
    elif not os.path.isfile(tok_path):
        log(f"tokenizer {tok_path} not found: exported without a tokenizer")
    else:
        ids = export_tokenizer(tok_path, out_dir, model_max_length=cfg.training.seq_len)
    bos, eos = ids.get("bos_token"), ids.get("eos_token")
    write_json(
        os.path.join(out_dir, "config.json"), config_of(args, dtype=dtype, bos_id=bos, eos_id=eos)
    )
    write_json(
        os.path.join(out_dir, "generation_config.json"), {"bos_token_id": bos, "eos_token_id": eos}
    )
    log(
        f"wrote {', '.join(files)} ({dtype}, unquantized: no quantization_config) and "
        f"config.json to {out_dir}"
    )


def _write_llama_like(
    out_dir: str, args, fetch, *, dtype: str, max_shard_bytes: int, log
) -> list[str]:
    """The decoder's tensors under its family's release names (trainer/hf/mapping.py)."""
    for line in adapter(args).export_notes(args, fetch):
        log(line)
    return write_weights(
        out_dir, args, export_shapes(args), fetch, dtype=dtype, max_shard_bytes=max_shard_bytes
    )
