"""The memory model's activation coefficients (re-measured here) and the planner's sizing decisions,
over model size x GPU count x interconnect x full/LoRA/QLoRA, asserting the reasoning."""

from __future__ import annotations

import pytest

from ladle import sizing
from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe_file
from ladle.plan.planner import make_plan
from ladle.sizing.params import read_config
from tests.helpers import CONSUMER_2, NVSWITCH_8, PCIE_8

MODELS = {
    name: read_config(f"recipes/models/{name}")
    for name in ("llama-3.2-1b", "llama-3.1-8b", "llama-3.1-70b", "qwen3-32b")
}


@pytest.fixture(autouse=True)
def bitsandbytes_present(monkeypatch):
    """These plans are for GPU hosts that have bitsandbytes; its absence here is tested in test_memory_truth.py."""
    monkeypatch.setattr("ladle.plan.planner.bitsandbytes_installed", lambda: True)


@pytest.fixture(scope="module")
def machines(tmp_path_factory):
    root = tmp_path_factory.mktemp("topo")

    def machine(text: str, gib: float, name: str):
        (root / name).write_text(text)
        return probe_file(str(root / name), env={}, gpu_memory_gib=gib)

    return {
        "8x80 nvswitch": machine(NVSWITCH_8, 80, "a"),
        "8x48 pcie": machine(PCIE_8, 48, "b"),
        "2x24 pcie": machine(CONSUMER_2, 24, "c"),
    }


def plan(machines, machine: str, model: str, kind: str, *overrides: str, nodes: int = 1):
    extra = {"full": ["training.lora.enabled=false"], "lora": [], "qlora": ["training.quantization.mode=nf4"]}[kind]
    cfg = build_config(
        {
            "base": "b",
            "data": {"path": "d", "seq_len": 2048},
            "training": {"micro_batch_size": 1, "gradient_checkpointing": True, "dtype": "bfloat16"},
            "parallelism": {"nodes": nodes, "main_port": 29500},
        },
        [*extra, *overrides],
    )
    return make_plan(cfg, machines[machine], "job.yaml", model=MODELS[model])


