"""The job configuration: one typed dataclass per TOML section, loaded from TOML + CLI overrides.

Precedence is CLI > TOML > defaults. Every problem the config alone can reveal (unknown keys,
wrong types, out-of-range values, impossible combinations, including those that depend on the
world size) raises `ConfigError` here, before any process group exists that could hang.

    python -m trainer.config --check --world-size 4 --job.config_file configs/debug_model.toml
    python -m trainer.config --check --nnodes 1 --nproc-per-node "$NGPU" ...   # prints ranks/node
    python -m trainer.config --help      # the reference of every key
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field

from trainer.config_base import (check_field, coerce, did_you_mean, from_cli, opt, parse_cli,
                                  toml_value, type_name)
from trainer.batch_schedule import check_ramp
from trainer.data.config import DataConfig
from trainer.errors import ConfigError, UserError
from trainer.evals.config import Eval
from trainer.float8 import Float8, check_config as check_float8
from trainer.lr_schedule import DECAY_SHAPES, decay_steps
from trainer.wandb_logger import check_config as check_wandb

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DTYPES = ("bfloat16", "float32")
ATTN_MASK_TYPES = ("causal", "block_causal")
POSITIONS = ("sequence", "document")
ATTN_IMPLEMENTATIONS = ("auto", "flex", "sdpa", "per_document")
DEVICES = ("auto", "cpu", "cuda")
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP")
SPIKE_ACTIONS = ("log", "skip", "rollback")


@dataclass
class Job:
    config_file: str = opt("", "TOML file this config was loaded from (set with --job.config_file)")
    dump_folder: str = opt("./outputs", "Folder for the effective config, checkpoints and TensorBoard")
    description: str = opt("", "Free-text description of the run")
    seed: int = opt(0, "Seed for weight init, data order and every RNG", min=0, max=2**32 - 1)
    stop_signals: list[str] = opt(["SIGTERM", "SIGUSR1", "SIGINT"],
                                  "Signals that make every rank save at the next step and exit 3")

    def validate(self) -> None:
        for name in self.stop_signals:
            if name not in STOP_SIGNALS:
                raise ConfigError(f"job.stop_signals has {name!r}; valid signals: "
                                  f"{', '.join(STOP_SIGNALS)}")


@dataclass
class Model:
    name: str = opt("llama3", "Model family", choices=("llama3",))
    flavor: str = opt("debugmodel", "Model size: debugmodel, debugmodel-tiny, debugmodel-3.2, 1B, llama3.2-1B, llama3.2-3B, 8B, 70B")
    vocab_size: int = opt(0, "Model vocab; 0 = the tokenizer's, padded to vocab_size_multiple_of", min=0)
    vocab_size_multiple_of: int = opt(64, "Pad the model vocab up to a multiple of this", min=1)
    attn_mask_type: str = opt("causal", "causal: every earlier token of the window; block_causal: "
                              "only earlier tokens of the same document (documents from the "
                              "data's BOS/EOS; README: Documents in packed windows)",
                              choices=ATTN_MASK_TYPES)
    positions: str = opt("sequence", "RoPE positions: sequence (0..seq_len-1 across the window) "
                         "or document (restart at 0 at each document; needs block_causal)",
                         choices=POSITIONS)
    attn_implementation: str = opt(
        "auto", "block_causal kernel: auto (flex on CUDA, per_document on CPU), flex "
        "(FlexAttention, compiled, one BlockMask per microbatch; CUDA only), sdpa (SDPA with "
        "an additive [batch, 1, seq, seq] mask) or per_document (one causal SDPA per document); "
        "causal always uses SDPA's causal kernel", choices=ATTN_IMPLEMENTATIONS)

    def validate(self) -> None:
        from trainer.model_args import FLAVORS

        if self.flavor not in FLAVORS:
            raise ConfigError(f"model.flavor = {self.flavor!r} is not valid; choose one of "
                              f"{', '.join(repr(f) for f in FLAVORS)}{did_you_mean(self.flavor, FLAVORS)}")
        if self.positions == "document" and self.attn_mask_type == "causal":
            raise ConfigError("model.positions = 'document' needs model.attn_mask_type = "
                              "'block_causal': under a causal mask a token also sees earlier "
                              "documents, whose restarted positions would put them at wrong "
                              "relative distances")


@dataclass
class Optimizer:
    name: str = opt("AdamW", "Optimizer", choices=("AdamW", "Adam"))
    lr: float = opt(8e-4, "Peak learning rate", min=0.0)
    beta1: float = opt(0.9, "Adam beta1, in [0, 1)", min=0.0, max=1.0)
    beta2: float = opt(0.95, "Adam beta2, in [0, 1)", min=0.0, max=1.0)
    eps: float = opt(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay", min=0.0)
    implementation: str = opt("auto", "Kernel: auto (fused on CUDA, foreach on CPU), "
                              "for-loop, foreach or fused",
                              choices=("auto", "for-loop", "foreach", "fused"))

    def validate(self) -> None:
        for key in ("beta1", "beta2"):
            if getattr(self, key) >= 1.0:
                raise ConfigError(f"optimizer.{key} = {getattr(self, key)} is out of range; it "
                                  "must be < 1 (e.g. 0.9 or 0.95)")


@dataclass
class LRScheduler:
    """The lr of every step: the formula is in trainer/lr_schedule.py (and README)."""

    warmup_steps: int = opt(200, "Linear warmup: step s <= warmup_steps trains at "
                            "optimizer.lr * s / (warmup_steps + 1)", min=0)
    decay_steps: int = opt(-1, "Decay over the last decay_steps steps of training.steps, at the "
                           "peak lr until then (so raising training.steps at a resume in that "
                           "stable phase changes no lr used); 0 = no decay; -1 = per decay_ratio",
                           min=-1)
    decay_ratio: float = opt(-1.0, "Or decay over the last round(decay_ratio * training.steps) "
                             "steps, in [0, 1]; both -1 = decay over every step after "
                             "warmup_steps + 1 (training.steps sets the slope)")
    decay_type: str = opt("linear", "Decay shape down to min_lr_factor * lr: linear, cosine or "
                          "sqrt (1 - sqrt(progress))", choices=tuple(DECAY_SHAPES))
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of optimizer.lr", min=0.0, max=1.0)

    def validate(self) -> None:
        if self.decay_ratio != -1 and not 0 <= self.decay_ratio <= 1:
            raise ConfigError(f"lr_scheduler.decay_ratio = {self.decay_ratio!r} is out of range; "
                              "it must be in [0, 1], or -1 (off)")
        if self.decay_ratio != -1 and self.decay_steps != -1:
            raise ConfigError(f"lr_scheduler.decay_steps = {self.decay_steps} and "
                              f"lr_scheduler.decay_ratio = {self.decay_ratio!r} are both set; "
                              "set one of them and leave the other at -1")

    def check_steps(self, steps: int) -> None:
        """Warmup and decay must fit in training.steps."""
        if self.decay_steps == -1 and self.decay_ratio == -1:
            return
        k = decay_steps(self, steps)
        what = (f"decay_steps = {k}" if self.decay_steps != -1 else
                f"decay_ratio = {self.decay_ratio!r} (round({self.decay_ratio!r} * "
                f"{steps}) = {k} decay steps)")
        if self.warmup_steps + k > steps:
            raise ConfigError(f"lr_scheduler.warmup_steps = {self.warmup_steps} plus "
                              f"lr_scheduler.{what} exceed training.steps = {steps}; "
                              "warmup and decay must fit: lower them or raise training.steps")


@dataclass
class Training:
    local_batch_size: int = opt(8, "Sequences per microbatch per data-parallel rank", min=1)
    global_batch_size: int = opt(-1, "Sequences per optimizer step; -1 = local_batch_size * dp size")
    seq_len: int = opt(2048, "Tokens per sequence", min=1)
    steps: int = opt(10000, "Optimizer steps to train for", min=1)
    max_norm: float = opt(1.0, "Gradient clipping max global norm; 0 = no clipping", min=0.0)
    device: str = opt("auto", "Compute device: auto (CUDA if visible, else CPU), cpu or cuda; "
                      "run_train.sh starts NGPU ranks, default every GPU, else 2 on CPU",
                      choices=DEVICES)
    mixed_precision_param: str = opt(
        "auto", "Dtype of the unsharded compute params: auto = bfloat16 on CUDA and on CPUs with "
        "native bf16 (AMX, AVX512-BF16), float32 elsewhere", choices=("auto", *DTYPES))
    mixed_precision_reduce: str = opt("float32", "Dtype of gradient reduction", choices=DTYPES)
    loss: str = opt("chunked", "Output projection + cross-entropy: chunked (loss_chunk_size "
                    "tokens at a time, no full [tokens, vocab] logits) or eager (full logits)",
                    choices=("chunked", "eager"))
    loss_chunk_size: int = opt(1024, "Tokens per chunk of the chunked loss", min=1)
    z_loss_weight: float = opt(0.0, "z-loss (PaLM, OLMo 2): add this * logsumexp(logits)^2 per "
                               "token to the loss (e.g. 1e-4); logged as loss_metrics/z_loss; "
                               "0 = off", min=0.0)
    gradient_accumulation_sync: str = opt(
        "last", "Microbatch grad sync: last (least comm), every (least memory), hsdp_reduce_scatter",
        choices=("last", "every", "hsdp_reduce_scatter"))
    rampup_batch_start: int = opt(0, "Batch-size ramp: the global batch of step 1 (a multiple "
                                  "of local_batch_size x dp size); 0 = no ramp", min=0)
    rampup_steps: int = opt(0, "Ramp the global batch linearly to global_batch_size over this "
                            "many steps", min=0)
    rampup_tokens: int = opt(0, "... or over this many training tokens", min=0)
    max_skipped_steps: int = opt(
        5, "Consecutive steps to skip (a non-finite loss or grad norm, or a spike with on_spike "
        "= skip) before the run stops (exit 4); 0 = stop at the first", min=0)
    spike_window: int = opt(50, "Steps in the rolling window of the loss spike detector; "
                            "0 = off", min=0)
    spike_threshold: float = opt(6.0, "A loss more than this many standard deviations above "
                                 "the window's mean counts as a spike", min=0.0)
    on_spike: str = opt("log", "What a loss spike does: log (print and count it), skip (also "
                        "skip its optimizer step, as for a non-finite loss), rollback (reload the "
                        "latest checkpoint, then pass over the spiking step's global batch)",
                        choices=SPIKE_ACTIONS)
    max_rollbacks: int = opt(3, "on_spike = rollback: rollbacks allowed (counted in the "
                             "checkpoints, so across resumes); the next spike stops the run "
                             "(exit 4); 0 = stop at the first spike", min=0)
    skip_data_steps: list[int] = opt([], "Steps that pass over the next global batch before "
                                     "training (a step listed twice passes over two), e.g. to "
                                     "drop a bad data window at a restart; needs a global data "
                                     "order (not a streamed dataset)")

    def validate(self) -> None:
        if self.global_batch_size != -1 and self.global_batch_size < 1:
            raise ConfigError(f"training.global_batch_size = {self.global_batch_size} is out of "
                              "range; it must be >= 1, or -1 for local_batch_size * dp size")
        if self.on_spike != "log" and self.spike_window == 0:
            raise ConfigError(f"training.on_spike = {self.on_spike!r} needs the spike detector, "
                              "which training.spike_window = 0 turns off; set a window (e.g. 50) "
                              "or on_spike = 'log'")
        bad = sorted({s for s in self.skip_data_steps if s < 1})
        if bad:
            raise ConfigError(f"training.skip_data_steps has {', '.join(map(str, bad))}; steps "
                              "count from 1")


@dataclass
class Validation:
    enable: bool = opt(False, "Evaluate the held-out split every freq steps and at the last step")
    freq: int = opt(500, "Evaluate every this many steps", min=1)
    steps: int = opt(10, "Validation batches of global_batch_size samples per evaluation", min=1)
    local_batch_size: int = opt(8, "Validation sequences per forward pass per dp rank", min=1)
    global_batch_size: int = opt(
        -1, "Samples per validation batch; -1 = validation.local_batch_size. The evaluated set "
        "(steps x this) never depends on the world size", min=-1)

    def validate(self) -> None:
        if self.global_batch_size == 0:
            raise ConfigError("validation.global_batch_size = 0 is out of range; it must be "
                              ">= 1, or -1 for validation.local_batch_size")


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = opt(-1, "FSDP shard group size; -1 = the rest of the world")
    data_parallel_replicate_degree: int = opt(1, "HSDP replica groups (e.g. nodes)", min=1)
    fsdp_reshard_after_forward: str = opt(
        "default", "Free unsharded params after forward: default, always, never, or N: keep them "
        "sharded over groups of N ranks (N > 1 divides dp_shard; ZeRO++ hpZ)", int_as_str=True)
    fsdp_offload: str = opt("none", "none, or cpu: sharded params, grads and optimizer state in "
                            "pinned host memory, optimizer step on the CPU (CUDA only)",
                            choices=("none", "cpu"))

    def validate(self) -> None:
        value = self.fsdp_reshard_after_forward
        if value not in RESHARD_POLICIES and not _is_int(value):
            raise ConfigError(f"{RESHARD_KEY} = {value!r} is not valid; choose one of "
                              f"{', '.join(repr(c) for c in RESHARD_POLICIES)}, or an integer N > 1 "
                              "that divides data_parallel_shard_degree"
                              f"{did_you_mean(value, RESHARD_POLICIES)}")

    def check_reshard(self, dp_shard: int, world_size: int) -> None:
        """An integer policy must be a divisor N > 1 of the resolved shard degree."""
        value = self.fsdp_reshard_after_forward
        if value in RESHARD_POLICIES:
            return
        n = int(value)
        if n > 1 and dp_shard % n == 0:
            return
        divisors = [d for d in range(2, dp_shard + 1) if dp_shard % d == 0]
        ints = (f"an integer that divides dp_shard = {dp_shard} and is > 1: "
                f"{', '.join(map(str, divisors))}" if divisors
                else f"no integer (dp_shard = {dp_shard} leaves nothing to group)")
        raise ConfigError(f"{RESHARD_KEY} = {value!r} is not valid for world size {world_size} "
                          f"(dp_shard = {dp_shard}); valid: "
                          f"{', '.join(repr(c) for c in RESHARD_POLICIES)}, or {ints}")


RESHARD_KEY = "parallelism.fsdp_reshard_after_forward"
RESHARD_POLICIES = ("default", "always", "never")


def _is_int(value: str) -> bool:
    return value.isascii() and value.lstrip("-").isdigit()


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Recompute activations in backward: none, full (every block), selective",
                    choices=("none", "full", "selective"))
    selective_ac_option: str = opt(
        "2", "selective: 'op' (keep matmul/attention outputs, recompute the rest) or k (every k-th block)")

    def validate(self) -> None:
        opt_ = self.selective_ac_option
        if opt_ != "op" and not (opt_.isascii() and opt_.isdigit() and int(opt_) >= 1):
            raise ConfigError(f"activation_checkpoint.selective_ac_option = {opt_!r} is not valid; "
                              "use 'op' or a positive integer k (checkpoint every k-th block)")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block (after AC, before FSDP)")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save Distributed Checkpoints and resume from them")
    folder: str = opt("checkpoint", "Checkpoint folder, relative to job.dump_folder")
    interval: int = opt(500, "Save every this many steps (and at the last step)", min=1)
    keep_latest_k: int = opt(10, "Keep the newest k checkpoints; 0 = keep all", min=0)
    load_step: int = opt(-1, "Resume from this step instead of the latest; -1 = latest", min=-1)
    async_mode: str = opt("disabled", "disabled, or async: write in a background thread while training",
                          choices=("disabled", "async"))
    initial_load_path: str = opt("", "A fresh run (no checkpoint of its own) starts from this model: "
                                 "a Hugging Face folder or a DCP step-N folder")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a Hugging Face Llama folder "
                                   "(safetensors), not a DCP checkpoint")
    last_save_in_hf: bool = opt(False, "Also write the final model as a Hugging Face folder in "
                                "{dump_folder}/hf")
    verify: str = opt("auto", "Check at load: 'checksums' reads every file of the checkpoint, "
                      "'sizes' compares sizes with its manifest, 'auto' = checksums up to 8 GiB",
                      choices=("auto", "checksums", "sizes"))
    on_save_error: str = opt("stop", "A save the storage refuses (disk full, permissions, I/O "
                             "error): 'stop' the run with one line, or 'continue' training",
                             choices=("stop", "continue"))

    def validate(self) -> None:
        if self.load_step != -1 and not self.enable:
            raise ConfigError(f"checkpoint.load_step = {self.load_step} needs checkpoint.enable = "
                              "true (loading is part of checkpointing)")
        if not self.folder:
            raise ConfigError("checkpoint.folder is empty; name a folder (e.g. 'checkpoint')")
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ConfigError("checkpoint.initial_load_in_hf = true needs "
                              "checkpoint.initial_load_path (a Hugging Face model folder)")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Log metrics every this many steps", min=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard events on rank 0")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder")
    peak_tflops: float = opt(0.0, "Peak bf16 TFLOPS per device for MFU; 0 = from the device table",
                             min=0.0)
    disable_color: bool = opt(False, "Plain console output without ANSI colors")
    enable_wandb: bool = opt(False, "Also log the scalars and the config to Weights & Biases on "
                             "rank 0 (pip install -e \".[wandb]\"; WANDB_MODE=offline keeps it "
                             "local); one run per dump folder, continued on resume")
    wandb_project: str = opt("", "W&B project; '' = $WANDB_PROJECT, else 'trainer'")
    wandb_entity: str = opt("", "W&B team or user; '' = $WANDB_ENTITY, else your default entity")
    wandb_run_name: str = opt("", "W&B run name; '' = $WANDB_NAME, else the dump folder's name "
                              "(job.description becomes the run's notes)")


@dataclass
class Profiling:
    enable_profiling: bool = opt(False, "Record torch.profiler traces")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder")
    profile_freq: int = opt(10, "Trace one step every this many steps", min=1)
    enable_memory_snapshot: bool = opt(False, "On CUDA, dump a memory snapshot (allocator history)")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder, in dump_folder")


@dataclass
class Comm:
    init_timeout_seconds: int = opt(300, "Timeout of process-group setup and the first step", min=1,
                                    max=7 * 24 * 3600)
    train_timeout_seconds: int = opt(100, "Timeout of each collective during training", min=1,
                                     max=7 * 24 * 3600)


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    validation: Validation = field(default_factory=Validation)
    eval: Eval = field(default_factory=Eval)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self, world_size: int | None = None) -> None:
        """Check every section, then the rules that span sections and the world size."""
        for section in sections(self):
            obj = getattr(self, section)
            for f in dataclasses.fields(obj):
                check_field(section, f, getattr(obj, f.name))
            if hasattr(obj, "validate"):
                obj.validate()
        if self.parallelism.fsdp_offload == "cpu" and self.training.device == "cpu":
            raise ConfigError(OFFLOAD_NEEDS_CUDA.format(where="training.device = 'cpu'"))
        check_float8(self.float8, self.training.device)
        check_wandb(self.metrics)
        if self.training.on_spike == "rollback" and not self.checkpoint.enable:
            raise ConfigError("training.on_spike = 'rollback' needs checkpoint.enable = true (a "
                              "rollback reloads the latest checkpoint); without checkpoints use "
                              "on_spike = 'skip' or 'log'")
        if self.eval.enable and self.data.dataset == "synthetic" and not self.data.mix:
            raise ConfigError("eval.enable = true needs a tokenizer to encode the tasks, but "
                              "data.dataset = 'synthetic' has none; train on text (e.g. "
                              "'stdlib') or turn eval off")
        check_attention(self.model, self.data, self.training.device)
        self.lr_scheduler.check_steps(self.training.steps)
        if world_size is not None:
            self.resolve(world_size)

    def resolve(self, world_size: int):
        """Resolve -1 degrees and the global batch for `world_size`; returns (ParallelDims, accum)."""
        from trainer.parallel_dims import ParallelDims

        pd = ParallelDims.from_config(self.parallelism, world_size)
        self.parallelism.check_reshard(pd.dp_shard, world_size)
        accum = accumulation_steps(self.training, pd.dp_size)
        per_pass = self.training.local_batch_size * pd.dp_size
        check_ramp(self.training, per_pass, per_pass * accum)
        return pd, accum

    def to_toml(self) -> str:
        out = []
        for section in sections(self):
            out.append(f"[{section}]")
            obj = getattr(self, section)
            out += [f"{f.name} = {toml_value(getattr(obj, f.name))}" for f in dataclasses.fields(obj)]
            out.append("")
        return "\n".join(out)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(self.to_toml())
        os.replace(tmp, path)


OFFLOAD_NEEDS_CUDA = ("parallelism.fsdp_offload = 'cpu' needs a CUDA run, but {where}: offload "
                      "moves sharded state from GPU to host memory; a CPU run keeps it there "
                      "already (set fsdp_offload = 'none')")


def check_attention(model: Model, data: DataConfig, device: str) -> None:
    """Document masks need documents and, for flex, a GPU (checked again once the device of
    'auto' is known: trainer/attention.py)."""
    if model.attn_mask_type == "block_causal" and data.dataset == "synthetic" and not data.mix:
        raise ConfigError("model.attn_mask_type = 'block_causal' needs documents, but "
                          "data.dataset = 'synthetic' has none (each sample is one repeated "
                          "pattern); use a token store, stdlib or a blend")
    if model.attn_implementation == "flex" and device == "cpu":
        raise ConfigError("model.attn_implementation = 'flex' needs CUDA, but training.device "
                          "= 'cpu': FlexAttention has no backward on the CPU; use 'auto', "
                          "'per_document' or 'sdpa'")


def accumulation_steps(training: Training, dp_size: int) -> int:
    """Microbatches per step = global_batch_size / (local_batch_size * dp size)."""
    per_pass = training.local_batch_size * dp_size
    gbs = per_pass if training.global_batch_size == -1 else training.global_batch_size
    if gbs % per_pass:
        raise ConfigError(
            f"training.global_batch_size = {gbs} is not divisible by training.local_batch_size "
            f"({training.local_batch_size}) * dp size ({dp_size}) = {per_pass}; use a multiple "
            f"of {per_pass}")
    return gbs // per_pass


def sections(cfg: JobConfig) -> list[str]:
    return [f.name for f in dataclasses.fields(cfg)]


# --------------------------------------------------------------------------- loading


def load_config(argv: list[str]) -> JobConfig:
    """Build the config from `--job.config_file` (if given) and `--section.key value` overrides."""
    overrides = parse_cli(argv)
    cfg = JobConfig()
    path = overrides.get("job.config_file")
    if path:
        _apply_toml(cfg, _read_toml(path))
    for key, raw in overrides.items():
        section, name, f = _lookup(cfg, key)
        setattr(getattr(cfg, section), name, from_cli(key, raw, _field_type(cfg, section, name)))
    cfg.validate()
    return cfg


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"job.config_file: no such file {path!r}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax error in {path}: {e}") from None


def _apply_toml(cfg: JobConfig, data: dict) -> None:
    for section, table in data.items():
        if section not in sections(cfg):
            raise ConfigError(f"unknown section [{section}]{did_you_mean(section, sections(cfg))}; "
                              f"valid sections: {', '.join(sections(cfg))}")
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a [{section}] table, got {table!r}")
        for name, value in table.items():
            key = f"{section}.{name}"
            f = _lookup(cfg, key)[2]
            setattr(getattr(cfg, section), name, coerce(key, value, _field_type(cfg, section, name),
                                                        f.metadata.get("int_as_str", False)))


def _lookup(cfg: JobConfig, key: str):
    section, _, name = key.partition(".")
    if section not in sections(cfg):
        raise ConfigError(f"unknown section in {key!r}{did_you_mean(section, sections(cfg))}; "
                          f"valid sections: {', '.join(sections(cfg))}")
    names = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}
    if name not in names:
        all_keys = [f"{s}.{f.name}" for s in sections(cfg) for f in dataclasses.fields(getattr(cfg, s))]
        hint = did_you_mean(key, all_keys) or f"; valid keys in [{section}]: {', '.join(names)}"
        raise ConfigError(f"unknown key {key!r}{hint}")
    return section, name, names[name]


def _field_type(cfg: JobConfig, section: str, name: str):
    return typing.get_type_hints(type(getattr(cfg, section)))[name]


def reference() -> str:
    """The config reference: every key with its type, default and doc."""
    cfg, lines = JobConfig(), []
    for section in sections(cfg):
        lines.append(f"[{section}]")
        obj = getattr(cfg, section)
        hints = typing.get_type_hints(type(obj))
        for f in dataclasses.fields(obj):
            lines.append(f"  {f.name} ({type_name(hints[f.name])}, default "
                         f"{toml_value(getattr(obj, f.name))}): {f.metadata.get('help', '')}")
            args = typing.get_args(hints[f.name])
            if args and dataclasses.is_dataclass(args[0]):  # [[section.key]] tables
                table = args[0]
                for sub, tp in typing.get_type_hints(table).items():
                    g = table.__dataclass_fields__[sub]
                    default = g.default if g.default is not dataclasses.MISSING \
                        else g.default_factory()
                    lines.append(f"    {sub} ({type_name(tp)}, default {toml_value(default)}): "
                                 f"{g.metadata.get('help', '')}")
    return "\n".join(lines)


def _take(args: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` from args and return VALUE (None when absent)."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args):
        raise ConfigError(f"{flag} needs a value")
    value = args[i + 1]
    del args[i:i + 2]
    return value


def check_launch(args: list[str]) -> int | None:
    """Validate a launch before any process starts; returns the ranks per node, if asked.

    `--world-size N`: the config must fit N ranks. `--nnodes N --nproc-per-node K` (K empty =
    the default for `training.device`: every visible GPU, else 2 CPU ranks): also checks that K
    ranks fit this node's GPUs, and returns K.
    """
    world_size = _take(args, "--world-size")
    nnodes = _take(args, "--nnodes")
    nproc = _take(args, "--nproc-per-node")
    cfg = load_config(args)
    ranks = None
    if nproc is not None or nnodes is not None:
        from trainer.device import local_ranks, visible_gpus

        gpus, seen = visible_gpus()
        ranks = local_ranks(cfg.training.device, nproc, gpus, seen)
        if cfg.parallelism.fsdp_offload == "cpu" and gpus == 0:  # device auto: a CPU run
            raise ConfigError(OFFLOAD_NEEDS_CUDA.format(where=f"no GPU is visible ({seen})"))
        world_size = _positive("--nnodes", nnodes or "1") * ranks
    elif world_size is not None:
        world_size = _positive("--world-size", world_size)
    cfg.validate(world_size)
    return ranks


def _positive(flag: str, value: str) -> int:
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise ConfigError(f"{flag} = {value!r} is not a positive integer")
    return int(value)


def main(argv: list[str]) -> int:
    """`--help` prints the reference; `--check ...` validates a launch up front (check_launch)
    and prints the ranks per node when `--nproc-per-node` is given."""
    if "--help" in argv or "-h" in argv:
        print(reference())
        return 0
    args = [a for a in argv if a != "--check"]
    try:
        ranks = check_launch(args)
    except UserError as e:
        print(e.one_line(), file=sys.stderr)
        return e.exit_code
    if ranks is not None:
        print(ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
