"""Data-parallel degrees -> a named world DeviceMesh.

The world mesh is 2-D, `("dp_replicate", "dp_shard")`, and always carries a flattened `dp`
dimension of size replicate x shard: the dataloader takes its rank and size from `dp`, and the
loss is averaged over it. FSDP shards parameters over `dp_shard`; HSDP additionally replicates
them over `dp_replicate` (the 2-D mesh); `dp_shard = 1` is pure replication.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.errors import ConfigError

SHARD_KEY = "parallelism.data_parallel_shard_degree"
REPLICATE_KEY = "parallelism.data_parallel_replicate_degree"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    world_size: int
    world_mesh: object = field(default=None, repr=False)
    dp_mesh: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, parallelism, world_size: int) -> "ParallelDims":
        return cls(parallelism.data_parallel_replicate_degree,
                   parallelism.data_parallel_shard_degree, world_size)

    def _validate(self) -> None:
        r, s, ws = self.dp_replicate, self.dp_shard, self.world_size
        both = f"{REPLICATE_KEY} = {r} and {SHARD_KEY} = {s}"
        if ws < 1:
            raise ConfigError(f"world size must be >= 1, got {ws}")
        if r < 1:
            raise ConfigError(f"{REPLICATE_KEY} = {r} is out of range; it must be >= 1 "
                              f"(with {SHARD_KEY} = {s}, world size {ws})")
        if s == -1:
            if ws % r:
                raise ConfigError(f"{both} do not fit world size {ws}: the replicate degree must "
                                  f"divide the world size (valid: a divisor of {ws})")
            self.dp_shard = s = ws // r
        elif s < 1:
            raise ConfigError(f"{SHARD_KEY} = {s} is out of range; it must be >= 1, or -1 for "
                              f"world size / replicate degree (with {REPLICATE_KEY} = {r}, "
                              f"world size {ws})")
        if r * s != ws:
            raise ConfigError(f"{both} multiply to {r * s}, but the world size is {ws}; their "
                              f"product must equal the world size (e.g. set {SHARD_KEY} = -1)")

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp(self) -> bool:
        return self.dp_replicate > 1

    def build_mesh(self, device_type: str):
        """Create the world mesh `("dp_replicate", "dp_shard")` and its flattened `dp` mesh."""
        from torch.distributed.device_mesh import init_device_mesh

        self.world_mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard),
                                           mesh_dim_names=("dp_replicate", "dp_shard"))
        # No public flatten API yet; `_flatten` is stable since torch 2.4. Keep the returned
        # object: slicing mesh["dp"] from the root afterwards is deprecated.
        self.dp_mesh = self.world_mesh["dp_replicate", "dp_shard"]._flatten(mesh_dim_name="dp")
        return self.world_mesh

    @property
    def fsdp_mesh(self):
        """The mesh `fully_shard` takes: 1-D `dp_shard` for FSDP, the 2-D world mesh for HSDP."""
        return self.world_mesh if self.hsdp else self.world_mesh["dp_shard"]

    def describe(self) -> str:
        kind = "HSDP" if self.hsdp else "FSDP"
        if self.dp_shard == 1 and self.hsdp:
            kind = "replicate"
        return (f"{kind} mesh (dp_replicate={self.dp_replicate}, dp_shard={self.dp_shard}), "
                f"dp={self.dp_size}, world={self.world_size}")
