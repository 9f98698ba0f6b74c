"""The `[checkpoint]` config section: where Distributed Checkpoints are saved, how often, how
many are kept, how a resume checks them, and how an object store is used (docs/checkpoints.md)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.base import opt
from trainer.errors import ConfigError


@dataclass
class Checkpoint:
    """Distributed Checkpoint saves, resumes, integrity and Hugging Face output
    (docs/checkpoints.md)."""

    enable: bool = opt(False, "Save Distributed Checkpoints and resume from them")
    folder: str = opt(
        "checkpoint",
        "Checkpoint folder, relative to job.dump_folder, or an "
        "object store URL: s3://bucket/prefix, gs://bucket/prefix",
    )
    interval: int = opt(500, "Save every this many steps (and at the last step)", min=1)
    keep_latest_k: int = opt(10, "Keep the newest k checkpoints; 0 = keep all", min=0)
    load_step: int = opt(-1, "Resume from this step instead of the latest; -1 = latest", min=-1)
    reset_optimizer: bool = opt(
        False,
        "Resume a checkpoint saved with another optimizer.name "
        "(AdamW <-> Muon): the model, data position and schedule load, "
        "the optimizer starts afresh",
    )
    async_mode: str = opt(
        "disabled",
        "disabled, or async: write in a background thread while training",
        choices=("disabled", "async"),
    )
    initial_load_path: str = opt(
        "",
        "A fresh run (no checkpoint of its own) starts from this model: "
        "a Hugging Face folder or a DCP step-N folder (s3:// or gs:// "
        "for a DCP checkpoint)",
    )
    initial_load_in_hf: bool = opt(
        False,
        "initial_load_path is a Hugging Face Llama folder (safetensors), not a DCP checkpoint",
    )
    last_save_in_hf: bool = opt(
        False, "Also write the final model as a Hugging Face folder in {dump_folder}/hf"
    )
    verify: str = opt(
        "auto",
        "Check at load: 'checksums' reads every file of the checkpoint, "
        "'sizes' compares sizes with its manifest, 'auto' = checksums up to 8 GiB",
        choices=("auto", "checksums", "sizes"),
    )
    on_save_error: str = opt(
        "stop",
        "A save the storage refuses (disk full, permissions, I/O "
        "error): 'stop' the run with one line, or 'continue' training",
        choices=("stop", "continue"),
    )
    store_retries: int = opt(
        5,
        "s3:// requests (checkpoints, token stores, HF folders) met by 503 "
        "SlowDown, a 5xx, a timeout or a reset: retries",
        min=0,
        max=50,
    )
    store_timeout_seconds: float = opt(
        60.0, "s3:// requests unanswered this long: retried", min=0.1
    )
    store_threads: int = opt(
        8,
        "s3:// and gs:// saves: files per rank written at once (each rank's share split in "
        "as many), and loads: files read at once",
        min=1,
        max=64,
    )
    store_lease: str = opt(
        "required",
        "An s3:// folder's lease needs a store that honours "
        "conditional writes: 'required' refuses one that does not, "
        "'unchecked' runs there without exclusivity",
        choices=("required", "unchecked"),
    )
    allow_pickle: bool = opt(
        False,
        "Load checkpoints whose metadata names classes outside DCP's "
        "own (older torch versions): a pickle can run code, so only for "
        "checkpoints you wrote yourself (docs/security.md)",
    )

    def validate(self) -> None:
        if self.load_step != -1 and not self.enable:
            raise ConfigError(
                f"checkpoint.load_step = {self.load_step} needs checkpoint.enable = "
                "true (loading is part of checkpointing)"
            )
        if not self.folder:
            raise ConfigError("checkpoint.folder is empty; name a folder (e.g. 'checkpoint')")
        for key, path in (("folder", self.folder), ("initial_load_path", self.initial_load_path)):
            scheme = path.split("://", 1)[0] if "://" in path else None
            if scheme not in (None, "s3", "gs"):
                raise ConfigError(
                    f"checkpoint.{key} = {path!r}: the scheme {scheme}:// is not "
                    "supported; use a local folder, s3://bucket/prefix or "
                    "gs://bucket/prefix"
                )
            if scheme is not None and not path.split("://", 1)[1].split("/", 1)[0]:
                raise ConfigError(
                    f"checkpoint.{key} = {path!r} names no bucket; use {scheme}://bucket/prefix"
                )
        if self.initial_load_in_hf and "://" in self.initial_load_path:
            raise ConfigError(
                f"checkpoint.initial_load_path = {self.initial_load_path!r}: a "
                "Hugging Face folder must be local (URLs: DCP checkpoints only)"
            )
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ConfigError(
                "checkpoint.initial_load_in_hf = true needs "
                "checkpoint.initial_load_path (a Hugging Face model folder)"
            )
