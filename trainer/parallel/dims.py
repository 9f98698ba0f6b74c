"""Parallel degrees -> a named world DeviceMesh.

The world mesh is 3-D, `("dp_replicate", "dp_shard", "tp")`, tp innermost (the ranks of a
tensor-parallel group are neighbours: on GPUs, one node's NVLink). It always carries a
flattened `dp` dimension of size replicate x shard: the dataloader takes its rank and size from
`dp`, and the loss is averaged over it, so the tp ranks of one dp rank read the same samples.
FSDP shards parameters over `dp_shard`; HSDP additionally replicates them over `dp_replicate`
(the 2-D dp mesh); `dp_shard = 1` is pure replication. Tensor parallelism (trainer/parallel/tp.py)
shards each block's matmuls over `tp`; with tp = 1 that dimension is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.errors import ConfigError

SHARD_KEY = "parallelism.data_parallel_shard_degree"
REPLICATE_KEY = "parallelism.data_parallel_replicate_degree"
TP_KEY = "parallelism.tensor_parallel_degree"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    loss_parallel: bool = True  # with tp > 1: the loss over vocab-sharded logits
    world_mesh: object = field(default=None, repr=False)
    dp_mesh: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        return cls(parallelism.data_parallel_replicate_degree,
                   parallelism.data_parallel_shard_degree, world_size,
                   tp=parallelism.tensor_parallel_degree,
                   loss_parallel=not parallelism.disable_loss_parallel)

    def _validate(self) -> None:
        r, s, tp, ws = self.dp_replicate, self.dp_shard, self.tp, self.world_size
        if ws < 1:
            raise ConfigError(f"world size must be >= 1, got {ws}")
        if tp < 1 or ws % tp:
            divisors = [d for d in range(1, ws + 1) if ws % d == 0]
            raise ConfigError(f"{TP_KEY} = {tp} does not divide world size {ws}; valid: "
                              f"{', '.join(map(str, divisors))}")
        both = f"{REPLICATE_KEY} = {r} and {SHARD_KEY} = {s}" + (f" (x {TP_KEY} = {tp})"
                                                                  if tp > 1 else "")
        dp_world = ws // tp
        where = f"world size {ws}" + (f", {dp_world} dp ranks of tp {tp}" if tp > 1 else "")
        if r < 1:
            raise ConfigError(f"{REPLICATE_KEY} = {r} is out of range; it must be >= 1 "
                              f"(with {SHARD_KEY} = {s}, {where})")
        if s == -1:
            if dp_world % r:
                raise ConfigError(f"{both} do not fit {where}: the replicate degree must "
                                  f"divide the world size / tp (valid: a divisor of {dp_world})")
            self.dp_shard = s = dp_world // r
        elif s < 1:
            raise ConfigError(f"{SHARD_KEY} = {s} is out of range; it must be >= 1, or -1 for "
                              f"world size / replicate degree (with {REPLICATE_KEY} = {r}, "
                              f"{where})")
        if r * s * tp != ws:
            raise ConfigError(f"{both} multiply to {r * s * tp}, but the world size is {ws}; "
                              f"their product must equal the world size (e.g. set {SHARD_KEY} "
                              "= -1)")

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str):
        """Create the world mesh `("dp_replicate", "dp_shard", "tp")` and its flattened `dp`."""
        from torch.distributed.device_mesh import init_device_mesh

        self.world_mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                           mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        # No public flatten API yet; `_flatten` is stable since torch 2.4. Keep the returned
        # object: slicing mesh["dp"] from the root afterwards is deprecated.
        self.dp_mesh = self.world_mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        return self.world_mesh

    @property
    def fsdp_mesh(self):
        """The mesh `fully_shard` takes: 1-D `dp_shard` for FSDP, 2-D `(dp_replicate,
        dp_shard)` for HSDP."""
        return self.world_mesh["dp_replicate", "dp_shard"] if self.hsdp \
            else self.world_mesh["dp_shard"]

    @property
    def tp_mesh(self):
        return self.world_mesh["tp"]

    @property
    def loss_parallel_group(self):
        """The tp process group the loss is computed over vocab shards in; None without."""
        return self.tp_mesh.get_group() if self.tp_enabled and self.loss_parallel else None

    def describe(self) -> str:
        kind = "HSDP" if self.hsdp else "FSDP"
        if self.dp_shard == 1 and self.hsdp:
            kind = "replicate"
        elif self.dp_size == 1 and self.tp_enabled:
            kind = "no data parallelism"
        tp = (f" x TP {self.tp} (sequence parallel, loss "
              f"{'parallel' if self.loss_parallel else 'gathered'})" if self.tp_enabled else "")
        return (f"{kind} mesh (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard})"
                f"{tp}, dp={self.dp_size}, world={self.world_size}")


def check_tp_shapes(args, tp: int, flavor: str, vocab_source: str | None) -> None:
    """Every dimension tensor parallelism splits must divide by `tp` (`args`: a ModelArgs):
    the query and key/value heads (each rank keeps whole heads), the FFN width and the vocab
    (the embedding's rows and the head's columns). `vocab_source` says where the vocab came
    from, for the message; None = the vocab is not known yet (checked again at startup)."""
    if tp == 1:
        return
    dims = {f"model.flavor {flavor!r} n_heads": args.n_heads,
            f"model.flavor {flavor!r} n_kv_heads": args.n_kv_heads,
            f"model.flavor {flavor!r} FFN width": args.hidden_dim}
    if vocab_source is not None:
        dims[f"the vocab ({vocab_source})"] = args.vocab_size
    for what, value in dims.items():
        if value % tp:
            valid = [d for d in range(1, 65) if all(v % d == 0 for v in dims.values())]
            raise ConfigError(f"{TP_KEY} = {tp} does not divide {what} = {value}; valid tp "
                              f"degrees for this model: {', '.join(map(str, valid))}")


def check_async_tp(parallelism, compile_enabled: bool, device_type: str) -> None:
    """Async TP needs TP, CUDA and torch.compile (it is an Inductor pass over symmetric memory)."""
    if not parallelism.enable_async_tensor_parallel:
        return
    key = "parallelism.enable_async_tensor_parallel = true"
    if parallelism.tensor_parallel_degree == 1:
        raise ConfigError(f"{key} needs {TP_KEY} > 1 (it overlaps TP communication)")
    if device_type != "cuda":
        raise ConfigError(f"{key} needs CUDA, but this run computes on {device_type}: async "
                          "TP uses symmetric GPU memory; turn it off")
    if not compile_enabled:
        raise ConfigError(f"{key} needs compile.enable = true: async TP is a torch.compile "
                          "(Inductor) pass")


def describe_vocab(model_cfg, tokenizer_vocab: int) -> str:
    """Where the model's vocab comes from, for check_tp_shapes' message."""
    if model_cfg.vocab_size:
        return "model.vocab_size"
    return (f"the tokenizer's {tokenizer_vocab} padded to model.vocab_size_multiple_of = "
            f"{model_cfg.vocab_size_multiple_of}; a multiple of the tp degree would do")