@pytest.mark.parametrize("dims", [(128, 352, 4, 2), (512, 1408, 8, 4), (256, 1024, 8, 8)])
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_activation_coefficients_match_a_measured_llama_block(dims, dtype_name):
    """Count the bytes a real Llama decoder block (SDPA) saves for backward, with saved-tensor hooks."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    h, i, heads, kv_heads = dims
    dtype = getattr(torch, dtype_name)
    config = LlamaConfig(
        hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv_heads, num_hidden_layers=1
    )
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).to(dtype)
    b, s = 2, 64
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    rotary = tuple(t.to(dtype) for t in LlamaRotaryEmbedding(config)(x, positions))
    skip = {p.untyped_storage().data_ptr() for p in layer.parameters()} | {
        t.untyped_storage().data_ptr() for t in rotary
    }
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_embeddings=rotary, position_ids=positions)
    shape = sizing.ModelShape(0, 0, 1, h, i, kv_heads * (h // heads), heads, 0, 0, 0)
    assert sum(saved.values()) == sizing.activation_bytes_per_token_layer(shape, dtype.itemsize) * b * s


CASES = [
    # machine, model, kind, chosen, words the reasoning must contain
    ("8x80 nvswitch", "llama-3.2-1b", "full", "ddp", ["a full replica fits", "within 72.0 GiB usable of 80.0 GiB"]),
    ("2x24 pcie", "llama-3.2-1b", "full", "zero1", ["optimizer state sharded", "faster ddp do not fit"]),
    ("8x80 nvswitch", "llama-3.1-8b", "full", "fsdp2", ["nvswitch: all-gathers are cheap", "faster ddp do not fit"]),
    ("8x48 pcie", "llama-3.1-8b", "full", "zero2", ["gradients sharded too", "faster ddp, zero1 do not fit"]),
    (
        "8x80 nvswitch",
        "llama-3.1-70b",
        "full",
        "zero3",
        [
            "zero3+offload: last resort",
            "faster ddp, fsdp2, zero1, nd(tp=8), zero2, zero3, pipeline, nd(dp_shard=4 × sp=2), nd(dp_shard=2 × sp=4), nd(sp=8) do not fit",
        ],
    ),
    ("8x80 nvswitch", "llama-3.1-70b", "lora", "fsdp2", ["frozen base does not fit whole", "faster ddp do not fit"]),
    ("8x80 nvswitch", "llama-3.1-70b", "qlora", "ddp", ["adapter gradients are tiny"]),
    ("8x48 pcie", "llama-3.1-70b", "qlora", "fsdp2", ["FSDP2 shards it", "faster ddp do not fit"]),
    ("8x80 nvswitch", "llama-3.1-8b", "lora", "ddp", ["adapter gradients are tiny", "within 72.0 GiB"]),
    ("2x24 pcie", "llama-3.1-8b", "qlora", "ddp", ["within 21.6 GiB usable of 24.0 GiB"]),
]


@pytest.mark.parametrize(("machine", "model", "kind", "chosen", "words"), CASES)
def test_planner_picks_the_fastest_strategy_that_fits(machines, machine, model, kind, chosen, words):
    made = plan(machines, machine, model, kind)
    assert made.strategy == chosen
    reason = next(r for r in made.reasons if r.startswith("strategy "))
    for word in words:
        assert word in reason, reason
    fitting = [c for c in made.candidates if c["fits"]]
    assert fitting and made.candidates.index(fitting[0]) == min(made.candidates.index(c) for c in fitting)
    for candidate in made.candidates:  # every candidate carries its number and its reason
        assert candidate["per_rank_gib"] > 0 and candidate["why"] and "/rank (" in candidate["breakdown"]


def test_offload_is_a_last_resort_and_says_so(machines):
    made = plan(machines, "8x80 nvswitch", "llama-3.1-70b", "full")
    assert made.strategy_options["offload_optimizer"] == "cpu"
    assert made.launcher_config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert any("optimizer step runs on the host" in w for w in made.warnings)


def test_more_nodes_choose_zeropp_and_shrink_the_share(machines):
    one = plan(machines, "8x80 nvswitch", "qwen3-32b", "full")
    two = plan(machines, "8x80 nvswitch", "qwen3-32b", "full", nodes=2)
    assert one.strategy == "zero3" and two.strategy == "zero++"
    assert "hpZ keeps weight all-gathers inside each node" in next(r for r in two.reasons if r.startswith("strategy"))
    assert two.launcher_config["zero_optimization"]["zero_hpz_partition_size"] == 8


def test_nothing_fits_is_one_error_with_the_fixes(machines):
    with pytest.raises(ConfigError) as err:
        plan(machines, "2x24 pcie", "llama-3.1-70b", "lora")
    text = str(err.value)
    assert "parallelism.strategy = auto: no strategy fits 21.6 GiB usable of 24.0 GiB per rank" in text
    assert "training.quantization.mode=nf4" in text and "add GPUs/nodes" in text


def test_explicit_choice_wins_and_is_told_when_it_does_not_fit(machines):
    made = plan(machines, "8x80 nvswitch", "llama-3.1-8b", "full", "parallelism.strategy=ddp")
    assert made.strategy == "ddp" and made.overrides == ["parallelism.strategy = ddp (explicit)"]
    warning = next(w for w in made.warnings if w.startswith("parallelism.strategy = ddp needs"))
    assert "more than 72.0 GiB usable" in warning and "fsdp2 would fit" in warning


def test_unknown_model_size_says_so(machines):
    cfg = build_config({"base": "b", "data": {"path": "d"}}, [])
    made = make_plan(cfg, machines["8x80 nvswitch"], model=None)
    assert made.strategy == "ddp" and "model size unknown" in made.reasons[1]


@pytest.mark.parametrize(
    "recipe",
    [
        "llama3-70b-fsdp2",
        "llama3-70b-nd",
        "llama3-70b-64k-sp",
        "qwen3-32b-zeropp",
        "deepseek-v3-pipeline",
        "llama3-8b-lora",
        "llama3-8b-qlora",
        "llama3.2-1b-lora",
        "llama3.2-1b-qlora",
    ],
)
@pytest.mark.parametrize("gib", [80, 141])
def test_every_recipe_plans_on_recorded_8_gpu_machines(machines, recipe, gib, tmp_path):
    from ladle.config import load_config
    from ladle.plan.inputs import local_model_config

    cfg = load_config(f"recipes/{recipe}.yaml")
    (tmp_path / "topo.txt").write_text(NVSWITCH_8)
    topo = probe_file(str(tmp_path / "topo.txt"), env={}, gpu_memory_gib=gib)
    model = local_model_config(cfg)
    assert model is not None  # the shipped config.json: planning is offline
    if recipe == "deepseek-v3-pipeline" and gib == 80:  # 671B bf16 base over 16 stages: 78 GiB of weights per GPU
        made = make_plan(cfg, topo, model=model)
        assert any(w.startswith("parallelism.strategy = pipeline needs") for w in made.warnings)
        return
    made = make_plan(cfg, topo, model=model)
    explicit = cfg.parallelism.strategy
    # 70b-nd's full fine-tune: tp inside the nodes, FSDP across them. 64k-sp's 64k-token rows: split over ranks
    # (sp) on 80 GiB GPUs; on 141 GiB ones FSDP2 holds whole rows (~107 GiB of 127 usable), and sp ranks last.
    chosen_by_planner = {"llama3-70b-nd": "nd", "llama3-70b-64k-sp": "nd" if gib == 80 else "fsdp2"}
    assert made.strategy == (explicit if explicit != "auto" else chosen_by_planner.get(recipe, "ddp"))
    assert set(made.memory) == {"load", "train", "merge", "evaluate", "serve"}
    if recipe == "deepseek-v3-pipeline":  # 1.3 TB of merged bf16 weights: 168 GiB per GPU even over 8
        assert [w for w in made.warnings if w.startswith("serve.backend = transformers: serving the merged model")]
        assert [w for w in made.warnings if w.startswith("evaluate: the merged model needs")]
        return
    assert not [w for w in made.warnings if "needs" in w], made.warnings
    assert made.candidates


def test_multinode_candidates_include_hsdp_sharded_per_machine(machines):
    made = plan(machines, "8x80 nvswitch", "qwen3-32b", "full", nodes=4)
    by_name = {c["strategy"]: c for c in made.candidates}
    assert list(by_name).index("zero++") < list(by_name).index("fsdp2+hsdp") < list(by_name).index("fsdp2")
    # HSDP shards over the 8 GPUs of a machine, FSDP over all 32: it holds more per rank, moves less across nodes
    assert by_name["fsdp2+hsdp"]["per_rank_gib"] > by_name["fsdp2"]["per_rank_gib"]
    assert "only one gradient all-reduce per step crosses the network" in by_name["fsdp2+hsdp"]["why"]


@pytest.mark.parametrize(
    ("machine", "model", "kind", "global_batch"),
    [
        ("8x80 nvswitch", "llama-3.1-8b", "lora", 256),
        ("2x24 pcie", "llama-3.2-1b", "qlora", 0),
        ("8x48 pcie", "llama-3.1-8b", "full", 64),
    ],
)
def test_auto_micro_batch_is_the_largest_that_fits_and_divides(machines, machine, model, kind, global_batch):
    made = plan(
        machines, machine, model, kind, "training.micro_batch_size=auto", f"training.global_batch_size={global_batch}"
    )
    micro = made.micro_batch_size
    reason = next(r for r in made.reasons if r.startswith(f"micro-batch {micro}:"))
    assert "the largest of 64/32/16/8/4/2/1 that fits" in reason
    assert made.global_batch_size == micro * made.world_size * made.gradient_accumulation
    if micro < 64:  # the next size up either does not fit or does not divide the batch
        bigger = plan(
            machines,
            machine,
            model,
            kind,
            f"training.micro_batch_size={micro * 2}",
            f"parallelism.strategy={made.strategy}",
        )
        bigger_fits = not any("needs" in w for w in bigger.warnings)
        assert not bigger_fits or (global_batch and global_batch % (micro * 2 * made.world_size))


def test_fsdp2_vocabulary_parallel_ends_gather_only_layers_and_chunk_the_logits(machines):
    """The 70B FSDP2 recipe on 8 GPUs: with the ends kept sharded (the default) nothing larger than a decoder
    layer is gathered and the logits are a chunk (128k vocabulary x 4 096 tokens would be 6 GB whole)."""
    from ladle.config import load_config
    from ladle.plan.inputs import local_model_config
    from ladle.plan.planner import plan_estimate

    estimates = {}
    for shard in (True, False):
        cfg = load_config("llama3-70b-fsdp2", [f"parallelism.fsdp2.shard_head={str(shard).lower()}"])
        model = local_model_config(cfg)
        made = make_plan(cfg, machines["8x80 nvswitch"], model=model)
        assert made.strategy == "fsdp2"
        assert made.launcher_config["vocabulary"].startswith("sharded" if shard else "gathered")
        estimates[shard] = plan_estimate(cfg, made, model)
    shape = sizing.shape_from_config(model)
    tokens = made.micro_batch_size * cfg.data.seq_len
    # gathered ends: the chunked fused loss's one chunk (the whole tokens x vocabulary with fused_loss=off)
    chunk = cfg.training.kernels.loss_chunk_mib * 2**20
    assert (
        estimates[False].logits == sizing.logits_bytes(shape, tokens, 2, chunk) < sizing.logits_bytes(shape, tokens, 2)
    )
    assert estimates[True].logits <= sizing.LOGITS_CHUNK_BYTES * (2 + 8) // 4 < estimates[False].logits
    assert estimates[True].gathered < estimates[False].gathered  # no embedding or head gathered
    assert estimates[True].weights == estimates[False].weights  # the same shards


def test_fsdp2_full_finetune_that_accumulates_holds_its_gradients_unsharded():
    """With ``gradient_sync: last_microbatch`` the micro-batches before a step's last run under no_sync, and FSDP2
    keeps each unit's gradient unsharded in float32 until the last one reduce-scatters it: a full fine-tune that
    accumulates holds 4 bytes a parameter on every rank, one that does not only its shard of them
    (bench/RESULTS.md: SmolLM2's GRPO on a CPU). ``each_microbatch`` reduce-scatters every micro-batch: the shard
    only, accumulating or not."""
    from ladle import strategies

    fsdp2 = strategies.get("fsdp2")
    cfg = build_config({"base": "ladle://tiny-llama", "data": {"path": "x"}}, [])
    deferred, each = (
        fsdp2.options(cfg).model_copy(update={"gradient_sync": mode}) for mode in ("last_microbatch", "each_microbatch")
    )
    shape = sizing.shape_from_config(MODELS["llama-3.1-8b"])
    for dtype_bytes, cuda in ((2, True), (4, False)):
        once = sizing.Job(shape, False, False, 1, 1024, dtype_bytes, False, 8, 1, microbatches=8, cuda=cuda)
        twice = sizing.Job(shape, False, False, 1, 1024, dtype_bytes, False, 8, 1, microbatches=16, cuda=cuda)
        alone, accumulating = fsdp2.model_states(once, deferred), fsdp2.model_states(twice, deferred)
        assert accumulating.gradients - alone.gradients == 4 * shape.params  # beside the shard the last one makes
        assert (accumulating.weights, accumulating.optimizer) == (alone.weights, alone.optimizer)
        assert fsdp2.model_states(twice, each) == fsdp2.model_states(once, each) == alone


def test_fsdp2_gradient_sync_auto_reduce_scatters_each_microbatch_where_unsharded_gradients_do_not_fit(machines):
    """Llama-3.1-8B, a full fine-tune under fsdp2, 4 micro-batches a rank: on 8 x 80 GiB its float32 gradients
    (32 GB a rank) fit held unsharded through the step, so auto reduce-scatters once a step; on 8 x 48 GiB they do
    not, so auto reduce-scatters each micro-batch and the gradients stay sharded; asked for there, the unsharded
    way is warned about in GiB."""
    layout = ("parallelism.strategy=fsdp2", "training.global_batch_size=32")
    roomy = plan(machines, "8x80 nvswitch", "llama-3.1-8b", "full", *layout)
    tight = plan(machines, "8x48 pcie", "llama-3.1-8b", "full", *layout)
    assert roomy.strategy_options["gradient_sync"] == roomy.launcher_config["gradient_sync"] == "last_microbatch"
    assert tight.strategy_options["gradient_sync"] == tight.launcher_config["gradient_sync"] == "each_microbatch"
    said = {
        name: next(r for r in p.reasons if r.startswith("fsdp2 gradient sync"))
        for name, p in (("roomy", roomy), ("tight", tight))
    }
    assert (
        "once a step, after the last of 4 micro-batches a rank (auto): the unsharded float32 gradients" in said["roomy"]
    )
    assert "each of 4 micro-batches a rank (auto): holding the gradients unsharded until the last" in said["tight"]
    assert "more than 43.2 GiB usable a rank" in said["tight"] and "at 4x the reduce-scatter traffic" in said["tight"]
    assert not any("needs" in w for w in tight.warnings)  # sharded, it fits
    asked = plan(
        machines, "8x48 pcie", "llama-3.1-8b", "full", *layout, "parallelism.fsdp2.gradient_sync=last_microbatch"
    )
    assert asked.strategy_options["gradient_sync"] == "last_microbatch"
    assert not any(r.startswith("fsdp2 gradient sync") for r in asked.reasons)
    assert any("parallelism.strategy = fsdp2 needs" in w for w in asked.warnings)
    # One micro-batch a rank, or LoRA: nothing is held back, so the step reduce-scatters once and says nothing.
    for quiet in (
        plan(
            machines, "8x48 pcie", "llama-3.1-8b", "full", "parallelism.strategy=fsdp2", "training.global_batch_size=8"
        ),
        plan(machines, "8x48 pcie", "llama-3.1-8b", "lora", *layout),
    ):
        assert quiet.strategy_options["gradient_sync"] == "last_microbatch"
        assert not any(r.startswith("fsdp2 gradient sync") for r in quiet.reasons)


def test_ddp_broadcast_counts_the_flat_buckets_as_torch_closes_them():
    """DDP's wrap broadcasts in buckets closed once they reach 250 MiB; a bucket of several tensors is copied
    flat, a single tensor is not; two are in flight. Llama-3's 128k vocabulary on 4 layers (the bench's
    wide-vocab shape): the 501 MiB embedding goes alone, the layers and the 501 MiB head make one bucket."""
    from ladle.strategies.ddp import broadcast_bytes

    config = {
        "model_type": "llama",
        "hidden_size": 1024,
        "intermediate_size": 2816,
        "num_hidden_layers": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "vocab_size": 128256,
    }
    shape = sizing.shape_from_config(config)
    sizes = sizing.tensor_sizes(shape)
    assert sum(sizes) == pytest.approx(shape.params, rel=0.001)  # every weight once (norms aside)
    job = sizing.Job(shape, True, False, 1, 128, 4, False, 2, 1, cuda=False)
    embedding = 128256 * 1024 * 4
    assert broadcast_bytes(job) == 4 * sum(sizes) - embedding  # the layers and the head, as one flat copy
    # Small tensors only: two full buckets in flight, each at most 250 MiB plus its last tensor.
    small = sizing.shape_from_config({**config, "vocab_size": 1000, "num_hidden_layers": 40})
    flat = broadcast_bytes(sizing.Job(small, True, False, 1, 128, 4, False, 2, 1, cuda=False))
    assert 2 * 250 * 2**20 <= flat <= 2 * (250 * 2**20 + 4 * max(sizing.tensor_sizes(small)))


def test_zero3_lora_keeps_frozen_ends_local_unless_trained_or_asked_not_to(machines):
    """The 70B LoRA recipe under ZeRO-3 on 8 GPUs: the frozen ends stay local rows (nothing larger than a decoder
    layer gathered, the logits a chunk); an end that modules_to_save trains, or shard_head=false, gathers them,
    and a trained head's copy is sized with its states."""
    from ladle.config import load_config
    from ladle.plan.inputs import local_model_config
    from ladle.plan.planner import plan_estimate

    estimates = {}
    for name, extra in {
        "local": [],
        "trained": ["training.lora.modules_to_save=[lm_head]"],
        "off": ["parallelism.deepspeed.shard_head=false"],
    }.items():
        cfg = load_config("llama3-70b-fsdp2", ["parallelism.strategy=zero3", "parallelism.fsdp2.compile=false", *extra])
        model = local_model_config(cfg)
        made = make_plan(cfg, machines["8x80 nvswitch"], model=model)
        assert made.strategy == "zero3"
        estimates[name] = plan_estimate(cfg, made, model)
    shape = sizing.shape_from_config(model)
    layer = 2 * shape.layer_params  # bf16
    assert estimates["local"].gathered == 2 * layer  # the layer in its backward and the one prefetched
    for gathered in ("trained", "off"):
        assert estimates[gathered].gathered == layer + 2 * shape.embedding_params
        assert estimates[gathered].logits > estimates["local"].logits
    assert estimates["off"].weights == estimates["local"].weights  # the same share of the base
    # modules_to_save: peft's trained copy of the head, with its gradient and Adam states, sharded over the 8 ranks
    head = shape.embedding_params // 2
    added = {k: getattr(estimates["trained"], k) - getattr(estimates["local"], k) for k in ("weights", "optimizer")}
    assert added == {"weights": pytest.approx(2 * head / 8, abs=2), "optimizer": pytest.approx(16 * head / 8, abs=2)}


