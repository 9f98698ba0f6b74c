"""The job configuration: one typed dataclass per TOML section (trainer/config/sections.py and
the sections that live with their code), loaded from TOML + CLI overrides.

Precedence is CLI > TOML > defaults. Every problem the config alone can reveal (unknown keys,
wrong types, out-of-range values, impossible combinations, including those that depend on the
world size) raises `ConfigError` here, before any process group exists that could hang.

    python -m trainer.config --check --world-size 4 --job.config_file configs/debug_model.toml
    python -m trainer.config --check --nnodes 1 --nproc-per-node "$NGPU" ...   # prints ranks/node
    python -m trainer.config --help      # the reference of every key (reference.py)
"""

from __future__ import annotations

import dataclasses
import os
import sys
import typing
from dataclasses import dataclass, field

from trainer.checkpoint.config import Checkpoint
from trainer.config.base import check_field, coerce, did_you_mean, from_cli, parse_cli, toml_value
from trainer.config.sections import (  # noqa: F401  (also importable from here)
    ActivationCheckpoint,
    Comm,
    Compile,
    Health,
    Job,
    LRScheduler,
    Metrics,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
)
from trainer.data.config import DataConfig
from trainer.errors import ConfigError
from trainer.evals.config import Eval
from trainer.models import registry
from trainer.models.config import Model, MoE
from trainer.models.flavors import model_args
from trainer.observe.wandb_logger import check_config as check_wandb
from trainer.optim.batch_schedule import check_ramp
from trainer.parallel.dims import (
    EP_KEY,
    ParallelDims,
    check_async_tp,
    check_context_parallel,
    check_tp_shapes,
)
from trainer.parallel.float8 import Float8
from trainer.parallel.float8 import check_config as check_float8
from trainer.parallel.pp_layout import check_pipeline

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


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
    moe: MoE = field(default_factory=MoE)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    comm: Comm = field(default_factory=Comm)
    health: Health = field(default_factory=Health)
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
        check_float8(self.float8, self.training.device, self.training.mixed_precision_param)
        if self.optimizer.name == "Muon" and self.parallelism.fsdp_offload == "cpu":
            raise ConfigError(
                "optimizer.name = 'Muon' with parallelism.fsdp_offload = 'cpu' is "
                "not supported: Muon gathers whole matrices on the GPU for "
                "Newton-Schulz; use AdamW with offload, or offload = 'none'"
            )
        check_wandb(self.metrics)
        if self.training.on_spike == "rollback" and not self.checkpoint.enable:
            raise ConfigError(
                "training.on_spike = 'rollback' needs checkpoint.enable = true (a "
                "rollback reloads the latest checkpoint); without checkpoints use "
                "on_spike = 'skip' or 'log'"
            )
        if self.eval.enable and self.data.dataset == "synthetic" and not self.data.mix:
            raise ConfigError(
                "eval.enable = true needs a tokenizer to encode the tasks, but "
                "data.dataset = 'synthetic' has none; train on text (e.g. "
                "'stdlib') or turn eval off"
            )
        check_attention(self.model, self.data, self.training.device)
        check_moe(self)
        check_mtp(self)
        if self.training.device != "auto":  # else checked on each rank once the device is known
            check_async_tp(self.parallelism, self.compile.enable, self.training.device)
        elif self.parallelism.enable_async_tensor_parallel:
            check_async_tp(self.parallelism, self.compile.enable, "cuda")
        self.lr_scheduler.check_steps(self.training.steps)
        if world_size is not None:
            self.resolve(world_size)

    def resolve(self, world_size: int):
        """Resolve -1 degrees and the global batch for `world_size`; returns
        (ParallelDims, accum)."""
        pd = ParallelDims.from_config(self.parallelism, world_size)
        self.parallelism.check_reshard(pd.dp_shard, world_size)
        check_tp_shapes(
            model_args(self.model.flavor, vocab_size=self.model.vocab_size or None),
            pd.tp,
            self.model.flavor,
            "model.vocab_size" if self.model.vocab_size else None,
        )
        if self.training.seq_len % pd.tp:
            raise ConfigError(
                f"training.seq_len = {self.training.seq_len} is not a multiple of "
                f"parallelism.tensor_parallel_degree = {pd.tp}: sequence "
                "parallelism splits each sequence evenly over the tp ranks"
            )
        check_context_parallel(self, pd)
        if pd.pp_enabled:
            args = model_args(self.model.flavor, n_layers=self.model.n_layers)
            check_pipeline(
                self.parallelism,
                self.training,
                args.n_layers,
                args.tie_word_embeddings,
                self.model.flavor,
            )
        accum = accumulation_steps(self.training, pd.dp_size)
        per_pass = self.training.local_batch_size * pd.dp_size
        check_ramp(self.training, per_pass, per_pass * accum)
        return pd, accum

    def flat(self) -> dict[str, str]:
        """{'section.key': its TOML value} of every key."""
        return {
            f"{section}.{f.name}": toml_value(getattr(getattr(self, section), f.name))
            for section in sections(self)
            for f in dataclasses.fields(getattr(self, section))
        }

    def to_toml(self) -> str:
        out = []
        for section in sections(self):
            out.append(f"[{section}]")
            obj = getattr(self, section)
            out += [
                f"{f.name} = {toml_value(getattr(obj, f.name))}" for f in dataclasses.fields(obj)
            ]
            out.append("")
        return "\n".join(out)

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w") as fh:
            fh.write(self.to_toml())
        os.replace(tmp, path)


