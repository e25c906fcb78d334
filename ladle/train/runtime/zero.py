"""DeepSpeed's worker side: what ladle does to a model around ``deepspeed.initialize``
(frozen embeddings kept out of ZeRO-3's partitioning, one dtype, partitions filled from the sharded load, the
master weights shared by ZeRO-1/2 ranks). The strategies themselves and the JSON they render are in
``ladle.strategies.deepspeed``; this module is imported only inside training processes (DeepSpeed itself through
``ladle.strategies.deepspeed_import``)."""

from __future__ import annotations

from ladle.strategies.deepspeed_import import import_deepspeed


def keep_ends_local(model, pending, options: dict, device):
    """Take a LoRA run's frozen input embedding and output head out of ZeRO-3's partitioning, each rank holding
    its rows of the vocabulary (``torch.chunk``'s split, as FSDP2 shards them) as a plain tensor read from the
    checkpoint; the loss then runs vocabulary-parallel (``runtime.vocab_parallel.ShardedVocab``).

    Partitioned, each end is a ZeRO-3 parameter gathered whole for its forward and again for its backward: on
    a big-vocabulary model the largest tensor a rank ever holds beside the activations (Llama-3-70B: 128k x 8k,
    2.1 GB in bf16). Frozen, it needs no gradient and no optimizer state, so nothing of ZeRO's is lost by holding
    rows instead: the ranks exchange token ids and hidden states (tokens x hidden), not the weight. The ends'
    weights become non-persistent buffers (outside DeepSpeed's parameters, its checkpoints and the adapter);
    ZeRO-3 models are never broadcast at ``deepspeed.initialize``, so each rank keeps its own rows.

    Returns the ``ShardedVocab`` (None when neither end qualifies) and what ``check_applied`` reports for each.
    """
    import torch
    import torch.distributed as dist

    from ladle.train.loading import shard_range
    from ladle.train.runtime.vocab_parallel import ShardedVocab, active_module, end_notes, shardable

    world, rank = dist.get_world_size(), dist.get_rank()
    if not options.get("shard_head", True):
        why = ["parallelism.deepspeed.shard_head = false"] * 2
    elif options.get("offload_param", "none") != "none":
        why = ["its weights are offloaded"] * 2
    else:
        why = list(shardable(model, world))
    ends = (model.get_input_embeddings(), model.get_output_embeddings())
    names = {id(m): name for name, m in model.named_modules()}
    for i, end in enumerate(ends):
        if why[i] is None and active_module(end) is not end:
            why[i] = "trained (modules_to_save): ZeRO-3 partitions what it steps"
        elif why[i] is None and any(p.requires_grad for p in end.parameters()):
            why[i] = "trained: ZeRO-3 partitions what it steps"
        if why[i] is not None:
            continue
        weight = end.weight
        shape = tuple(weight.ds_shape) if hasattr(weight, "ds_shape") else tuple(weight.shape)
        start, count = shard_range(shape[0], world, rank)
        del end.weight
        release_partition(weight)
        rows = torch.empty((count, *shape[1:]), dtype=weight.dtype, device=device)
        pending.read_into(f"{names[id(end)]}.weight", rows, (slice(start, start + count), slice(None)))
        end.register_buffer("weight", rows, persistent=False)
        end.ladle_first_row, end.ladle_rows = start, shape[0]
    embed, head = (reason is None for reason in why)
    dtype = ends[0].weight.dtype if embed else None
    vocab = ShardedVocab(model, dist.group.WORLD, dtype, embed, head) if embed or head else None
    return vocab, end_notes(why, "local rows")


def release_partition(param) -> None:
    """Free a ZeRO-3 parameter's partition now. DeepSpeed's gather and partition functions, attached to the
    parameter, refer back to it: a parameter taken out of its module lives on in that cycle, with its partition,
    until the garbage collector finds it (measured: a LoRA rank of the 0.38B bench model kept both ends'
    partitions, 131 MiB, through the rest of its load)."""
    import torch

    if hasattr(param, "ds_tensor"):
        param.ds_tensor.data = torch.empty(0, dtype=param.ds_tensor.dtype, device=param.ds_tensor.device)


def local_ends(module) -> list:
    """The ends ``keep_ends_local`` took out of ZeRO-3's partitioning."""
    ends = (module.get_input_embeddings(), module.get_output_embeddings())
    return [end for end in ends if end is not None and hasattr(end, "ladle_first_row")]