def test_grpo_merges_lora_for_the_rollouts_only_where_the_copy_fits(machines):
    """Llama-3.1-8B, LoRA GRPO on 2 x 24 GiB: the attention projections' merged copy (2.5 GiB) fits, so the rollouts
    sample with it; on every linear layer the copy is 13 GiB and the plan would not fit with it, so they sample
    through the adapters, and the plan says both in GiB."""
    rl = {
        "objective": "grpo",
        "micro_batch_size": 8,
        "global_batch_size": 16,
        "dtype": "bfloat16",
        "rl": {"num_generations": 8, "max_completion_tokens": 256, "rewards": [{"fn": "length_penalty"}]},
    }
    made = {}
    for targets in ("[q_proj,k_proj,v_proj,o_proj]", "all-linear"):
        cfg = build_config(
            {"base": "b", "data": {"path": "d", "seq_len": 512}, "training": rl},
            [f"training.lora.target_modules={targets}"],
        )
        made[targets] = make_plan(cfg, machines["2x24 pcie"], "job.yaml", model=MODELS["llama-3.1-8b"])
    attention, every = made.values()
    assert attention.merged_rollouts and not every.merged_rollouts
    said = [next(r for r in p.reasons if r.startswith("rollouts sample")) for p in (attention, every)]
    assert "with a copy of the adapted weights with their adapters merged, 2.5 GiB per rank" in said[0], said
    assert (
        "through the adapters (auto): with a copy of the adapted weights with their adapters merged, 13.0 GiB"
        in said[1]
    )
    assert "more than 21.6 GiB usable a rank" in said[1], said