OFFLOAD_NEEDS_CUDA = (
    "parallelism.fsdp_offload = 'cpu' needs a CUDA run, but {where}: offload "
    "moves sharded state from GPU to host memory; a CPU run keeps it there "
    "already (set fsdp_offload = 'none')"
)


def check_attention(model: Model, data: DataConfig, device: str) -> None:
    """Document masks need documents and, for flex, a GPU (checked again once the device of
    'auto' is known: trainer/models/common/attention.py)."""
    if model.attn_mask_type == "block_causal" and data.dataset == "synthetic" and not data.mix:
        raise ConfigError(
            "model.attn_mask_type = 'block_causal' needs documents, but "
            "data.dataset = 'synthetic' has none (each sample is one repeated "
            "pattern); use a token store, stdlib or a blend"
        )
    if model.attn_implementation == "flex" and device == "cpu":
        raise ConfigError(
            "model.attn_implementation = 'flex' needs CUDA, but training.device "
            "= 'cpu': FlexAttention has no backward on the CPU; use 'auto', "
            "'per_document' or 'sdpa'"
        )


def accumulation_steps(training: Training, dp_size: int) -> int:
    """Microbatches per step = global_batch_size / (local_batch_size * dp size)."""
    per_pass = training.local_batch_size * dp_size
    gbs = per_pass if training.global_batch_size == -1 else training.global_batch_size
    if gbs % per_pass:
        raise ConfigError(
            f"training.global_batch_size = {gbs} is not divisible by training.local_batch_size "
            f"({training.local_batch_size}) * dp size ({dp_size}) = {per_pass}; use a multiple "
            f"of {per_pass}"
        )
    return gbs // per_pass


def check_moe(cfg: JobConfig) -> None:
    """[moe] keys need a MoE flavor; what MoE does not compose with yet is refused by name."""
    from trainer.models.flavors import FLAVORS

    par = cfg.parallelism
    set_keys = [
        f"moe.{f.name}"
        for f in dataclasses.fields(cfg.moe)
        if getattr(cfg.moe, f.name) != f.default
    ]
    if par.expert_parallel_degree > 1:
        set_keys.append(f"{EP_KEY} = {par.expert_parallel_degree}")
    if cfg.float8.moe:
        set_keys.append("float8.moe = true")
    flavor = FLAVORS[cfg.model.flavor].moe
    if flavor is None:
        if set_keys:
            moe_flavors = [n for n, a in FLAVORS.items() if a.moe is not None]
            raise ConfigError(
                f"{set_keys[0]} is set, but model.flavor {cfg.model.flavor!r} has "
                f"no experts; MoE flavors: {', '.join(moe_flavors)}"
            )
        return
    experts = cfg.moe.num_experts or flavor.n_experts
    top_k = cfg.moe.top_k or flavor.top_k
    if top_k > experts:
        raise ConfigError(
            f"moe.top_k = {top_k} is above the {experts} experts of "
            f"model.flavor {cfg.model.flavor!r}; valid: 1 to {experts}"
        )
    ep = par.expert_parallel_degree
    if experts % ep:
        valid = [d for d in range(1, experts + 1) if experts % d == 0]
        raise ConfigError(
            f"{EP_KEY} = {ep} does not divide the {experts} experts of "
            f"model.flavor {cfg.model.flavor!r}; valid: "
            f"{', '.join(map(str, valid))}"
        )
    hf = [k for k in ("last_save_in_hf", "initial_load_in_hf") if getattr(cfg.checkpoint, k)]
    args = FLAVORS[cfg.model.flavor]
    problem = registry.hooks(args).hf_router_problem(args) if hf else None
    if problem:
        raise ConfigError(
            f"checkpoint.{hf[0]} = true, but no Hugging Face architecture holds model.flavor "
            f"{cfg.model.flavor!r}: {problem}"
        )
    model_args(cfg.model.flavor, moe_config=cfg.moe).validate()  # experts, groups
    if cfg.float8.moe and not cfg.float8.moe_emulate:  # the float8 GEMMs' 16-element alignment
        args = model_args(cfg.model.flavor, moe_config=cfg.moe)
        for what, n in (("dim", args.dim), ("expert width", args.moe.hidden_dim)):
            if n % 16:
                raise ConfigError(
                    f"float8.moe = true needs the experts' {what} to be a multiple "
                    f"of 16; model.flavor {cfg.model.flavor!r} has {n}"
                )
    losses = [
        k
        for k in ("aux_loss_weight", "seq_aux_loss_weight", "router_z_loss_weight")
        if getattr(cfg.moe, k)
    ]
    if par.pipeline_parallel_degree > 1 and losses:
        raise ConfigError(
            f"moe.{losses[0]} = {getattr(cfg.moe, losses[0])}, but moe.aux_loss_"
            "weight, moe.seq_aux_loss_weight and moe.router_z_loss_weight are "
            "losses of every stage, which a pipeline schedule cannot "
            "back-propagate from the last; under pp set them to 0 and use "
            "moe.load_balance_coeff (aux-loss-free)"
        )


