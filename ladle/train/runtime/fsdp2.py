"""The worker side of ``ladle.strategies.fsdp2``: wrap, step, gather and save (the strategy there decides; this applies)."""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

from ladle.strategies.fsdp2 import replicas
from ladle.train.kernels import decoder_layers
from ladle.train.runtime.base import Runtime


def embedding_units(model) -> list:
    """The input embedding and the output head as units of their own (as torchtitan shards them): left in the
    root, both stay gathered from the first forward to the last backward, the largest transient of a big-vocab
    model. A tied pair shares one weight, so it stays in the root."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if embed is None or head is None or getattr(model.config, "tie_word_embeddings", False):
        return []
    return [embed, head]


def keep_vocab_sharded(model, mesh, wanted: bool, offloaded: bool, dtype) -> None:
    """Look up the embeddings and compute the loss against each rank's own rows (``runtime.vocab_parallel``)
    where that applies, so neither end of the model is ever gathered; record why not otherwise
    (``check_applied`` reports it)."""
    from ladle.train.runtime.vocab_parallel import ShardedVocab, end_notes, shardable

    if not wanted:
        why = ("parallelism.fsdp2.shard_head = false",) * 2
    elif offloaded:
        why = ("its weights are offloaded to CPU",) * 2
    else:
        why = shardable(model, mesh.size() if mesh.ndim == 1 else 0)
    embed, head = (reason is None for reason in why)
    model.ladle_vocab = ShardedVocab(model, mesh.get_group(), dtype, embed, head) if embed or head else None
    model.ladle_vocab_notes = end_notes(why, "sharded")


def gradient_sync(plan) -> str:
    """The plan's ``parallelism.fsdp2.gradient_sync``, settled by the planner (a plan made before the option
    existed accumulated unsharded: ``last_microbatch``).

    Raises:
        RuntimeError: the plan left it ``auto`` (the planner settles it; a hand-edited plan must too).
    """
    mode = plan.strategy_options.get("gradient_sync", "last_microbatch")
    if mode not in ("last_microbatch", "each_microbatch"):
        raise RuntimeError(
            f"fsdp2: the plan's gradient_sync is {mode!r}; the planner settles it to last_microbatch or "
            "each_microbatch. Plan again (ladle plan) rather than edit the plan."
        )
    return mode


class FSDP2Runtime(Runtime):
    """The worker side of ``FSDP2`` (``ladle.strategies.fsdp2``): what a rank does with the model."""

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        """Shard the model (an empty skeleton when ``pending``: each rank then reads only its rows)."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        from ladle.train.loading import run_dtype

        if pending is None:
            model.to(accelerator.device)
        replicate = replicas(plan)
        if replicate > 1:  # HSDP: dim 0 replicates, dim 1 shards (FSDP2 reads a 2-D mesh this way)
            mesh = init_device_mesh(
                accelerator.device.type,
                (replicate, accelerator.num_processes // replicate),
                mesh_dim_names=("replicate", "shard"),
            )
        else:
            mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
        compute = run_dtype(plan)
        options = {
            "mesh": mesh,
            "reshard_after_forward": plan.strategy_options.get("reshard_after_forward", True),
            "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
        }
        if plan.strategy_options.get("cpu_offload"):
            options["offload_policy"] = CPUOffloadPolicy()
        layers = decoder_layers(model)
        if not layers:
            raise RuntimeError("fsdp2: found no *DecoderLayer modules to shard in this model")
        for layer in layers:
            if plan.kernels.get("compile", plan.strategy_options.get("compile")):
                layer.compile()  # in place: parameter names (and saved adapter keys) keep no `_orig_mod.` prefix
            fully_shard(layer, **options)
        units = embedding_units(model)
        for unit in units:
            fully_shard(unit, **options)
        fully_shard(model, **options)
        from ladle.train.runtime.gloo_gather import use_in_place_gather

        model.ladle_all_gather = (
            "in place" if use_in_place_gather([*layers, *units, model], accelerator.device) else "fsdp2"
        )
        if pending is not None:
            pending.fill(model, "cpu" if options.get("offload_policy") else accelerator.device)
        wanted, offloaded = plan.strategy_options.get("shard_head", True), bool(options.get("offload_policy"))
        keep_vocab_sharded(model, mesh, wanted, offloaded, compute)
        model.ladle_gradient_sync, model.ladle_hsdp = gradient_sync(plan), replicate > 1
        return model, make_optimizer(model)

    def wrap_frozen(self, accelerator, model, plan, pending):
        """The same units, mesh and precision as ``wrap``, no optimizer."""
        frozen, _ = self.wrap(accelerator, model, lambda _: None, plan, pending)
        return frozen

    @contextmanager
    def whole_weights(self, accelerator, model):
        """Every FSDP unit unsharded on every rank (the all-gathers happen here, together) and kept unsharded
        through the sampler's forwards, whose number differs by rank: with nothing to reshard after a forward and
        nothing left to gather before one, those forwards make no collective. Resharded after, each unit's
        ``reshard_after_forward`` as it was."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in model.modules() if isinstance(m, FSDPModule)]
        states = [unit._get_fsdp_state() for unit in units]
        # What set_reshard_after_forward changes, as it was (the root's is special: FSDP2 sets it itself).
        saved = [
            (state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in state._fsdp_param_groups])
            for state in states
        ]
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit, state, (auto, infos) in zip(units, states, saved, strict=True):
                unit.reshard()
                state._auto_reshard_after_forward = auto
                for group, info in zip(state._fsdp_param_groups, infos, strict=True):
                    group.post_forward_mesh_info = info

    def check_applied(self, accelerator, model, plan) -> dict:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        params = list(model.parameters())
        plain = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
        if plain:
            raise RuntimeError(f"fsdp2 planned but {len(plain)} parameter(s) are not sharded, e.g. {plain[0]}")
        replicate = replicas(plan)
        expected = "(Replicate(), Shard(0))" if replicate > 1 else "(Shard(0),)"

        def placed_right(p) -> bool:
            if replicate > 1:
                return (
                    len(p.placements) == 2
                    and isinstance(p.placements[0], Replicate)
                    and isinstance(p.placements[1], Shard)
                    and p.placements[1].dim == 0
                )
            return all(isinstance(pl, Shard) and pl.dim == 0 for pl in p.placements)

        wrong = [p.placements for p in params if not placed_right(p)]
        if wrong and accelerator.num_processes > 1:
            raise RuntimeError(f"fsdp2 planned but parameters are placed {wrong[0]}, not {expected}")
        local = sum(p.to_local().numel() for p in params)
        total = sum(p.numel() for p in params)
        return {
            "wrapper": "FSDP2" if replicate == 1 else "FSDP2 (HSDP)",
            "parameter_share": local / total,
            "local_numel": local,
            "total_numel": total,
            "sharded_parameters": len(params),
            "decoder_layers_sharded": len(decoder_layers(model)),
            **model.ladle_vocab_notes,
            "all_gather": model.ladle_all_gather,
            "gradient_sync": model.ladle_gradient_sync,
            "mesh": [replicate, plan.world_size // replicate],
        }

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        """Adapters are gathered parameter by parameter (``gather_whole``), not through the frozen base."""
        if not trainable_only:
            return super().full_state_dict(accelerator, model, trainable_only)
        from ladle.train.runtime.mesh_parallel import gather_whole

        out = gather_whole(model, trainable_only=True, keep=accelerator.is_main_process)
        return out if accelerator.is_main_process else None

    def no_sync(self, accelerator, model):
        """A micro-batch before the step's last: ``last_microbatch`` skips its reduce-scatter (the gradients
        accumulate unsharded); ``each_microbatch`` runs it (they accumulate sharded), and under HSDP defers only
        the all-reduce across replicas to the last micro-batch."""
        from ladle.train.runtime.mesh_parallel import no_all_reduce, no_gradient_sync

        if model.ladle_gradient_sync == "last_microbatch":
            return no_gradient_sync(model)
        return no_all_reduce(model) if model.ladle_hsdp else nullcontext()
