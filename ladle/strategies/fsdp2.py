"""FSDP2: torch's ``fully_shard`` per decoder layer and at the root.

Parameters, gradients and optimizer state are sharded on dim 0 across ranks
(DTensor ``Shard(0)``); each layer's parameters are all-gathered for its
forward and backward only. ladle applies ``fully_shard`` itself in the worker
rather than handing accelerate an FSDP plugin, because accelerate silently
runs DDP instead when that plugin meets a CPU run; ``check_applied`` then
verifies that every parameter really is sharded.
"""

from __future__ import annotations

from pydantic import Field

from ladle.section import Section
from ladle.sizing import memory
from ladle.strategies.base import Candidate, Strategy
from ladle.strategies.mesh import Dims
from ladle.strategies.registry import register
from ladle.train.kernels import decoder_layers


class FSDP2Options(Section):
    reshard_after_forward: bool = Field(
        True, description="Free each layer's gathered parameters after its forward (less memory, one more all-gather)."
    )
    cpu_offload: bool = Field(False, description="Keep parameters and optimizer state in CPU memory (CUDA runs only).")
    replicate: int = Field(
        1,
        ge=0,
        le=1024,
        description="HSDP: replica groups (data-parallel replicate degree); parameters are "
        "sharded within each group of world/replicate ranks and gradients all-reduced across groups. 1: plain "
        "FSDP (shard over all ranks). 0: one group per machine (shard inside the node, replicate across nodes).",
    )
    shard_head: bool = Field(
        True,
        description="Never gather the input embedding or the output head: each rank looks up, and computes the "
        "logits over, its own rows for every rank's tokens (vocabulary-parallel; the ranks exchange token ids and "
        "hidden states, tokens x hidden, instead of vocab x hidden weights). false: both are FSDP units, "
        "gathered for their forward and backward. Applies to untied ends under plain FSDP (not HSDP or "
        "cpu_offload).",
    )
    compile: bool = Field(
        False,
        description="use_fsdp2_compile: torch.compile each decoder block in place before sharding (CUDA, "
        "torch >= 2.2, accelerate >= 0.27). FSDP2 only; DeepSpeed with torch.compile is rejected.",
    )


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
    from ladle.strategies.runtime.vocab_parallel import ShardedVocab, end_notes, shardable

    if not wanted:
        why = ("parallelism.fsdp2.shard_head = false",) * 2
    elif offloaded:
        why = ("its weights are offloaded to CPU",) * 2
    else:
        why = shardable(model, mesh.size() if mesh.ndim == 1 else 0)
    embed, head = (reason is None for reason in why)
    model.ladle_vocab = ShardedVocab(model, mesh.get_group(), dtype, embed, head) if embed or head else None
    model.ladle_vocab_notes = end_notes(why, "sharded")


def vocab_stays_sharded(options: dict, replicate: int) -> bool:
    """Whether the plan keeps the embedding and the head sharded (untied ones; checked on the model itself)."""
    return options.get("shard_head", True) and replicate == 1 and not options.get("cpu_offload")


def compile_problems(topo) -> list[str]:
    """What per-block torch.compile under FSDP2 needs from the machine and the installed packages."""
    from importlib.metadata import PackageNotFoundError, version

    def at_least(package: str, wanted: tuple[int, int]) -> bool:
        try:
            parts = version(package).split("+")[0].split(".")
            return tuple(int(p) for p in parts[:2] if p.isdigit()) >= wanted
        except PackageNotFoundError:
            return False

    problems = []
    if topo.gpu_count == 0:
        problems.append(
            "parallelism.fsdp2.compile = true: per-block torch.compile is supported on CUDA only and this "
            "host has no GPU. Set parallelism.fsdp2.compile=false."
        )
    for package, wanted in (("torch", (2, 2)), ("accelerate", (0, 27))):
        if not at_least(package, wanted):
            problems.append(
                f"parallelism.fsdp2.compile = true: needs {package} >= {'.'.join(map(str, wanted))}. "
                f"Upgrade {package} or set parallelism.fsdp2.compile=false."
            )
    return problems


