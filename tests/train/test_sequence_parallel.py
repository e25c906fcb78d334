"""Ulysses sequence parallelism (``parallelism.dims.sp``) on 2 and 4 real gloo processes.

The layer: every rank holds a slice of each row, and the summed loss and the gradients (all-reduced over the
ranks) must equal one process's over whole rows, float32 to 1e-5 relative, for multi-head attention and for GQA
(KV heads fewer than the ranks: repeated), on packed rows (several examples per row, positions restarting) with
LoRA adapters and with every weight trained.

The run: ``ladle train``'s worker with ``nd`` at sp=2 (FSDP over the 2 ranks), sp=2 × dp_shard=2 and
dp_replicate=2 × sp=2 (HSDP; 4 ranks), trained on the same global batches as one process: losses, eval and the
trained weights or adapters agree.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.helpers import launch_all, run_ranks, strategy_spec

ROWS, LENGTH = 2, 24


def tiny_llama(kv_heads: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        head_dim=16,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).float()


def packed_batch():
    """Two rows of packed examples (positions restart per example), labels untrained on each prompt's tokens."""
    from ladle.data.packing import IGNORE

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (ROWS, LENGTH), generator=g)
    positions = torch.cat(
        [torch.cat([torch.arange(10), torch.arange(14)])[None], torch.cat([torch.arange(7), torch.arange(17)])[None]]
    )
    labels = ids.clone()
    labels[0, :3] = IGNORE
    labels[1, 7:9] = IGNORE
    return ids, labels, positions


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(2)
    model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    return model


def loss_and_grads(model, ids, labels, positions):
    from ladle.train.loss import token_cross_entropy

    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=positions, use_cache=False).logits
    loss, count = token_cross_entropy(logits, labels)
    return loss, count


CASES = {  # name: (ranks, KV heads of the 4 attention heads, LoRA)
    "sp2-mha-lora": (2, 4, True),
    "sp2-gqa-full": (2, 2, False),
    "sp4-mha-full": (4, 4, False),
    "sp4-gqa-repeated-lora": (4, 2, True),  # 2 KV heads over 4 ranks: each repeated twice
}


