"""Parallelism degrees and the one device mesh built from them.

A run's layout is five degrees whose product is the world size, in torchtitan's
order (outermost first): ``pp`` (pipeline stages), ``dp_replicate`` (replica
groups: gradients all-reduced across them), ``dp_shard`` (FSDP: parameters,
gradients and optimizer state sharded), ``cp`` (context parallel: each sequence
split across ranks) and ``tp`` (tensor parallel: each layer's projections
split). Ranks next to each other differ in the innermost degree, so ``tp``
groups are consecutive ranks: on a GPU machine they share its NVLink domain.

Every named strategy is a preset of degrees (``Strategy.dims``: ``ddp`` is
dp_replicate = world, ``fsdp2`` dp_shard = world, ``tp`` tp = world, ...), and
the ``nd`` strategy composes them freely. The planner side here imports no torch;
``device_mesh`` is called in the worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class Dims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: ranks that read different rows (cp and tp ranks share a replica's rows)."""
        return self.dp_replicate * self.dp_shard

    @property
    def shards(self) -> int:
        """Ranks one copy of the weights is divided over (dp_shard x tp x pp; cp ranks hold the same shard)."""
        return self.dp_shard * self.tp * self.pp

    def degrees(self) -> dict[str, int]:
        return asdict(self)

    def describe(self) -> str:
        """``dp_shard=2 × tp=4``: the degrees above 1, outermost first (``1 process`` when there are none)."""
        used = [f"{name}={value}" for name, value in self.degrees().items() if value > 1]
        return " × ".join(used) if used else "1 process"

    @classmethod
    def of(cls, degrees: dict[str, int]) -> Dims:
        return cls(**{name: int(degrees.get(name, 1)) for name in ORDER})


def resolve(asked: dict[str, int | str], world: int) -> tuple[Dims | None, list[str]]:
    """Degrees from ``parallelism.dims``: ``auto`` is 1 for pp, cp, tp and dp_replicate, and dp_shard takes the
    ranks left (torchtitan's ``-1``); when dp_shard is set and dp_replicate is ``auto``, dp_replicate takes them.
    Returns the degrees, or None and every problem at once."""
    fixed = {name: value for name, value in asked.items() if value != "auto"}
    product = 1
    for value in fixed.values():
        product *= value
    problems = []
    free = "dp_shard" if "dp_shard" not in fixed else "dp_replicate" if "dp_replicate" not in fixed else None
    if free and world % product:
        problems.append(
            f"parallelism.dims: the set degrees multiply to {product}, which does not divide the world size "
            f"{world}; {free} cannot take the rest. Use degrees whose product divides {world}."
        )
    elif free:
        fixed[free] = world // product
    elif product != world:
        shown = " × ".join(f"{name}={fixed[name]}" for name in ORDER)
        problems.append(
            f"parallelism.dims = {shown}: the product {product} must equal the world size {world} "
            "(processes per machine × nodes). Change a degree, or set dp_shard=auto to take the rest."
        )
    return (Dims.of(fixed) if not problems else None), problems


def model_problems(dims: Dims, model: dict, seq_len: int) -> list[str]:
    """What the model's shape allows: tp divides attention and KV heads, pp at most the layers, cp divides the
    sequence (ring attention splits each row into 2 × cp chunks for load balance)."""
    problems = []
    heads = model.get("num_attention_heads")
    kv = model.get("num_key_value_heads") or heads
    for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv)):
        if dims.tp > 1 and value and value % dims.tp:
            problems.append(
                f"parallelism.dims.tp = {dims.tp}: the model's {field} = {value} does not divide by it; each rank "
                f"must hold whole heads. Use a tp that divides {value}."
            )
    layers = model.get("num_hidden_layers")
    if layers and dims.pp > layers:
        problems.append(
            f"parallelism.dims.pp = {dims.pp}: the model has {layers} decoder layers, fewer than the stages. "
            f"Use pp <= {layers}."
        )
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        problems.append(
            f"parallelism.dims.cp = {dims.cp}: data.seq_len = {seq_len} must divide by 2 × cp = {2 * dims.cp} "
            "(ring attention gives each rank two chunks of every row). Change data.seq_len or cp."
        )
    return problems


def device_mesh(device_type: str, dims: Dims):
    """The run's one ``DeviceMesh``, every dimension named (size-1 ones too, so the code slices by name)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(getattr(dims, name) for name in ORDER)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=ORDER)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")  # the data-parallel index (rows), used by name later
    return mesh