def replicas(plan) -> int:
    """HSDP replica groups for this plan (1: plain FSDP)."""
    replicate = plan.strategy_options.get("replicate", 1)
    return plan.num_machines if replicate == 0 else replicate


FAST_LINKS = ("nvswitch",)  # interconnects on which all-gathers are cheap


class FSDP2(Strategy):
    name = "fsdp2"
    summary = "fully sharded data parallel (fully_shard): parameters, gradients and optimizer state sharded"
    options_model = FSDP2Options
    options_section = "fsdp2"
    shards_tensors = True

    def offload(self, options) -> tuple[bool, bool]:
        return options.cpu_offload, options.cpu_offload  # CPUOffloadPolicy moves parameters and optimizer state

    def dims(self, options, world_size: int, nodes: int) -> Dims:
        replicate = nodes if options.replicate == 0 else options.replicate
        if replicate < 1 or world_size % replicate:
            replicate = 1  # validate() reports a replicate that does not divide the world
        return Dims(dp_replicate=replicate, dp_shard=world_size // replicate)

    def label(self, options) -> str:
        hsdp = "+hsdp" if options.replicate != 1 else ""
        return self.name + hsdp + ("+offload" if options.cpu_offload else "")

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        if job.world == 1:
            return []
        if job.lora:
            return [Candidate(self, 10, "the frozen base does not fit whole on a device; FSDP2 shards it")]
        out = []
        if job.nodes > 1:
            why = "HSDP: parameters sharded inside each machine, so only one gradient all-reduce per step crosses the network"
            out.append(Candidate(self, 15, why, {"replicate": 0}))
        if interconnect in FAST_LINKS:
            why = f"{interconnect}: all-gathers are cheap, so full sharding costs little and frees the most memory"
            return [*out, Candidate(self, 20, why)]
        why = f"{interconnect}: full sharding's extra all-gather is costly here, so it comes after ZeRO-1/2"
        return [*out, Candidate(self, 35, why)]

    def ends_gathered(self, job, options) -> bool:
        return not (job.shape.untied and job.world > 1 and vocab_stays_sharded(options.model_dump(), options.replicate))

    def model_states(self, job, options) -> memory.ModelStates:
        s, hsdp, offload = job.shape, options.replicate != 1, options.cpu_offload
        ends = self.ends_gathered(job, options)  # false: only decoder layers are ever gathered
        largest = max(s.layer_params, s.embedding_params // 2) if ends else s.layer_params
        if job.dtype_bytes == 4:  # float32 (CPU): the shards, one unit gathered with its gradient, the ends
            ranks = job.gpus_per_node if hsdp else job.world
            states = memory.fp32(s.params, ranks)
            gathered = 8 * largest + (4 * s.embedding_params if ends else 0)
            return memory.ModelStates(states.weights, states.gradients, states.optimizer, gathered)
        states = memory.zero3(
            s.params,
            largest,
            job.gpus_per_node,
            1 if hsdp else job.nodes,
            offload_optimizer=offload,
            offload_params=offload,
        )
        # Gathered, the embedding and the head are the largest units beside the layers.
        root = memory.WEIGHT_16 * s.embedding_params if ends else 0
        return memory.ModelStates(
            states.weights, states.gradients, states.optimizer, states.gathered + root, states.host
        )

    def load_bytes(self, job, options, states) -> int:
        """Loading fills each rank's rows from the safetensors (``Pending.fill`` reads a slice at a time), so
        beside its share a rank holds its rows of the tensor being read, not the whole tensor (QLoRA loads
        whole, quantizing on the way)."""
        if job.qlora:
            return super().load_bytes(job, options, states)
        weights = states.weights or job.dtype_bytes * job.shape.params // max(1, job.world)
        return weights + job.shape.largest_tensor * job.dtype_bytes // self.lora_base_ranks(job, options)

    def lora_base_ranks(self, job, options) -> int:
        return job.gpus_per_node if options.replicate != 1 else job.world

    def validate_unused(self, cfg, chosen) -> list[str]:
        if not cfg.parallelism.fsdp2.compile or chosen is self:
            return []
        what = chosen.compile_note or f"compile is wired for fsdp2 only, not {chosen.name}"
        return [
            f"parallelism.fsdp2.compile = true with parallelism.strategy = {chosen.name}: {what}. "
            "Set parallelism.strategy=fsdp2 or parallelism.fsdp2.compile=false."
        ]

    def validate(self, cfg, topo, target) -> list[str]:
        problems = []
        replicate, world_size = cfg.parallelism.fsdp2.replicate, target.world_size
        if replicate > 1 and (replicate > world_size or world_size % replicate):
            problems.append(
                f"parallelism.fsdp2.replicate = {replicate}: must divide the world size {world_size} "
                "(replicate x shard = world). Use a divisor, 0 (one group per machine) or 1 (plain FSDP)."
            )
        if cfg.parallelism.fsdp2.compile:
            problems += compile_problems(topo)
        if cfg.parallelism.fsdp2.cpu_offload and topo.gpu_count == 0:
            problems.append(
                "parallelism.fsdp2.cpu_offload = true: offloading to CPU needs CUDA devices to offload from; "
                "this host has none. Set parallelism.fsdp2.cpu_offload=false."
            )
        return problems

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        opts, replicate = plan.strategy_options, replicas(plan)
        shard = plan.world_size // max(replicate, 1)
        config = {
            "mesh": {"replicate": replicate, "shard": shard} if replicate > 1 else {"shard": plan.world_size},
            "reshard_after_forward": opts["reshard_after_forward"],
            "mixed_precision": {
                "param_dtype": plan.dtype if plan.device == "cuda" else "float32",
                "reduce_dtype": "float32",
            },
            "cpu_offload": opts["cpu_offload"],
            "compile": bool(plan.kernels.get("compile", opts["compile"])),
            "units": "each *DecoderLayer, the input embedding, the output head, then the root",
            "vocabulary": "sharded: vocabulary-parallel embedding and loss"
            if vocab_stays_sharded(opts, replicate)
            else "gathered: the embedding and the head are FSDP units",
        }
        reasons = []
        if replicate > 1:
            reasons.append(
                f"fsdp2 HSDP mesh {replicate} x {shard}: parameters sharded over {shard} ranks, "
                f"replicated {replicate} times; gradients all-reduced across replicas"
            )
        return config, reasons

    def wrap(self, accelerator, model, make_optimizer, plan, pending=None):
        """Shard the model (an empty skeleton when ``pending``: each rank then reads only its rows)."""
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

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
        compute = getattr(torch, plan.dtype) if plan.device == "cuda" else torch.float32
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
        from ladle.strategies.runtime.gloo_gather import use_in_place_gather

        model.ladle_all_gather = (
            "in place" if use_in_place_gather([*layers, *units, model], accelerator.device) else "fsdp2"
        )
        if pending is not None:
            pending.fill(model, "cpu" if options.get("offload_policy") else accelerator.device)
        wanted, offloaded = plan.strategy_options.get("shard_head", True), bool(options.get("offload_policy"))
        keep_vocab_sharded(model, mesh, wanted, offloaded, compute)
        return model, make_optimizer(model)

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
            "mesh": [replicate, plan.world_size // replicate],
        }

    def full_state_dict(self, accelerator, model, trainable_only: bool) -> dict | None:
        """Adapters are gathered parameter by parameter (``gather_whole``), not through the frozen base."""
        if not trainable_only:
            return super().full_state_dict(accelerator, model, trainable_only)
        from ladle.strategies.runtime.mesh_parallel import gather_whole

        out = gather_whole(model, trainable_only=True, keep=accelerator.is_main_process)
        return out if accelerator.is_main_process else None

    def no_sync(self, accelerator, model):
        from ladle.strategies.runtime.mesh_parallel import no_gradient_sync

        return no_gradient_sync(model)


register(FSDP2())