def check_mtp(cfg: JobConfig) -> None:
    """MTP modules go only where a Hugging Face export or import can say what becomes of them."""
    hf = [k for k in ("last_save_in_hf", "initial_load_in_hf") if getattr(cfg.checkpoint, k)]
    if cfg.model.mtp_layers and hf:
        problem = model_args(cfg.model.flavor, mtp_layers=cfg.model.mtp_layers).mtp_export_problem()
        if problem:
            raise ConfigError(f"checkpoint.{hf[0]} = true with {problem}")


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
    except IsADirectoryError:
        raise ConfigError(
            f"job.config_file: {path!r} is a directory; name a .toml file "
            "(e.g. configs/debug_model.toml)"
        ) from None
    except OSError as e:
        raise ConfigError(f"job.config_file: cannot read {path!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"job.config_file {path!r} is not UTF-8 text (byte {e.start}): "
            "a TOML file must be UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"TOML syntax error in {path}: {e}") from None


def _apply_toml(cfg: JobConfig, data: dict) -> None:
    for section, table in data.items():
        if section not in sections(cfg):
            raise ConfigError(
                f"unknown section [{section}]{did_you_mean(section, sections(cfg))}; "
                f"valid sections: {', '.join(sections(cfg))}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{section} must be a [{section}] table, got {table!r}")
        for name, value in table.items():
            key = f"{section}.{name}"
            f = _lookup(cfg, key)[2]
            setattr(
                getattr(cfg, section),
                name,
                coerce(
                    key, value, _field_type(cfg, section, name), f.metadata.get("int_as_str", False)
                ),
            )


def _lookup(cfg: JobConfig, key: str):
    section, _, name = key.partition(".")
    if section not in sections(cfg):
        raise ConfigError(
            f"unknown section in {key!r}{did_you_mean(section, sections(cfg))}; "
            f"valid sections: {', '.join(sections(cfg))}"
        )
    names = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}
    if name not in names:
        all_keys = [
            f"{s}.{f.name}" for s in sections(cfg) for f in dataclasses.fields(getattr(cfg, s))
        ]
        hint = did_you_mean(key, all_keys) or f"; valid keys in [{section}]: {', '.join(names)}"
        raise ConfigError(f"unknown key {key!r}{hint}")
    return section, name, names[name]


def _field_type(cfg: JobConfig, section: str, name: str):
    return typing.get_type_hints(type(getattr(cfg, section)))[name]


def _take(args: list[str], flag: str) -> str | None:
    """Remove `flag VALUE` from args and return VALUE (None when absent)."""
    if flag not in args:
        return None
    i = args.index(flag)
    if i + 1 >= len(args):
        raise ConfigError(f"{flag} needs a value")
    value = args[i + 1]
    del args[i : i + 2]
    return value


def check_launch(args: list[str], checks=()) -> int | None:
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
    for check in checks:  # e.g. the dump folder's lease (trainer/plan/preflight.py)
        check(cfg, world_size or 1, ranks)
    return ranks


def _positive(flag: str, value: str) -> int:
    if not (value.isascii() and value.isdigit() and int(value) >= 1):
        raise ConfigError(f"{flag} = {value!r} is not a positive integer")
    return int(value)
