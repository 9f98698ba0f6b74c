"""The sections of the job configuration, one typed dataclass per TOML table ([job], [model],
[training], ...): each field with its default, its one-line doc and its simple constraints
(`opt`), and each section's own rules in `validate()`. Rules that span sections, the world size
and the loading from TOML and the command line are in trainer/config/job.py; [data], [eval],
[float8], [model], [moe] and [checkpoint] live with their code (trainer/data/config.py,
trainer/evals/config.py, trainer/parallel/float8.py, trainer/models/config.py,
trainer/checkpoint/config.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer.config.base import check_folder, did_you_mean, opt
from trainer.errors import STOP_SIGNALS, ConfigError
from trainer.models.config import (
    POSITIONS,  # noqa: F401
)
from trainer.optim.lr_schedule import DECAY_SHAPES, decay_steps

DTYPES = ("bfloat16", "float32")
DEVICES = ("auto", "cpu", "cuda")

SPIKE_ACTIONS = ("log", "skip", "rollback")


@dataclass
class Job:
    """The run as a whole: where it writes, its seed, the signals that stop it (docs/running.md)."""

    config_file: str = opt("", "TOML file this config was loaded from (set with --job.config_file)")
    dump_folder: str = opt(
        "./outputs", "Folder for the effective config, checkpoints and TensorBoard"
    )
    description: str = opt("", "Free-text description of the run")
    seed: int = opt(0, "Seed for weight init, data order and every RNG", min=0, max=2**32 - 1)
    stop_signals: list[str] = opt(
        ["SIGTERM", "SIGUSR1", "SIGINT"],
        "Signals that make every rank save at the next step and exit 3",
    )
    lease_timeout_seconds: int = opt(
        120,
        "Seconds without a heartbeat after which another run may "
        "take over this dump folder's lease (docs/security.md)",
        min=5,
    )

    def validate(self) -> None:
        check_folder("job.dump_folder", self.dump_folder)
        for name in self.stop_signals:
            if name not in STOP_SIGNALS:
                raise ConfigError(
                    f"job.stop_signals has {name!r}; valid signals: {', '.join(STOP_SIGNALS)}"
                )


@dataclass
class Optimizer:
    """AdamW, or Muon for the blocks' matrices with AdamW for the rest, and their
    hyperparameters (docs/training.md)."""

    name: str = opt(
        "AdamW",
        "Optimizer: AdamW, Adam, or Muon (the blocks' matrices; AdamW "
        "with the keys below for embeddings, head and norms)",
        choices=("AdamW", "Adam", "Muon"),
    )
    lr: float = opt(8e-4, "Peak learning rate", min=0.0)
    beta1: float = opt(0.9, "Adam beta1, in [0, 1)", min=0.0)  # < 1: validate
    beta2: float = opt(0.95, "Adam beta2, in [0, 1)", min=0.0)  # < 1: validate
    eps: float = opt(1e-8, "Adam epsilon", min=0.0)
    weight_decay: float = opt(0.1, "Decoupled weight decay", min=0.0)
    implementation: str = opt(
        "auto",
        "Kernel: auto (fused: skips a non-finite step on the "
        "device, no host sync), for-loop, foreach or fused",
        choices=("auto", "for-loop", "foreach", "fused"),
    )
    muon_momentum: float = opt(
        0.95, "Muon: momentum of the gradient EMA, in [0, 1)", min=0.0, max=1.0
    )
    muon_nesterov: bool = opt(True, "Muon: Nesterov momentum")
    muon_ns_steps: int = opt(5, "Muon: Newton-Schulz iterations", min=1, max=99)
    muon_lr_adjust: str = opt(
        "match_rms_adamw",
        "Muon: lr scale by matrix shape: "
        "match_rms_adamw (0.2 sqrt(max(A, B)): AdamW's lr carries over), "
        "original (sqrt(max(1, A/B))) or none",
        choices=("match_rms_adamw", "original", "none"),
    )
    muon_ns_dtype: str = opt(
        "bfloat16",
        "Muon: Newton-Schulz dtype, bfloat16 (as torch's) or float32",
        choices=("bfloat16", "float32"),
    )
    muon_lr: float = opt(
        -1.0,
        "Muon: peak lr of the matrices, scaled by the lr schedule like "
        "lr; -1 = optimizer.lr (right under match_rms_adamw; under original "
        "or none Muon wants ~0.02, AdamW ~3e-4)",
    )
    muon_qk_clip: float = opt(
        0.0,
        "Muon: QK-clip (MuonClip, Kimi K2) threshold tau: after each "
        "step, the q/k weights of every head whose largest attention "
        "logit passed tau are scaled back to it; 0 = off",
        min=0.0,
    )

    def validate(self) -> None:
        for key in ("beta1", "beta2", "muon_momentum"):
            if getattr(self, key) >= 1.0:
                raise ConfigError(
                    f"optimizer.{key} = {getattr(self, key)} is out of range; it "
                    "must be < 1 (e.g. 0.9 or 0.95)"
                )
        if self.muon_lr != -1 and not self.muon_lr > 0:
            raise ConfigError(
                f"optimizer.muon_lr = {self.muon_lr} is not valid; it must be > 0 "
                "(Muon's peak lr), or -1 (use optimizer.lr)"
            )
        if self.name != "Muon":
            changed = [
                f.name
                for f in dataclasses.fields(self)
                if f.name.startswith("muon_") and getattr(self, f.name) != f.default
            ]
            if changed:
                raise ConfigError(
                    f"optimizer.{changed[0]} is a Muon key, but optimizer.name = "
                    f"{self.name!r}; set optimizer.name = 'Muon' or remove it"
                )


@dataclass
class LRScheduler:
    """The lr of every step: warmup, stable, decay; the formula is in
    trainer/optim/lr_schedule.py and docs/training.md."""

    warmup_steps: int = opt(
        200,
        "Linear warmup: step s <= warmup_steps trains at optimizer.lr * s / (warmup_steps + 1)",
        min=0,
    )
    decay_steps: int = opt(
        -1,
        "Decay over the last decay_steps steps of training.steps, at the "
        "peak lr until then (so raising training.steps at a resume in that "
        "stable phase changes no lr used); 0 = no decay; -1 = per decay_ratio",
        min=-1,
    )
    decay_ratio: float = opt(
        -1.0,
        "Or decay over the last round(decay_ratio * training.steps) "
        "steps, in [0, 1]; both -1 = decay over every step after "
        "warmup_steps + 1 (training.steps sets the slope)",
    )
    decay_type: str = opt(
        "linear",
        "Decay shape down to min_lr_factor * lr: linear, cosine or sqrt (1 - sqrt(progress))",
        choices=tuple(DECAY_SHAPES),
    )
    min_lr_factor: float = opt(0.0, "Final lr as a fraction of optimizer.lr", min=0.0, max=1.0)

    def validate(self) -> None:
        if self.decay_ratio != -1 and not 0 <= self.decay_ratio <= 1:
            raise ConfigError(
                f"lr_scheduler.decay_ratio = {self.decay_ratio!r} is out of range; "
                "it must be in [0, 1], or -1 (off)"
            )
        if self.decay_ratio != -1 and self.decay_steps != -1:
            raise ConfigError(
                f"lr_scheduler.decay_steps = {self.decay_steps} and "
                f"lr_scheduler.decay_ratio = {self.decay_ratio!r} are both set; "
                "set one of them and leave the other at -1"
            )

    def check_steps(self, steps: int) -> None:
        """Warmup and decay must fit in training.steps."""
        if self.decay_steps == -1 and self.decay_ratio == -1:
            return
        k = decay_steps(self, steps)
        what = (
            f"decay_steps = {k}"
            if self.decay_steps != -1
            else f"decay_ratio = {self.decay_ratio!r} (round({self.decay_ratio!r} * "
            f"{steps}) = {k} decay steps)"
        )
        if self.warmup_steps + k > steps:
            raise ConfigError(
                f"lr_scheduler.warmup_steps = {self.warmup_steps} plus "
                f"lr_scheduler.{what} exceed training.steps = {steps}; "
                "warmup and decay must fit: lower them or raise training.steps"
            )


@dataclass
class Training:
    """The step: batch sizes, sequence length, steps, loss, precision, device, clipping, spikes
    (docs/training.md, docs/running.md)."""

    local_batch_size: int = opt(8, "Sequences per microbatch per data-parallel rank", min=1)
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step; -1 = local_batch_size * dp size"
    )
    seq_len: int = opt(2048, "Tokens per sequence", min=1)
    steps: int = opt(10000, "Optimizer steps to train for", min=1)
    max_norm: float = opt(1.0, "Gradient clipping max global norm; 0 = no clipping", min=0.0)
    device: str = opt(
        "auto",
        "Compute device: auto (CUDA if visible, else CPU), cpu or cuda; "
        "run_train.sh starts NGPU ranks, default every GPU, else 2 on CPU",
        choices=DEVICES,
    )
    mixed_precision_param: str = opt(
        "auto",
        "Dtype of the unsharded compute params: auto = bfloat16 on CUDA and on CPUs with "
        "native bf16 (AMX, AVX512-BF16), float32 elsewhere",
        choices=("auto", *DTYPES),
    )
    mixed_precision_reduce: str = opt("float32", "Dtype of gradient reduction", choices=DTYPES)
    loss: str = opt(
        "chunked",
        "Output projection + cross-entropy: chunked (loss_chunk_size "
        "tokens at a time, no full [tokens, vocab] logits) or eager (full logits)",
        choices=("chunked", "eager"),
    )
    loss_chunk_size: int = opt(1024, "Tokens per chunk of the chunked loss", min=1)
    z_loss_weight: float = opt(
        0.0,
        "z-loss (PaLM, OLMo 2): add this * logsumexp(logits)^2 per "
        "token to the loss (e.g. 1e-4); logged as loss_metrics/z_loss; "
        "0 = off",
        min=0.0,
    )
    gradient_accumulation_sync: str = opt(
        "last",
        "Microbatch grad sync: last (least comm), every (least memory), hsdp_reduce_scatter",
        choices=("last", "every", "hsdp_reduce_scatter"),
    )
    rampup_batch_start: int = opt(
        0,
        "Batch-size ramp: the global batch of step 1 (a multiple "
        "of local_batch_size x dp size); 0 = no ramp",
        min=0,
    )
    rampup_steps: int = opt(
        0, "Ramp the global batch linearly to global_batch_size over this many steps", min=0
    )
    rampup_tokens: int = opt(0, "... or over this many training tokens", min=0)
    max_skipped_steps: int = opt(
        5,
        "Consecutive steps to skip (a non-finite loss or grad norm, or a spike with on_spike "
        "= skip) before the run stops (exit 4); 0 = stop at the first",
        min=0,
    )
    spike_window: int = opt(
        50, "Steps in the rolling window of the loss spike detector; 0 = off", min=0
    )
    spike_threshold: float = opt(
        6.0,
        "A loss more than this many standard deviations above the window's mean counts as a spike",
        min=0.0,
    )
    on_spike: str = opt(
        "log",
        "What a loss spike does: log (print and count it), skip (also "
        "skip its optimizer step, as for a non-finite loss), rollback (reload the "
        "latest checkpoint, then pass over the spiking step's global batch)",
        choices=SPIKE_ACTIONS,
    )
    max_rollbacks: int = opt(
        3,
        "on_spike = rollback: rollbacks allowed (counted in the "
        "checkpoints, so across resumes); the next spike stops the run "
        "(exit 4); 0 = stop at the first spike",
        min=0,
    )
    skip_data_steps: list[int] = opt(
        [],
        "Steps that pass over the next global batch before "
        "training (a step listed twice passes over two), e.g. to "
        "drop a bad data window at a restart; needs a global data "
        "order (not a streamed dataset)",
    )

    def validate(self) -> None:
        if self.global_batch_size != -1 and self.global_batch_size < 1:
            raise ConfigError(
                f"training.global_batch_size = {self.global_batch_size} is out of "
                "range; it must be >= 1, or -1 for local_batch_size * dp size"
            )
        if self.on_spike != "log" and self.spike_window == 0:
            raise ConfigError(
                f"training.on_spike = {self.on_spike!r} needs the spike detector, "
                "which training.spike_window = 0 turns off; set a window (e.g. 50) "
                "or on_spike = 'log'"
            )
        bad = sorted({s for s in self.skip_data_steps if s < 1})
        if bad:
            raise ConfigError(
                f"training.skip_data_steps has {', '.join(map(str, bad))}; steps count from 1"
            )


@dataclass
class Validation:
    """Held-out loss every freq steps (docs/evals.md)."""

    enable: bool = opt(False, "Evaluate the held-out split every freq steps and at the last step")
    freq: int = opt(500, "Evaluate every this many steps", min=1)
    steps: int = opt(10, "Validation batches of global_batch_size samples per evaluation", min=1)
    local_batch_size: int = opt(8, "Validation sequences per forward pass per dp rank", min=1)
    global_batch_size: int = opt(
        -1,
        "Samples per validation batch; -1 = validation.local_batch_size. The evaluated set "
        "(steps x this) never depends on the world size",
        min=-1,
    )

    def validate(self) -> None:
        if self.global_batch_size == 0:
            raise ConfigError(
                "validation.global_batch_size = 0 is out of range; it must be "
                ">= 1, or -1 for validation.local_batch_size"
            )


@dataclass
class Parallelism:
    """The layout of the world: FSDP/HSDP degrees, tensor, context, pipeline and expert
    parallelism (docs/parallelism.md, docs/moe.md)."""

    data_parallel_shard_degree: int = opt(-1, "FSDP shard group size; -1 = the rest of the world")
    data_parallel_replicate_degree: int = opt(1, "HSDP replica groups (e.g. nodes)", min=1)
    fsdp_reshard_after_forward: str = opt(
        "default",
        "Free unsharded params after forward: default (blocks yes, head no; under "
        "pp: never), always, never, or N: keep them sharded over groups of N ranks (N > 1 "
        "divides dp_shard; ZeRO++ hpZ)",
        int_as_str=True,
    )
    fsdp_offload: str = opt(
        "none",
        "none, or cpu: sharded params, grads and optimizer state in "
        "pinned host memory, optimizer step on the CPU (CUDA only)",
        choices=("none", "cpu"),
    )
    tensor_parallel_degree: int = opt(
        1,
        "Tensor-parallel group size (innermost mesh dim, e.g. the GPUs of a node); must "
        "divide the world size, n_heads, n_kv_heads, the FFN width and the vocab",
        min=1,
    )
    context_parallel_degree: int = opt(
        1,
        "Context-parallel group size: each sequence split over this many ranks (head-tail "
        "chunks, K/V all-gathered; long context); must divide the world size / tp, and "
        "training.seq_len must divide into 2 x cp (x tp) chunks",
        min=1,
    )
    expert_parallel_degree: int = opt(
        1,
        "Expert-parallel group size (ep, MoE flavors): each MoE layer's experts split over "
        "this many ranks borrowed from dp_shard, and under tp the tp ranks too (tokens travel "
        "by all-to-all); must divide the number of experts and be a divisor of dp_shard (x tp "
        "under tp)",
        min=1,
    )
    pipeline_parallel_degree: int = opt(
        1,
        "Pipeline stages (outermost mesh dim, pp): the layers cut into stages that pass "
        "activations point to point; must divide the world size",
        min=1,
    )
    pipeline_parallel_schedule: str = opt(
        "1F1B",
        "GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble "
        "or DualPipeV (the last five run several stages per rank)",
    )
    pipeline_parallel_microbatch_size: int = opt(
        1,
        "Samples per pipeline microbatch: each rank's local batch is cut into "
        "local_batch_size / this many microbatches per schedule step",
        min=1,
    )
    pipeline_parallel_layers_per_stage: int = opt(
        0,
        "Units per stage (the embedding and the head count as one unit each); 0 = a split "
        "into pp stages (2 pp for multi-stage schedules) balanced by the units' model FLOPs "
        "(the embedding ~0, the head its matmul)",
        min=0,
    )
    pipeline_parallel_split_points: list[str] = opt(
        [],
        'Explicit cuts instead: a stage starts at each named layer, e.g. ["layers.4", '
        '"layers.8"] (on the command line: layers.4,layers.8)',
    )
    pipeline_parallel_overlap: bool = opt(
        True,
        "DualPipeV: run each overlapped forward/backward pair on two threads, the "
        "backward's collectives on twin groups, so one microbatch's MoE all-to-alls hide "
        "behind another's compute; false: one after the other (also where tp or cp > 1)",
    )
    disable_loss_parallel: bool = opt(
        False,
        "With TP: gather the output head's weight and compute the loss over the full "
        "vocab on every tp rank, instead of over vocab-sharded logits",
    )
    enable_async_tensor_parallel: bool = opt(
        False,
        "With TP: overlap TP communication with the matmuls (CUDA with compile.enable "
        "only; torch's micro-pipelined async TP)",
    )

    def validate(self) -> None:
        value = self.fsdp_reshard_after_forward
        if value not in RESHARD_POLICIES and not _is_int(value):
            raise ConfigError(
                f"{RESHARD_KEY} = {value!r} is not valid; choose one of "
                f"{', '.join(repr(c) for c in RESHARD_POLICIES)}, or an integer N > 1 "
                "that divides data_parallel_shard_degree"
                f"{did_you_mean(value, RESHARD_POLICIES)}"
            )

    def check_reshard(self, dp_shard: int, world_size: int) -> None:
        """An integer policy must be a divisor N > 1 of the resolved shard degree."""
        value = self.fsdp_reshard_after_forward
        if value in RESHARD_POLICIES:
            return
        n = int(value)
        if n > 1 and dp_shard % n == 0:
            return
        divisors = [d for d in range(2, dp_shard + 1) if dp_shard % d == 0]
        ints = (
            f"an integer that divides dp_shard = {dp_shard} and is > 1: "
            f"{', '.join(map(str, divisors))}"
            if divisors
            else f"no integer (dp_shard = {dp_shard} leaves nothing to group)"
        )
        raise ConfigError(
            f"{RESHARD_KEY} = {value!r} is not valid for world size {world_size} "
            f"(dp_shard = {dp_shard}); valid: "
            f"{', '.join(repr(c) for c in RESHARD_POLICIES)}, or {ints}"
        )


RESHARD_KEY = "parallelism.fsdp_reshard_after_forward"
RESHARD_POLICIES = ("default", "always", "never")


def _is_int(value: str) -> bool:
    return value.isascii() and value.lstrip("-").isdigit()


@dataclass
class ActivationCheckpoint:
    """Which activations are recomputed in backward instead of kept (docs/performance.md)."""

    mode: str = opt(
        "none",
        "Recompute activations in backward: none, full (every block), selective",
        choices=("none", "full", "selective"),
    )
    selective_ac_option: str = opt(
        "2",
        "selective: 'op' (keep matmul/attention outputs, recompute the rest) or k (every k-th "
        "block)",
    )
    selective_op_matmuls: str = opt(
        "all",
        "selective 'op': keep every matmul's output (all) or every other one per block "
        "(every_other: wq, wv, w1, w2, as torchtitan; less memory, wk/wo/w3 recomputed)",
        choices=("all", "every_other"),
    )

    def validate(self) -> None:
        opt_ = self.selective_ac_option
        if opt_ != "op" and not (opt_.isascii() and opt_.isdigit() and int(opt_) >= 1):
            raise ConfigError(
                f"activation_checkpoint.selective_ac_option = {opt_!r} is not valid; "
                "use 'op' or a positive integer k (checkpoint every k-th block)"
            )


@dataclass
class Compile:
    """torch.compile of the transformer blocks (docs/performance.md)."""

    enable: bool = opt(False, "torch.compile each transformer block (after AC, before FSDP)")
    mode: str = opt(
        "default",
        "torch.compile mode of the blocks: default, or "
        "max-autotune-no-cudagraphs (benchmarks GEMM kernels, Triton templates with "
        "fused epilogues among them, at the first step: minutes longer to start)",
        choices=("default", "max-autotune-no-cudagraphs"),
    )


@dataclass
class Metrics:
    """What is logged where: the console, TensorBoard, Weights & Biases (docs/metrics.md)."""

    log_freq: int = opt(10, "Log metrics every this many steps", min=1)
    enable_tensorboard: bool = opt(True, "Write TensorBoard events on rank 0")
    save_tb_folder: str = opt("tb", "TensorBoard folder, relative to job.dump_folder")
    peak_tflops: float = opt(
        0.0, "Peak bf16 TFLOPS per device for MFU; 0 = from the device table", min=0.0
    )
    disable_color: bool = opt(False, "Plain console output without ANSI colors")
    enable_wandb: bool = opt(
        False,
        "Also log the scalars and the config to Weights & Biases on "
        'rank 0 (pip install -e ".[wandb]"; WANDB_MODE=offline keeps it '
        "local); one run per dump folder, continued on resume",
    )
    wandb_project: str = opt("", "W&B project; '' = $WANDB_PROJECT, else 'trainer'")
    wandb_entity: str = opt("", "W&B team or user; '' = $WANDB_ENTITY, else your default entity")
    wandb_run_name: str = opt(
        "",
        "W&B run name; '' = $WANDB_NAME, else the dump folder's name "
        "(job.description becomes the run's notes)",
    )


@dataclass
class Profiling:
    """torch.profiler traces and memory snapshots (docs/metrics.md)."""

    enable_profiling: bool = opt(False, "Record torch.profiler traces")
    save_traces_folder: str = opt("profile_traces", "Trace folder, relative to job.dump_folder")
    profile_freq: int = opt(10, "Trace one step every this many steps", min=1)
    enable_memory_snapshot: bool = opt(False, "On CUDA, dump a memory snapshot (allocator history)")
    save_memory_snapshot_folder: str = opt("memory_snapshot", "Snapshot folder, in dump_folder")


@dataclass
class Comm:
    """Process-group timeouts: setup and the first step, then every step (docs/faults.md)."""

    init_timeout_seconds: int = opt(
        300, "Timeout of process-group setup and the first step", min=1, max=7 * 24 * 3600
    )
    train_timeout_seconds: int = opt(
        100, "Timeout of each collective during training", min=1, max=7 * 24 * 3600
    )


@dataclass
class Health:
    """Heartbeats, hangs, restarts and stragglers (docs/faults.md)."""

    heartbeat_seconds: float = opt(
        1.0,
        "Each rank publishes its step and phase this often; a "
        "timed-out collective names the ranks whose heartbeat stopped "
        "(0 = off)",
        min=0.0,
        max=3600.0,
    )
    max_same_failures: int = opt(
        3,
        "With MAX_RESTARTS: stop instead of restarting after this "
        "many attempts in a row failed the same way at the same step; "
        "0 = never",
        min=0,
    )
    straggler_factor: float = opt(
        1.5,
        "A rank whose step time exceeds the other ranks' median by this factor is slow",
        min=1.0,
    )
    straggler_steps: int = opt(
        5, "Name a rank slow for this many steps in a row in one line; 0 = never", min=0
    )
