"""Parallelism degrees and the one device mesh built from them.

A run's layout is six degrees whose product is the world size, in torchtitan's
order (outermost first): ``pp`` (pipeline stages), ``dp_replicate`` (replica
groups: gradients all-reduced across them), ``dp_shard`` (FSDP: parameters,
gradients and optimizer state sharded), ``cp`` (context parallel, ring attention:
each sequence split across ranks), ``sp`` (sequence parallel, Ulysses: each
sequence split across ranks, attention heads exchanged by all-to-all) and ``tp``
(tensor parallel: each layer's projections split). Ranks next to each other
differ in the innermost degree, so ``tp`` and ``sp`` groups are consecutive
ranks: on a GPU machine they share its NVLink domain.

``sp`` and ``cp`` are two degrees, as in accelerate's ``ParallelismConfig``
(``cp_size`` is ring attention, ``sp_size`` DeepSpeed's Ulysses), because they
split the same sequence in different ways with different limits: Ulysses needs
the heads to divide by ``sp`` and runs on any backend with all-to-all (gloo
included); ring attention needs CUDA's attention kernels.

Every named strategy is a preset of degrees (``Strategy.dims``: ``ddp`` is
dp_replicate = world, ``fsdp2`` dp_shard = world, ``tp`` tp = world, ...), and
the ``nd`` strategy composes them freely. The planner side here imports no torch;
``device_mesh`` is called in the worker.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "sp", "tp")


@dataclass(frozen=True)
class Dims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    sp: int = 1
    tp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.sp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel replicas: ranks that read different rows (cp, sp and tp ranks share a replica's rows)."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_shard(self) -> int:
        """Ranks FSDP shards over: dp_shard x sp. The sp ranks of a replica compute gradients of different slices
        of the same rows, so they reduce gradients as data-parallel ranks do, and hold a shard each as they do."""
        return self.dp_shard * self.sp

    @property
    def shards(self) -> int:
        """Ranks one copy of the weights is divided over (dp_shard x sp x tp x pp; cp ranks hold the same shard)."""
        return self.fsdp_shard * self.tp * self.pp

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
    """Degrees from ``parallelism.dims``: ``auto`` is 1 for pp, cp, sp, tp and dp_replicate, and dp_shard takes the
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
        shown = " × ".join(f"{name}={fixed.get(name, 1)}" for name in ORDER)
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
    if dims.sp > 1:
        from ladle.strategies.attention import unsupported

        problems += sequence_parallel_problems(dims.sp, model.get("num_attention_heads"), seq_len, unsupported(model))
    if dims.cp > 1 and seq_len % (2 * dims.cp):
        problems.append(
            f"parallelism.dims.cp = {dims.cp}: data.seq_len = {seq_len} must divide by 2 × cp = {2 * dims.cp} "
            "(ring attention gives each rank two chunks of every row). Change data.seq_len or cp."
        )
    return problems


def sequence_parallel_problems(sp: int, heads: int | None, seq_len: int, attention: str | None) -> list[str]:
    """What Ulysses needs of the model and the rows: every rank gets whole attention heads after the all-to-all
    (KV heads are repeated where they do not divide), each row splits into equal slices, and the attention is
    plain causal attention the layer can run on the gathered sequence (``attention``: why not, or None)."""
    problems = []
    if heads and (heads % sp or sp > heads):
        problems.append(
            f"parallelism.dims.sp = {sp}: the model's num_attention_heads = {heads} does not divide by it; after "
            f"the all-to-all each rank attends over heads / sp whole heads. Use an sp that divides {heads}."
        )
    if seq_len % sp:
        problems.append(
            f"parallelism.dims.sp = {sp}: data.seq_len = {seq_len} does not divide by it; each rank holds "
            f"seq_len / sp tokens of every row. Use a data.seq_len that divides by {sp} "
            f"(e.g. {seq_len - seq_len % sp + sp})."
        )
    if attention:
        problems.append(
            f"parallelism.dims.sp = {sp}: {attention}, and sequence parallelism runs plain causal attention over the "
            "gathered sequence. Set parallelism.dims.sp=1 (training.gradient_checkpointing=true and a smaller "
            "micro-batch for long rows)."
        )
    return problems


def device_mesh(device_type: str, dims: Dims):
    """The run's one ``DeviceMesh``, every dimension named (size-1 ones too, so the code slices by name)."""
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(getattr(dims, name) for name in ORDER)
    mesh = init_device_mesh(device_type, shape, mesh_dim_names=ORDER)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")  # the data-parallel index (rows), used by name later
    mesh["dp_shard", "sp"]._flatten("dp_shard_sp")  # what FSDP shards over (``Dims.fsdp_shard``)
    return mesh