def one_dtype(model, dtype_name: str) -> None:
    """Give the trainable parameters ZeRO-3 did not create (peft's LoRA weights, ``modules_to_save`` copies)
    the run's dtype, as the engine itself does for stages 1 and 2 (``module.bfloat16()``) but skips for
    ZeRO-3. peft keeps adapters in float32 beside a 16-bit base, and ZeRO-3 packs each group's partitions
    into one flat buffer of a single dtype: a float32 adapter beside a bf16 ``modules_to_save`` head failed
    its assertion (``defragment``) on a GPU. The float32 master copy DeepSpeed keeps for the step is the
    precision the adapter trains in, as at stages 1 and 2."""
    import torch

    dtype = getattr(torch, dtype_name)
    for param in model.parameters():
        if param.requires_grad and not hasattr(param, "ds_id") and param.dtype != dtype:
            param.data = param.data.to(dtype)


def fill_partitioned(model, pending, main_process: bool) -> None:
    """Load a ``zero.Init`` model module by module: each module's partitioned parameters are gathered, rank 0
    copies the checkpoint's tensors in, and DeepSpeed re-partitions them on exit, so at most one module is
    whole in memory. Parameters made after ``zero.Init`` are plain tensors that every rank fills: peft's
    ``modules_to_save`` copies from the checkpoint, LoRA weights from their initial values. Buffers are never
    partitioned and already hold theirs."""
    deepspeed = import_deepspeed()
    import torch

    seen: set[int] = set()
    with torch.no_grad():
        for prefix, module in model.named_modules():
            own = [(n, p) for n, p in module.named_parameters(prefix=prefix, recurse=False) if id(p) not in seen]
            seen.update(id(p) for _, p in own)
            partitioned = [(n, p) for n, p in own if hasattr(p, "ds_id")]
            for name, p in own:
                if not hasattr(p, "ds_id"):
                    pending.read_into(name, p.data)
            if not partitioned:
                continue
            with deepspeed.zero.GatheredParameters([p for _, p in partitioned], modifier_rank=0):
                if main_process:
                    for name, p in partitioned:
                        pending.read_into(name, p.data)


def share_master(optimizer, stage: int) -> str:
    """A float32 run: make each float32 master partition the rank's parameter partition itself.

    ZeRO-3 means to do this itself when the two agree in dtype and device (``_create_fp32_partitions``: "we
    don't need another copy of the weights"), but it compares the partition's ``torch.device`` with its
    accelerator's device *name* (``device("cpu") == "cpu"`` is False in torch), so it always clones; ZeRO-1/2
    always clone. Either way a float32 run holds a second float32 copy of the rank's partition (727 MiB per rank
    on the 0.38B bench model's full fine-tune). The master is pointed at the partition's storage instead:
    stepping it updates the parameters in place, and DeepSpeed's copy back after the step copies each onto
    itself. Nothing is shared where the dtypes differ (16-bit runs need their float32 master), or where the
    optimizer is offloaded or swapped to NVMe.
    """
    import torch
    import torch.distributed as dist

    if any(getattr(optimizer, flag, False) for flag in ("offload_optimizer", "swap_optimizer", "cpu_offload")):
        return "a float32 copy on the host (optimizer offload)"
    if stage == 3:
        pairs = list(zip(optimizer.fp16_partitioned_groups_flat, optimizer.fp32_partitioned_groups_flat, strict=True))
    else:
        pairs = [
            (optimizer.parallel_partitioned_bit16_groups[i][dist.get_rank(group=group)], master)
            for i, (master, group) in enumerate(
                zip(optimizer.single_partition_of_fp32_groups, optimizer.real_dp_process_group, strict=True)
            )
        ]
    same = [
        (low, master)
        for low, master in pairs
        if low is not None and (low.dtype, low.device, low.numel()) == (master.dtype, master.device, master.numel())
    ]
    if not same:
        return "a float32 copy of the partition (mixed precision)"
    for low, master in same:
        if master.data_ptr() != low.data_ptr():
            if not torch.equal(master, low):
                raise RuntimeError(f"zero{stage}: a master partition differs from its parameters before any step")
            master.data = low.data
    if stage < 3:
        # ZeRO-1/2 map each parameter to its slice of the master (views, for DeepSpeed's per-parameter API):
        # made again, so that they view the shared storage and the clone is freed.
        optimizer._link_all_hp_params()
    if len(same) != len(pairs):  # e.g. sub-groups whose parameters are swapped out to NVMe
        return f"the parameter partition itself in {len(same)} of {len(pairs)} sub-groups, a copy in the rest"
    return "the parameter partition itself (float32 run: no second copy)"
