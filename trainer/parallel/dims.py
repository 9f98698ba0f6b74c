"""Parallel degrees -> a named world DeviceMesh.

The world mesh is 5-D, `("pp", "dp_replicate", "dp_shard", "cp", "tp")`, tp innermost (the
ranks of a tensor-parallel group are neighbours: on GPUs, one node's NVLink) and pp outermost
(pipeline stages exchange only activations, point to point: the slowest links do). It always
carries a flattened `dp` dimension of size replicate x shard: the dataloader takes its rank and
size from `dp`, and the loss is averaged over it, so the pp, cp and tp ranks of one dp rank read
the same samples. FSDP shards parameters over `dp_shard` x `cp` (flattened `dp_shard_cp`; the
cp ranks hold different tokens of the same samples, so they reduce gradients like dp ranks); HSDP
additionally replicates them over `dp_replicate` (the 2-D mesh); `dp_shard = cp = 1` is pure
replication. Context parallelism (trainer/parallel/context_parallel.py) splits each sequence
over `cp`; tensor parallelism (trainer/parallel/tp.py) shards each block's matmuls over `tp`;
pipeline parallelism (trainer/parallel/pipeline.py) cuts the layers into stages over `pp`;
expert parallelism (trainer/parallel/expert_parallel.py) splits dp_shard into (efsdp, ep) and
places each MoE layer's experts over `ep`; under tp, ep takes in the tp ranks too (ep =
(ep_dp, tp) flattened, dp_shard = (efsdp, ep_dp)): every tp rank routes its own tokens, so the
experts are split over them rather than repeated; each dimension is a no-op at degree 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.errors import ConfigError
from trainer.models import registry

SHARD_KEY = "parallelism.data_parallel_shard_degree"
REPLICATE_KEY = "parallelism.data_parallel_replicate_degree"
TP_KEY = "parallelism.tensor_parallel_degree"
CP_KEY = "parallelism.context_parallel_degree"
PP_KEY = "parallelism.pipeline_parallel_degree"
EP_KEY = "parallelism.expert_parallel_degree"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = (
        1  # expert parallelism: ranks of dp_shard (x tp) (trainer/parallel/expert_parallel.py)
    )
    loss_parallel: bool = True  # with tp > 1: the loss over vocab-sharded logits
    world_mesh: object = field(default=None, repr=False)
    dp_mesh: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        return cls(
            parallelism.data_parallel_replicate_degree,
            parallelism.data_parallel_shard_degree,
            world_size,
            tp=parallelism.tensor_parallel_degree,
            cp=parallelism.context_parallel_degree,
            pp=parallelism.pipeline_parallel_degree,
            ep=parallelism.expert_parallel_degree,
            loss_parallel=not parallelism.disable_loss_parallel,
        )

    def _validate(self) -> None:
        r, s, tp, cp, ws = self.dp_replicate, self.dp_shard, self.tp, self.cp, self.world_size
        if ws < 1:
            raise ConfigError(f"world size must be >= 1, got {ws}")
        if self.pp < 1 or ws % self.pp:
            divisors = [d for d in range(1, ws + 1) if ws % d == 0]
            raise ConfigError(
                f"{PP_KEY} = {self.pp} does not divide world size {ws}; valid: "
                f"{', '.join(map(str, divisors))}"
            )
        ws //= self.pp  # what follows shares one pipeline stage's ranks
        wl = (
            f"world size {self.world_size} / pp {self.pp} = {ws}"
            if self.pp > 1
            else f"world size {ws}"
        )
        if tp < 1 or ws % tp:
            divisors = [d for d in range(1, ws + 1) if ws % d == 0]
            raise ConfigError(
                f"{TP_KEY} = {tp} does not divide {wl}; valid: {', '.join(map(str, divisors))}"
            )
        if cp < 1 or (ws // tp) % cp:
            divisors = [d for d in range(1, ws // tp + 1) if (ws // tp) % d == 0]
            raise ConfigError(
                f"{CP_KEY} = {cp} does not divide {wl}"
                + (f" / {TP_KEY} = {tp}" if tp > 1 else "")
                + f"; valid: {', '.join(map(str, divisors))}"
            )
        inner = " x ".join(f"{k} = {v}" for k, v in ((CP_KEY, cp), (TP_KEY, tp)) if v > 1)
        both = f"{REPLICATE_KEY} = {r} and {SHARD_KEY} = {s}" + (f" (x {inner})" if inner else "")
        dp_world = ws // (tp * cp)
        short = " x ".join(f"{k} {v}" for k, v in (("cp", cp), ("tp", tp)) if v > 1)
        where = wl + (f", {dp_world} dp ranks of {short}" if short else "")
        if r < 1:
            raise ConfigError(
                f"{REPLICATE_KEY} = {r} is out of range; it must be >= 1 "
                f"(with {SHARD_KEY} = {s}, {where})"
            )
        if s == -1:
            if dp_world % r:
                names = [n for n, v in (("cp", cp), ("tp", tp)) if v > 1]
                per = f" / {names[0]}" if len(names) == 1 else " / (cp x tp)" if names else ""
                raise ConfigError(
                    f"{both} do not fit {where}: the replicate degree must "
                    f"divide the world size{per} (valid: a divisor of {dp_world})"
                )
            self.dp_shard = s = dp_world // r
        elif s < 1:
            raise ConfigError(
                f"{SHARD_KEY} = {s} is out of range; it must be >= 1, or -1 for "
                f"world size / replicate degree (with {REPLICATE_KEY} = {r}, "
                f"{where})"
            )
        if r * s * cp * tp != ws:
            per = f" / {PP_KEY} = {self.pp}" if self.pp > 1 else ""
            raise ConfigError(
                f"{both} multiply to {r * s * cp * tp}, but the world size{per} "
                f"is {ws}; their product must equal it (e.g. set {SHARD_KEY} "
                "= -1)"
            )
        self._validate_ep(s, where, r)

    def _validate_ep(self, s: int, where: str, r: int) -> None:
        """ep borrows its ranks from dp_shard; with tp > 1 the tp ranks join it (ep = tp x a
        divisor of dp_shard): every tp rank routes its own tokens, so the all-to-all spans them
        as it spans dp ranks."""
        ep, tp = self.ep, self.tp
        if tp == 1 or ep <= 1:
            if ep < 1 or s % ep:
                divisors = [d for d in range(1, s + 1) if s % d == 0]
                raise ConfigError(
                    f"{EP_KEY} = {ep} does not divide dp_shard = {s} ({where}, "
                    f"{REPLICATE_KEY} = {r}): the expert-parallel ranks are "
                    f"borrowed from dp_shard; valid: "
                    f"{', '.join(map(str, divisors))}"
                )
            return
        if ep % tp or s % (ep // tp):
            valid = [1] + [tp * d for d in range(1, s + 1) if s % d == 0]
            raise ConfigError(
                f"{EP_KEY} = {ep} is not {TP_KEY} = {tp} x a divisor of dp_shard "
                f"= {s} ({where}, {REPLICATE_KEY} = {r}): under tensor "
                f"parallelism the expert-parallel group takes in the tp ranks "
                f"and borrows ep / tp ranks from dp_shard; valid: "
                f"{', '.join(map(str, valid))}"
            )

    @property
    def ep_dp(self) -> int:
        """The dp_shard ranks of the ep group: ep / tp under tp (the tp ranks are the rest of
        it), ep without; 1 without ep."""
        return self.ep // self.tp if self.ep_enabled else 1

    @property
    def ep_tp(self) -> int:
        """The tp ranks inside the ep group: tp under ep, 1 without ep (the experts then
        replicated over tp, their gradients summed over it: trainer/parallel/tp.py)."""
        return self.tp if self.ep_enabled else 1

    def ep_group_ranks(self) -> list[int]:
        """The global ranks of the first ep group, in ep order, as build_mesh lays them out:
        an ep rank's (ep_dp, tp) coordinates step over cp x tp and 1 ranks, so under context
        parallelism the group's ranks are strided (cp sits between ep_dp and tp)."""
        return [e * self.cp * self.tp + t for e in range(self.ep_dp) for t in range(self.ep_tp)]

    @property
    def efsdp(self) -> int:
        """The dp_shard ranks the experts shard over (x cp): dp_shard / ep_dp."""
        return self.dp_shard // self.ep_dp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def model_parallel(self) -> int:
        """Ranks that compute one dp rank's tokens together (pp x cp x tp)."""
        return self.pp * self.cp * self.tp

    def build_mesh(self, device_type: str):
        """Create the world mesh `("pp", "dp_replicate", "dp_shard", "cp", "tp")`, its flattened
        `dp` and, with cp > 1, the flattened `dp_shard_cp` that FSDP shards over."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.ep_enabled:  # dp_shard = efsdp x ep: built split, then flattened
            return self._build_ep_mesh(device_type)
        self.world_mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "cp", "tp"),
        )
        # No public flatten API yet; `_flatten` is stable since torch 2.4. Keep the returned
        # objects: slicing mesh["dp"] from the root afterwards is deprecated.
        self.dp_mesh = self.world_mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        self._shard_mesh = self.world_mesh["dp_shard"]
        if self.cp_enabled:
            self._shard_mesh = self.world_mesh["dp_shard", "cp"]._flatten(
                mesh_dim_name="dp_shard_cp"
            )
        self._flatten_cp_tp()
        return self.world_mesh

    def _flatten_cp_tp(self) -> None:
        """cp x tp as one group (`token_group`), made on every rank with the mesh: a group is
        created collectively, never lazily."""
        if self.cp_enabled and self.tp_enabled:
            self._cp_tp = self.world_mesh["cp", "tp"]._flatten(mesh_dim_name="cp_tp")

    def _build_ep_mesh(self, device_type: str):
        """The 6-D mesh `("pp", "dp_replicate", "efsdp", "ep", "cp", "tp")` with `dp_shard` =
        (efsdp, ep) and `dp` = (dp_replicate, efsdp, ep) flattened: dense parameters shard over
        dp_shard as without ep; the experts split over `ep` and shard over `efsdp`. With tp > 1
        the dp_shard part of ep is the dim `ep_dp`, and `ep` = (ep_dp, tp) flattened: the ep
        ranks in increasing global order, tp innermost."""
        from torch.distributed.device_mesh import init_device_mesh

        part = "ep" if self.tp == 1 else "ep_dp"  # ep's dp_shard dim
        self.world_mesh = init_device_mesh(
            device_type,
            (self.pp, self.dp_replicate, self.efsdp, self.ep_dp, self.cp, self.tp),
            mesh_dim_names=("pp", "dp_replicate", "efsdp", part, "cp", "tp"),
        )
        self.dp_mesh = self.world_mesh["dp_replicate", "efsdp", part]._flatten(mesh_dim_name="dp")
        self._shard_mesh = self.world_mesh["efsdp", part]._flatten(mesh_dim_name="dp_shard")
        self._expert_mesh = self.world_mesh["efsdp"]
        if self.cp_enabled:  # FSDP over the cp ranks too: the dense over dp_shard x cp, the
            # experts (each cp rank routes its own sequence shard) over efsdp x cp
            self._shard_mesh = self.world_mesh["efsdp", part, "cp"]._flatten(
                mesh_dim_name="dp_shard_cp"
            )
            self._expert_mesh = self.world_mesh["efsdp", "cp"]._flatten(mesh_dim_name="efsdp_cp")
        self._ep_mesh = (
            self.world_mesh["ep"]
            if self.tp == 1
            else self.world_mesh["ep_dp", "tp"]._flatten(mesh_dim_name="ep")
        )
        self._flatten_cp_tp()
        return self.world_mesh

    @property
    def ep_mesh(self):
        """The 1-D ep mesh (`apply_ep`): ep_dp x tp flattened under tp, else the `ep` dim."""
        return self._ep_mesh

    @property
    def expert_fsdp_mesh(self):
        """What `fully_shard` takes for the experts under ep: `efsdp` (x cp), or
        (dp_replicate, efsdp (x cp)) with replicas."""
        if not self.hsdp:
            return self._expert_mesh
        import warnings

        with warnings.catch_warnings():  # as in fsdp_mesh
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return self.world_mesh["dp_replicate", "efsdp_cp" if self.cp_enabled else "efsdp"]

    @property
    def expert_grad_divisor(self) -> int:
        """What the experts' reduced gradients are divided by: every rank's tokens reach them
        (the all-to-all's backward), and the backward loss is scaled by dp (x cp). The tp ranks
        in the ep group add nothing: their tokens are disjoint parts of one dp rank's loss, so
        the sum over them is that loss's gradient, as the dense parameters' tp sum is."""
        return self.dp_size * self.cp

    @property
    def token_group(self):
        """The ranks whose shards make up one microbatch's tokens (MoE's aux losses sum their
        statistics over it): cp x tp, cp or tp; None when neither splits the sequence."""
        if self.cp_enabled and self.tp_enabled:
            return self._cp_tp.get_group()
        if self.cp_enabled or self.tp_enabled:
            return self.world_mesh["cp" if self.cp_enabled else "tp"].get_group()
        return None

    @property
    def fsdp_mesh(self):
        """The mesh `fully_shard` takes: 1-D `dp_shard` (x cp) for FSDP, 2-D `(dp_replicate,
        dp_shard (x cp))` for HSDP."""
        if not self.hsdp:
            return self._shard_mesh
        if not (self.cp_enabled or self.ep_enabled):
            return self.world_mesh["dp_replicate", "dp_shard"]
        # A 2-D mesh over a flattened dim has no other spelling that keeps one root mesh (FSDP2
        # with TP needs the TP mesh's root); torch warns that slicing it is to be deprecated.
        import warnings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
            return self.world_mesh["dp_replicate", "dp_shard_cp" if self.cp_enabled else "dp_shard"]

    @property
    def pp_mesh(self):
        return self.world_mesh["pp"]

    @property
    def cp_mesh(self):
        return self.world_mesh["cp"]

    @property
    def tp_mesh(self):
        return self.world_mesh["tp"]

    @property
    def loss_parallel_group(self):
        """The tp process group the loss is computed over vocab shards in; None without."""
        return self.tp_mesh.get_group() if self.tp_enabled and self.loss_parallel else None

    def describe(self) -> str:
        kind = "HSDP" if self.hsdp else "FSDP"
        if self.dp_shard * self.cp == 1 and self.hsdp:
            kind = "replicate"
        elif self.dp_size * self.cp == 1 and (self.tp_enabled or self.pp_enabled):
            kind = "no data parallelism"
        cp = (
            f" x CP {self.cp} (head-tail split, K/V all-gathered, params sharded over "
            f"dp_shard x cp)"
            if self.cp_enabled
            else ""
        )
        tp = (
            f" x TP {self.tp} (sequence parallel, loss "
            f"{'parallel' if self.loss_parallel else 'gathered'})"
            if self.tp_enabled
            else ""
        )
        pp = f"PP {self.pp} (pipeline stages, p2p) x " if self.pp_enabled else ""
        over = f"{self.ep_dp} dp_shard x {self.tp} tp ranks" if self.ep_tp > 1 else "dp_shard ranks"
        ep = (
            f" x EP {self.ep} (experts split over ep = {over}, 1/{self.ep} each, sharded "
            f"over efsdp={self.efsdp}{' x cp' if self.cp_enabled else ''}; all-to-all)"
            if self.ep_enabled
            else ""
        )
        return (
            f"{pp}{kind} mesh (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard})"
            f"{ep}{cp}{tp}, dp={self.dp_size}, world={self.world_size}"
        )


def check_tp_shapes(args, tp: int, flavor: str, vocab_source: str | None) -> None:
    """Every dimension tensor parallelism splits must divide by `tp` (`args`: a ModelArgs):
    the query and key/value heads (each rank keeps whole heads), the FFN width and the vocab
    (the embedding's rows and the head's columns). `vocab_source` says where the vocab came
    from, for the message; None = the vocab is not known yet (checked again at startup)."""
    if tp == 1:
        return
    dims = {
        f"model.flavor {flavor!r} n_heads": args.n_heads,
        f"model.flavor {flavor!r} n_kv_heads": args.n_kv_heads,
        f"model.flavor {flavor!r} FFN width": args.hidden_dim,
    }
    for what, size in registry.hooks(args).tp_dims(args).items():  # the family's own
        dims[f"model.flavor {flavor!r} {what}"] = size
    if vocab_source is not None:
        dims[f"the vocab ({vocab_source})"] = args.vocab_size
    for what, value in dims.items():
        if value % tp:
            valid = [d for d in range(1, 65) if all(v % d == 0 for v in dims.values())]
            raise ConfigError(
                f"{TP_KEY} = {tp} does not divide {what} = {value}; valid tp "
                f"degrees for this model: {', '.join(map(str, valid))}"
            )


def check_async_tp(parallelism, compile_enabled: bool, device_type: str) -> None:
    """Async TP needs TP, CUDA and torch.compile (it is an Inductor pass over symmetric memory)."""
    if not parallelism.enable_async_tensor_parallel:
        return
    key = "parallelism.enable_async_tensor_parallel = true"
    if parallelism.tensor_parallel_degree == 1:
        raise ConfigError(f"{key} needs {TP_KEY} > 1 (it overlaps TP communication)")
    if device_type != "cuda":
        raise ConfigError(
            f"{key} needs CUDA, but this run computes on {device_type}: async "
            "TP uses symmetric GPU memory; turn it off"
        )
    if not compile_enabled:
        raise ConfigError(
            f"{key} needs compile.enable = true: async TP is a torch.compile (Inductor) pass"
        )


def describe_vocab(model_cfg, tokenizer_vocab: int) -> str:
    """Where the model's vocab comes from, for check_tp_shapes' message."""
    if model_cfg.vocab_size:
        return "model.vocab_size"
    return (
        f"the tokenizer's {tokenizer_vocab} padded to model.vocab_size_multiple_of = "
        f"{model_cfg.vocab_size_multiple_of}; a multiple of the tp degree would do"
    )


def check_context_parallel(cfg, pd: ParallelDims) -> None:
    """Torch-free checks of a cp degree against the config (`cfg`: a JobConfig): the sequence
    must cut into 2 x cp head-tail chunks (each split again over tp under sequence parallelism),
    and the attention must be one that CP runs."""
    if not pd.cp_enabled:
        return
    seq, unit = cfg.training.seq_len, 2 * pd.cp * pd.tp
    if seq % unit:
        pieces = f" x {TP_KEY} = {pd.tp} (sequence parallel)" if pd.tp_enabled else ""
        raise ConfigError(
            f"training.seq_len = {seq} does not cut into 2 x {CP_KEY} = "
            f"{2 * pd.cp} head-tail chunks{pieces}: it must be a multiple of "
            f"{unit} (e.g. {seq - seq % unit or unit})"
        )
    model = cfg.model
    if model.attn_mask_type == "block_causal" and model.attn_implementation == "per_document":
        raise ConfigError(
            f"model.attn_implementation = 'per_document' cannot run under {CP_KEY} "
            f"= {pd.cp}: each rank holds pieces of documents whose other tokens "
            "sit on other ranks; use 'auto' (CP's document mask: SDPA on the "
            "CPU, FlexAttention on CUDA), 'sdpa' or 'flex'"
        )
