"""What an ``nd`` rank does with torch: tensor parallelism on the decoder layers, the placement checks, the
global gradient norm over mixed meshes. Kept apart from ``ladle.strategies.nd`` so that planning never
imports torch."""

from __future__ import annotations

from contextlib import contextmanager

from ladle.strategies.mesh import Dims

COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def module_of(model):
    """The module this rank trains: a pipeline stage, or the whole (FSDP/tp-wrapped) model."""
    return getattr(model, "stage_module", model)


def stage_units(lm) -> list:
    """The input embedding and the head, each a FSDP unit of its own, where this stage holds them (not tied)."""
    if getattr(lm.config, "tie_word_embeddings", False):
        return []
    return [m for m in (lm.model.embed_tokens, lm.lm_head) if m is not None]


def apply_tensor_parallel(layers, tp_mesh) -> None:
    """Split each decoder layer's projections over ``tp_mesh`` (Llama-family module names).

    Raises:
        RuntimeError: a layer lacks one of the projections the plan splits (another architecture).
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for layer in layers:
        names = {name for name, _ in layer.named_modules()}
        missing = [n for n in (*COLWISE, *ROWWISE) if n not in names]
        if missing:
            raise RuntimeError(
                f"nd tp: {type(layer).__name__} has no {missing[0]}; tensor parallelism splits Llama-family "
                "attention (q/k/v/o_proj) and MLP (gate/up/down_proj) projections"
            )
        plan = {n: ColwiseParallel() for n in COLWISE} | {n: RowwiseParallel() for n in ROWWISE}
        parallelize_module(layer, tp_mesh, plan)


def placed(p) -> dict:
    """``{mesh dimension: placement}`` of a parameter (``{}``: a plain tensor, whole on this rank)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        return {}
    return dict(zip(p.device_mesh.mesh_dim_names, p.placements, strict=True))


def misplaced(name: str, found: dict, dims: Dims) -> str | None:
    """Why ``name``'s placements differ from the plan (None: as planned). FSDP over tp shards the tp slice
    again on dim 0, which torch records as ``_StridedShard(dim=0)`` on dp_shard."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    def dim0(placement) -> bool:
        return isinstance(placement, Shard | _StridedShard) and placement.dim == 0

    projection = next((n for n in (*COLWISE, *ROWWISE) if f"{n}.weight" in name), None)
    if dims.tp > 1 and projection:
        want = 0 if projection in COLWISE else 1
        tp = found.get("tp")
        if not (isinstance(tp, Shard) and tp.dim == want):
            return f"{name}: tp placement {tp!r}, planned Shard(dim={want})"
    shard = "dp_shard_sp" if dims.sp > 1 else "dp_shard"  # FSDP shards over dp_shard × sp (``Dims.fsdp_shard``)
    if dims.fsdp_shard > 1 and not dim0(found.get(shard)):
        return f"{name}: {shard} placement {found.get(shard)!r}, planned a dim-0 shard"
    if dims.dp_replicate > 1 and not isinstance(found.get("dp_replicate"), Replicate):
        return f"{name}: dp_replicate placement {found.get('dp_replicate')!r}, planned Replicate()"
    return None


def kind_of(name: str) -> str:
    """A representative parameter's role, for the placements recorded in ``train_result.json``."""
    for role in (*COLWISE, *ROWWISE, "embed_tokens", "lm_head", "input_layernorm"):
        if role in name:
            return role
    return "other"


def grad_norm(params, pp_group=None) -> float:
    """The global gradient 2-norm: grads grouped by mesh and placements (a stacked norm cannot mix meshes),
    each group's norm resolved over its mesh, plain tensors counted once, the stages' squares summed."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    plain = []
    for p in params:
        g = p.grad
        if isinstance(g, DTensor):
            groups.setdefault((g.device_mesh, g.placements), []).append(g)
        else:
            plain.append(g)
    squared = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squared += norm.double().cpu() ** 2
    if plain:
        squared += torch.nn.utils.get_total_norm(plain, 2.0).double().cpu() ** 2
    if pp_group is not None:
        device = params[0].device if params else "cpu"
        squared = squared.to(device)
        dist.all_reduce(squared, group=pp_group)
    return float(squared) ** 0.5


@contextmanager
def switched_off(setter):
    """``setter(False)`` while the context lasts, ``setter(True)`` after (FSDP2's per-step switches)."""
    setter(False)
    try:
        yield
    finally:
        setter(True)


def no_gradient_sync(module):
    """No reduce-scatter in this backward: the gradients accumulate unsharded."""
    return switched_off(module.set_requires_gradient_sync)


def no_all_reduce(module):
    """HSDP: each micro-batch's gradients are reduce-scattered within the shard group (they stay sharded), and
    the all-reduce across replica groups waits for the step's last micro-batch (``set_requires_all_reduce``)."""
    return switched_off(module.set_requires_all_reduce)


def gather_whole(module, trainable_only: bool, keep: bool) -> dict:
    """Each (trainable) parameter of ``module`` gathered whole, one at a time: a DTensor's ``full_tensor`` is a
    collective over its own mesh, so every rank calls this; ranks with ``keep`` return CPU copies (others {}).
    ``get_model_state_dict`` with ``ignore_frozen_params`` would still all-gather the frozen base first
    (measured: +1.4 GB on rank 0 for a 1.5 GB base)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, param in module.named_parameters():
        if param.requires_grad or not trainable_only:
            full = param.full_tensor() if isinstance(param, DTensor) else param
            if keep:
                out[name.removeprefix("wrapped.")] = full.detach().to("cpu", copy=True)
    return out