def rank_main(rank: int, world: int, port: int, queue) -> None:
    """Every case of this world size in one process group (one process start per rank for all of them)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {name: one_case(rank, kv, lora) for name, (ranks, kv, lora) in CASES.items() if ranks == world}
        queue.put(results if rank == 0 else None)
    finally:
        dist.destroy_process_group()


def one_case(rank: int, kv_heads: int, lora: bool) -> dict:
    import torch.distributed as dist

    from ladle.train import sequence_parallel

    ids, labels, positions = packed_batch()
    reference = tiny_llama(kv_heads)
    reference = with_lora(reference) if lora else reference
    total = int((labels[:, 1:] != -100).sum())
    loss, _ = loss_and_grads(reference, ids, labels, positions)
    (loss / total).backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters() if p.grad is not None}

    model = tiny_llama(kv_heads)
    model = with_lora(model) if lora else model
    sequence_parallel.install(model, dist.group.WORLD)
    from ladle.train import run_state

    ulysses = run_state.of(model).ulysses
    part, count = loss_and_grads(model, *ulysses.split(ids, labels, positions))
    (part / total).backward()
    summed = torch.tensor([float(part), float(count)], dtype=torch.float64)
    dist.all_reduce(summed)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for grad in grads.values():
        dist.all_reduce(grad)
    worst = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in expected.items() if n in grads)
    return {
        "loss": float(summed[0]),
        "count": int(summed[1]),
        "reference_loss": float(loss),
        "reference_count": total,
        "same_names": sorted(grads) == sorted(expected),
        "worst_relative": worst,
        "exchanges": ulysses.exchanges,
        "trained": len(grads),
    }


@pytest.fixture(scope="module")
def layer_results():
    results = {}
    for world in (2, 4):
        results.update(next(got for got in run_ranks(rank_main, world) if got is not None))
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_slices_give_the_whole_rows_loss_and_gradients(layer_results, case):
    got = layer_results[case]
    assert got["count"] == got["reference_count"] > 0
    assert got["loss"] == pytest.approx(got["reference_loss"], rel=1e-5)
    assert got["same_names"] and got["trained"] > 0
    assert got["worst_relative"] < 1e-5
    assert got["exchanges"] == 4 * 2  # q, k, v in and the output back, in each of the 2 layers


STEPS = 3
FULL = "training.lora.enabled=false"


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("sp")
    specs = {
        "one_full": strategy_spec("ddp", root, "parallelism.cpu_processes=1", FULL, steps=STEPS),
        "one_lora": strategy_spec("ddp", root, "parallelism.cpu_processes=1", steps=STEPS),
        "sp2_lora": strategy_spec("nd", root, "parallelism.cpu_processes=2", "parallelism.dims.sp=2", steps=STEPS),
        # 2 replicas of rows, each row split over 2 ranks; FSDP over all 4 (dp_shard × sp)
        "sp2_dp2_full": strategy_spec(
            "nd", root, "parallelism.cpu_processes=4", FULL, "parallelism.dims.sp=2", steps=STEPS
        ),
        # HSDP: 2 replica groups, each sharded over its 2 sp ranks
        "sp2_hsdp_lora": strategy_spec(
            "nd",
            root,
            "parallelism.cpu_processes=4",
            "parallelism.dims.sp=2",
            "parallelism.dims.dp_replicate=2",
            steps=STEPS,
        ),
    }
    results = launch_all(specs, parallel=1)
    return {name: (results[name], specs[name]) for name in specs}


@pytest.mark.parametrize(
    ("name", "reference", "world"),
    [("sp2_lora", "one_lora", 2), ("sp2_dp2_full", "one_full", 4), ("sp2_hsdp_lora", "one_lora", 4)],
)
def test_worker_losses_match_one_process(runs, name, reference, world):
    ref, run = runs[reference][0], runs[name][0]
    assert (run.strategy, run.world_size, run.backend) == ("nd", world, "gloo")
    assert run.sharding["sequence_parallel"]["sp"] == 2
    assert run.kernels["sequence_parallel"].startswith("on: Ulysses sp=2")
    assert run.train_losses == pytest.approx(ref.train_losses, rel=1e-5)
    assert run.eval_loss_after == pytest.approx(ref.eval_loss_after, rel=1e-5)
    # FSDP shards every parameter over dp_shard × sp (the flattened dimension), the embedding and head included;
    # HSDP's replica groups each hold the same shards
    placements = {role: entry["placements"] for role, entry in run.sharding["placements"].items()}
    whole = {"dp_replicate": "Replicate()"} if "hsdp" in name else {}
    assert placements["embed_tokens"] == placements["self_attn.q_proj"] == {**whole, "dp_shard_sp": "Shard(dim=0)"}
    assert run.sharding["fsdp"] is True


def test_trained_weights_and_adapters_equal_one_process(runs):
    from safetensors.torch import load_file

    def tensors(folder: str) -> dict:
        return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}

    # Adam divides each update by sqrt(v), so a near-zero gradient whose last digits differ (reduction order)
    # moves its weight by a visible share of lr = 3e-3: the full run is held to 5e-5 as tests/train/test_nd.py
    # holds FSDP x TP, the adapters to 1e-5.
    for name, reference, url, atol in (
        ("sp2_dp2_full", "one_full", "model_url", 5e-5),
        ("sp2_lora", "one_lora", "adapter_url", 1e-5),
        ("sp2_hsdp_lora", "one_lora", "adapter_url", 1e-5),
    ):
        mine, theirs = tensors(getattr(runs[name][0], url)), tensors(getattr(runs[reference][0], url))
        assert mine.keys() == theirs.keys() and mine
        for key, value in theirs.items():
            torch.testing.assert_close(mine[key], value, rtol=0, atol=atol, msg=f"{name}: {key}")


def fake_group_rank(rank: int, size: int):
    """A ``Ulysses`` for one rank of ``size`` without a process group: ``split`` needs only the two numbers."""
    from ladle.train.sequence_parallel import Ulysses

    ulysses = object.__new__(Ulysses)
    ulysses.size, ulysses.rank, ulysses.rows, ulysses.padded, ulysses.exchanges = size, rank, 0, 0, 0
    return ulysses


def test_split_shifts_labels_before_slicing_and_pads_only_to_divide():
    from ladle.data.packing import IGNORE

    ids = torch.arange(10, 17)[None]  # 7 tokens over 2 ranks: one padding token
    labels = torch.tensor([[IGNORE, IGNORE, 12, 13, 14, 15, 16]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    first, second = fake_group_rank(0, 2), fake_group_rank(1, 2)
    ids0, labels0, pos0 = first.split(ids, labels, positions)
    ids1, labels1, pos1 = second.split(ids, labels, positions)
    assert ids0.tolist() == [[10, 11, 12, 13]] and ids1.tolist() == [[14, 15, 16, 16]]
    # the last token of slice 0 (13) is trained to predict the first of slice 1 (14); a leading unused column
    assert labels0.tolist() == [[IGNORE, IGNORE, 12, 13, 14]]
    assert labels1.tolist() == [[IGNORE, 15, 16, IGNORE, IGNORE]]  # the row's last token and the padding: none
    assert pos0.tolist() == [[0, 1, 2, 0]] and pos1.tolist() == [[1, 2, 3, 4]]  # padding goes on counting
    assert (first.padded, second.padded) == (1, 1)
    # every trained target of the whole row, once
    assert int((labels0[:, 1:] != IGNORE).sum() + (labels1[:, 1:] != IGNORE).sum()) == int(
        (labels[:, 1:] != IGNORE).sum()
    )
    assert fake_group_rank(0, 2).split(ids[:, :6], labels[:, :6], positions[:, :6])[0].shape[1] == 3  # no padding


@pytest.mark.parametrize(
    ("heads", "kv", "sp", "repeats"), [(4, 4, 2, 1), (4, 2, 2, 1), (4, 2, 4, 2), (8, 1, 4, 4), (32, 8, 16, 2)]
)
def test_kv_heads_are_repeated_only_as_much_as_sp_needs(heads, kv, sp, repeats):
    from ladle.train.sequence_parallel import kv_repeats

    assert kv_repeats(heads, kv, sp) == repeats
