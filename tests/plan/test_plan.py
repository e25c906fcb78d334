import shlex

import pytest

from ladle.config import build_config
from ladle.errors import ConfigError
from ladle.machine.topology import probe
from ladle.plan.planner import make_plan
from tests.helpers import A100_X8, T4_X2

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}
CPU = probe(env={}, query_output="")
A100 = probe(env={}, query_output=A100_X8)
T4 = probe(env={}, query_output=T4_X2)


def plan_for(topo, *overrides, gpus=None):
    return make_plan(build_config(MINIMAL, list(overrides), gpus), topo, "my.yaml")


def test_auto_on_cpu_plans_gloo_processes_and_warns():
    plan = plan_for(CPU)
    assert (plan.device, plan.backend, plan.world_size, plan.strategy) == ("cpu", "gloo", 2, "ddp")
    assert any("--gpus auto found no GPU" in w for w in plan.warnings)
    assert any(r.startswith("strategy ddp:") for r in plan.reasons)


def test_explicit_gpus_on_cpu_host_prints_corrected_command():
    with pytest.raises(ConfigError) as info:
        plan_for(CPU, gpus="2")
    assert "parallelism.gpus = 2: this host has no CUDA GPU" in str(info.value)
    assert "ladle run my.yaml --gpus auto" in str(info.value)


def test_more_gpus_than_visible():
    with pytest.raises(ConfigError, match=r"parallelism.gpus = 8: this host has 2 visible GPU\(s\).*--gpus 2"):
        plan_for(T4, gpus="8")


def test_gpu_auto_uses_all_and_picks_dtype_by_capability():
    plan = plan_for(A100)
    assert (plan.device, plan.backend, plan.world_size, plan.dtype) == ("cuda", "nccl", 8, "bfloat16")
    assert plan_for(T4).dtype == "float16"


def test_global_batch_derives_accumulation():
    plan = plan_for(CPU, "training.micro_batch_size=2", "training.global_batch_size=16")
    assert plan.gradient_accumulation == 4
    assert any("gradient accumulation 4" in r for r in plan.reasons)


def test_every_problem_at_once():
    with pytest.raises(ConfigError) as info:
        plan_for(CPU, "training.global_batch_size=10", "serve.backend=mii", "training.quantization.mode=nf4", gpus="4")
    problems = info.value.problems
    assert len(problems) == 5  # the fifth: bitsandbytes, which this host lacks (tests/plan/test_memory_truth.py)
    assert any(p.startswith("training.global_batch_size = 10: not a multiple") and "Use 8 or 16" in p for p in problems)
    assert any(p.startswith("serve.backend = mii: DeepSpeed-MII has no CPU path") for p in problems)
    assert any(p.startswith("training.quantization.mode = nf4") for p in problems)


def test_explicit_strategy_is_an_override():
    plan = plan_for(CPU, "parallelism.strategy=ddp")
    assert plan.overrides == ["parallelism.strategy = ddp (explicit)"]


def test_launch_argv_is_a_list_and_keeps_metacharacters_verbatim():
    plan = plan_for(CPU)
    nasty = "/tmp/a b;rm -rf $HOME`x`/spec.json"
    argv = plan.launcher_argv([nasty], port=1234)
    assert argv[-1] == nasty
    assert argv[argv.index("--num_processes") + 1] == "2"
    assert "--multi_gpu" in argv  # two CPU processes need torchrun, not --cpu
    assert shlex.split(plan.launch_command([nasty], port=1234))[-1] == nasty


def test_cpu_ranks_are_forked_by_ladles_launcher_and_gpu_ranks_started_by_accelerate():
    cpu = plan_for(CPU)
    assert cpu.launcher_argv(["s.json"])[1:3] == ["-m", "ladle.train.launch"]
    assert cpu.launch_command(["s.json"]).startswith("python -m ladle.train.launch --multi_gpu --num_processes 2 ")
    gpu = plan_for(A100)
    assert gpu.launcher_argv(["s.json"])[1:3] == ["-m", "accelerate.commands.launch"]
    assert gpu.launch_command(["s.json"]).startswith("accelerate launch ")
    nodes = plan_for(CPU, "parallelism.nodes=2", "parallelism.main_port=29400")  # torchrun's agents meet the nodes
    assert nodes.launcher_argv(["s.json"])[1:3] == ["-m", "accelerate.commands.launch"]


def test_memory_output_rejected():
    with pytest.raises(ConfigError, match=r"output = memory://x: training runs in separate processes"):
        plan_for(CPU, "output=memory://x")


def test_fsdp2_is_selectable_and_carries_its_options():
    plan = plan_for(CPU, "parallelism.strategy=fsdp2", "parallelism.fsdp2.reshard_after_forward=false")
    assert plan.strategy == "fsdp2"
    assert plan.strategy_options == {
        "reshard_after_forward": False,
        "cpu_offload": False,
        "replicate": 1,
        "shard_head": True,
        "gradient_sync": "last_microbatch",  # LoRA: the gradients held back are the adapters'
        "compile": False,
    }
    assert plan.launcher_config["vocabulary"] == "sharded: vocabulary-parallel embedding and loss"
    assert "--multi_gpu" in plan.launcher_argv(
        ["spec.json"]
    )  # fully_shard is applied by ladle, not accelerate's plugin
    # A full fine-tune of a model whose size the plan does not know, two micro-batches a rank: its gradients are
    # reduce-scattered each micro-batch, so they are never held unsharded (tests/sizing sizes the choice).
    full = plan_for(
        CPU,
        "parallelism.strategy=fsdp2",
        "training.lora.enabled=false",
        "training.micro_batch_size=1",
        "training.global_batch_size=4",
    )
    assert full.strategy_options["gradient_sync"] == "each_microbatch"
    assert "fsdp2 gradient sync: each of 2 micro-batches a rank (auto; the model size or device memory is unknown" in (
        " ".join(full.reasons)
    )


def test_fsdp2_cpu_offload_needs_cuda():
    with pytest.raises(
        ConfigError, match=r"parallelism.fsdp2.cpu_offload = true: .*Set parallelism.fsdp2.cpu_offload=false"
    ):
        plan_for(CPU, "parallelism.strategy=fsdp2", "parallelism.fsdp2.cpu_offload=true")


def test_unknown_strategy_lists_the_choices():
    with pytest.raises(
        ConfigError,
        match=r"parallelism.strategy = \"zero9\": Input should be 'auto', 'ddp', 'zero1', 'zero2', 'zero3', 'zero\+\+', 'fsdp2', 'nd', 'pipeline' or 'tp'",
    ):
        plan_for(CPU, "parallelism.strategy=zero9")


def ds_config(topo, *overrides, gpus=None):
    return plan_for(topo, *overrides, gpus=gpus).launcher_config


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_renders_a_deepspeed_config_that_deepspeed_accepts(stage):
    from ladle.strategies.deepspeed_json import validate_with_deepspeed

    plan = plan_for(
        A100, f"parallelism.strategy=zero{stage}", "training.global_batch_size=64", "training.max_grad_norm=0.5"
    )
    config = plan.launcher_config
    assert config["zero_optimization"]["stage"] == stage
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (64, 4, 2)
    assert config["gradient_clipping"] == 0.5 and config["bf16"] == {"enabled": True}
    integers = (
        "reduce_bucket_size",
        "sub_group_size",
        "stage3_max_live_parameters",
        "stage3_max_reuse_distance",
        "stage3_prefetch_bucket_size",
    )
    for key in integers:
        if key in config["zero_optimization"]:
            assert type(config["zero_optimization"][key]) is int, key
    assert ("sub_group_size" in config["zero_optimization"]) is (stage == 3)
    validate_with_deepspeed(config, plan.world_size)  # DeepSpeed's own config model


def test_deepspeed_config_model_rejects_what_deepspeed_rejects():
    from ladle.strategies.deepspeed_json import validate_with_deepspeed

    config = ds_config(A100, "parallelism.strategy=zero3")
    with pytest.raises(Exception, match="stage"):
        validate_with_deepspeed({**config, "zero_optimization": {**config["zero_optimization"], "stage": 7}}, 8)


def test_zero_offload_renders_and_needs_cuda():
    zero = ds_config(
        A100,
        "parallelism.strategy=zero3",
        "parallelism.deepspeed.offload_optimizer=cpu",
        "parallelism.deepspeed.offload_param=nvme",
        "parallelism.deepspeed.nvme_path=/nvme",
    )["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "nvme", "pin_memory": True, "nvme_path": "/nvme"}
    with pytest.raises(ConfigError) as err:
        plan_for(
            CPU,
            "parallelism.strategy=zero2",
            "parallelism.deepspeed.offload_optimizer=cpu",
            "parallelism.deepspeed.offload_param=nvme",
        )
    text = str(err.value)
    assert "parallelism.deepspeed.offload_optimizer = cpu: offloading moves state off CUDA devices" in text
    assert "offload_param = nvme: needs a folder" in text
    assert "parameter offload needs parameter sharding (ZeRO-3), not zero2" in text


def test_zeropp_on_gpus_quantizes_and_resolves_the_bf16_conflict():
    bf16 = plan_for(A100, "parallelism.strategy=zero_pp")
    zero = bf16.launcher_config["zero_optimization"]
    assert bf16.strategy == "zero++" and zero["stage"] == 3
    assert (zero["zero_quantized_weights"], zero["zero_quantized_gradients"], zero["zero_hpz_partition_size"]) == (
        False,
        True,
        1,
    )
    assert any("quantized weights off (auto): bfloat16 run" in r for r in bf16.reasons)
    fp16 = plan_for(A100, "parallelism.strategy=zero++", "training.dtype=float16").launcher_config["zero_optimization"]
    assert fp16["zero_quantized_weights"] is True
    with pytest.raises(ConfigError, match=r"quantized_weights = true with training.dtype = bfloat16: qwZ dequantizes"):
        plan_for(
            A100,
            "parallelism.strategy=zero++",
            "training.dtype=bfloat16",
            "parallelism.deepspeed.quantized_weights=true",
        )
    with pytest.raises(ConfigError, match=r"quantized_gradients = true: ZeRO\+\+ quantization runs DeepSpeed's CUDA"):
        plan_for(CPU, "parallelism.strategy=zero++", "parallelism.deepspeed.quantized_gradients=true")


def test_zeropp_hpz_defaults_to_processes_per_machine_across_nodes():
    plan = plan_for(A100, "parallelism.strategy=zero++", "parallelism.nodes=4", "parallelism.main_port=29500")
    assert plan.world_size == 32 and plan.launcher_config["zero_optimization"]["zero_hpz_partition_size"] == 8


def test_plan_markdown_shows_the_deepspeed_json():
    text = plan_for(CPU, "parallelism.strategy=zero2").to_markdown()
    assert "## zero2 launcher config" in text and '"stage": 2' in text


def problems_of(topo, *overrides, gpus=None) -> str:
    with pytest.raises(ConfigError) as err:
        plan_for(topo, *overrides, gpus=gpus)
    return str(err.value)


def test_fsdp2_compile_needs_fsdp2_and_cuda_and_deepspeed_compile_is_rejected():
    assert "per-block torch.compile is supported on CUDA only" in problems_of(
        CPU, "parallelism.strategy=fsdp2", "parallelism.fsdp2.compile=true"
    )
    text = problems_of(A100, "parallelism.strategy=zero3", "parallelism.fsdp2.compile=true")
    assert (
        "parallelism.fsdp2.compile = true with parallelism.strategy = zero3: DeepSpeed with torch.compile is rejected"
        in text
    )
    assert "compile is wired for fsdp2 only, not ddp" in problems_of(
        A100, "parallelism.strategy=ddp", "parallelism.fsdp2.compile=true"
    )
    made = plan_for(A100, "parallelism.strategy=fsdp2", "parallelism.fsdp2.compile=true")
    assert made.strategy_options["compile"] is True


def test_pipeline_validators():
    assert "parallelism.pipeline.stages = 1: a pipeline needs at least 2 stages" in problems_of(
        A100, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=1", gpus="1"
    )
    assert "Set parallelism.pipeline.allow_cpu=true" in problems_of(CPU, "parallelism.strategy=pipeline")
    more = problems_of(
        T4, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=4", "training.global_batch_size=16"
    )
    assert "parallelism.pipeline.stages = 4: ladle runs one pipeline, one stage per process, but the plan has 2" in more
    assert "--set parallelism.pipeline.stages=2" in more
    fewer = problems_of(A100, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=4", gpus="8")
    assert "Train on 4 GPUs: --gpus 4 (or --gpus auto)" in fewer
    adapted = plan_for(
        A100, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=4", "training.global_batch_size=16"
    )
    assert adapted.world_size == 4 and any(
        "--gpus auto adapts to one pipeline of 4 stages" in r for r in adapted.reasons
    )
    assert adapted.gradient_accumulation == 4  # 16 rows / 4 micro: the microbatches of one pipeline
    assert "1f1b needs at least one microbatch per stage (2 < 4)" in problems_of(
        A100, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=4", "training.global_batch_size=8"
    )
    filled = plan_for(A100, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=4")
    assert (filled.global_batch_size, filled.gradient_accumulation) == (16, 4)  # default: one microbatch per stage
    with pytest.raises(ConfigError, match="Input should be less than or equal to 16"):
        plan_for(A100, "parallelism.strategy=pipeline", "parallelism.pipeline.stages=17")


def test_qlora_with_sharding_needs_float_storage(monkeypatch):
    monkeypatch.setattr("ladle.plan.planner.bitsandbytes_installed", lambda: True)
    text = problems_of(
        A100,
        "parallelism.strategy=fsdp2",
        "training.quantization.mode=nf4",
        "training.quantization.storage_dtype=uint8",
    )
    assert "training.quantization.storage_dtype = uint8 with parallelism.strategy = fsdp2" in text
    assert plan_for(A100, "parallelism.strategy=fsdp2", "training.quantization.mode=nf4").strategy == "fsdp2"


def test_config_path_with_shell_metacharacters_stays_one_argv_item():
    path = "my configs/$(rm -rf ~); `x` & y.yaml"
    made = make_plan(build_config(MINIMAL, []), A100, path)
    argv = made.launcher_argv([path])
    assert argv[-1] == path and argv.count(path) == 1
    assert shlex.split(made.launch_command([path]))[-1] == path


def test_hsdp_mesh_comes_from_the_plan():
    made = plan_for(
        A100,
        "parallelism.strategy=fsdp2",
        "parallelism.fsdp2.replicate=0",
        "parallelism.nodes=2",
        "parallelism.main_port=29500",
    )
    assert made.launcher_config["mesh"] == {"replicate": 2, "shard": 8}
    assert any(r.startswith("fsdp2 HSDP mesh 2 x 8") for r in made.reasons)
    assert "parallelism.fsdp2.replicate = 3: must divide the world size 8" in problems_of(
        A100, "parallelism.strategy=fsdp2", "parallelism.fsdp2.replicate=3"
    )
    assert plan_for(A100, "parallelism.strategy=fsdp2").launcher_config["mesh"] == {"shard": 8}


def test_tensor_parallel_validators():
    assert "peft's LoRA layers cannot wrap tensor-parallel (sharded) projections" in problems_of(
        A100, "parallelism.strategy=tp"
    )
    cfg = build_config(MINIMAL, ["parallelism.strategy=tp", "training.lora.enabled=false"])
    model = {
        "model_type": "llama",
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
        "vocab_size": 1000,
    }
    with pytest.raises(ConfigError) as err:
        make_plan(cfg, A100, model=model)
    text = str(err.value)
    assert "the model's num_attention_heads = 12 does not divide by 8" in text
    assert "the model's num_key_value_heads = 4 does not divide by 8" in text
    two = make_plan(cfg, T4, model=model)  # 12 and 4 heads split over 2 GPUs
    assert (two.strategy, two.world_size, two.strategy_options) == ("tp", 2, {})
    assert two.gradient_accumulation == 1 and two.global_batch_size == 4  # one replica: the ranks share each batch


def tiny_model_config() -> dict:
    import json

    from ladle.assets import resolve_base

    return json.loads((resolve_base("ladle://tiny-llama") / "config.json").read_text())


def eval_costs(plan, cfg, model) -> tuple[int, int, int]:
    """A training micro-batch's activations and logits, and the no-grad forward at the plan's eval micro-batch
    and at the next multiple of the training micro-batch: one layer's activations and the logits."""
    from dataclasses import replace

    from ladle import sizing, strategies
    from ladle.plan.planner import Target, sizing_job

    strategy, options = strategies.get(plan.strategy), strategies.get(plan.strategy).options(cfg)
    job = sizing_job(cfg, model, Target(plan.device, plan.processes_per_machine, 1, plan.dtype), plan.micro_batch_size)

    def forward(rows: int) -> int:
        wider = replace(job, micro_batch=rows)
        one_layer = sizing.activation_bytes(job.shape, rows * job.seq_len, 1, job.dtype_bytes, False)
        return one_layer + strategy.logits_bytes(wider, options)

    budget = strategy.activations(job, options)[0] + strategy.logits_bytes(job, options)
    return budget, forward(plan.eval_micro_batch_size), forward(plan.eval_micro_batch_size + plan.micro_batch_size)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "zero3"])
def test_eval_micro_batch_is_the_widest_no_grad_forward_within_a_training_micro_batchs_activations(strategy):
    model = tiny_model_config()
    cfg = build_config(MINIMAL, [f"parallelism.strategy={strategy}", "training.micro_batch_size=2"])
    plan = make_plan(cfg, CPU, model=model)
    budget, chosen, wider = eval_costs(plan, cfg, model)
    assert plan.micro_batch_size == 2 and plan.eval_micro_batch_size > 2 and plan.eval_micro_batch_size % 2 == 0
    assert chosen <= budget and (wider > budget or plan.eval_micro_batch_size == 16)  # 16: 8x, the cap
    assert any(r.startswith(f"eval micro-batch {plan.eval_micro_batch_size}: ") for r in plan.reasons)


def test_eval_micro_batch_of_the_70b_recipe_and_an_explicit_one_wins(tmp_path):
    """With activation checkpointing (the recipe's) a training micro-batch keeps each layer's input and one
    layer's activations, so a no-grad forward is 4x wider, not 8x."""
    from tests.plan.test_memory_truth import load_config, local_model_config, recorded

    cfg = load_config("recipes/llama3-70b-fsdp2.yaml")
    plan = make_plan(cfg, recorded(tmp_path), model=local_model_config(cfg))
    budget, chosen, wider = eval_costs(plan, cfg, local_model_config(cfg))
    assert plan.gradient_checkpointing and plan.eval_micro_batch_size == 4 * plan.micro_batch_size
    assert chosen <= budget < wider
    pinned = make_plan(
        cfg.model_copy(update={"training": cfg.training.model_copy(update={"eval_micro_batch_size": 3})}),
        recorded(tmp_path),
        model=local_model_config(cfg),
    )
    assert pinned.eval_micro_batch_size == 3 and "training.eval_micro_batch_size=3" in pinned.overrides


def test_pipeline_stages_evaluate_at_the_training_micro_batch():
    cfg = build_config(
        MINIMAL, ["parallelism.strategy=pipeline", "parallelism.pipeline.allow_cpu=true", "training.micro_batch_size=2"]
    )
    plan = make_plan(cfg, CPU, model=tiny_model_config())
    assert plan.eval_micro_batch_size == 2
    assert any("the stages' shapes are fixed" in r for r in plan.reasons)


def eight_b_on(gib: float, *overrides: str):
    """The 8B LoRA recipe at seq 4096 planned on 8 GPUs of ``gib`` each (a recorded topology)."""
    from ladle.config import load_config
    from ladle.machine.topology import probe_file
    from ladle.plan.inputs import local_model_config

    cfg = load_config("recipes/llama3-8b-lora.yaml", ["data.seq_len=4096", *overrides])
    topo = probe_file("tests/machine/topo_pastes/rtx4090-8-go-gpuallocator-17.txt", gpu_memory_gib=gib)
    return make_plan(cfg, topo, model=local_model_config(cfg, None))


def test_activation_checkpointing_auto_is_on_only_when_nothing_fits_without_it():
    """auto: 4 rows of 4096 tokens keep 84 GiB of activations, which no strategy fits on 80 GiB, so the plan
    recomputes them (and says why, in numbers); with the micro-batch left to the planner, one row fits without
    recomputing, so it stays off; an explicit value is kept."""
    on = eight_b_on(80, "training.gradient_checkpointing=auto", "training.micro_batch_size=4")
    assert on.gradient_checkpointing
    (why,) = [r for r in on.reasons if r.startswith("activation checkpointing")]
    assert why.startswith("activation checkpointing on (auto): nothing fits with every activation kept (the smallest")
    assert "recomputing each layer's in backward, ddp needs" in why
    off = eight_b_on(80, "training.gradient_checkpointing=auto", "training.micro_batch_size=auto")
    assert not off.gradient_checkpointing and off.micro_batch_size >= 1
    assert any(r.startswith("activation checkpointing off (auto): ddp fits without recomputing") for r in off.reasons)
    kept = eight_b_on(80, "training.gradient_checkpointing=false", "training.micro_batch_size=1")
    assert not kept.gradient_checkpointing
    assert not any(r.startswith("activation checkpointing") for r in kept.reasons)
    tiny = make_plan(build_config(MINIMAL, []), CPU, model=tiny_model_config())
    assert not tiny.gradient_checkpointing  # the default, auto, where everything fits


def test_nothing_fits_names_checkpointing_only_when_it_is_not_on():
    with pytest.raises(ConfigError) as refused:
        eight_b_on(24, "training.gradient_checkpointing=false", "training.micro_batch_size=4", "parallelism.nodes=1",
                   "training.lora.enabled=false")  # fmt: skip
    assert "set training.gradient_checkpointing=true" in str(refused.value)
    with pytest.raises(ConfigError) as refused:
        eight_b_on(24, "training.gradient_checkpointing=auto", "training.micro_batch_size=64",
                   "training.global_batch_size=512", "training.lora.enabled=false")  # fmt: skip
    assert "no strategy fits" in str(refused.value) and "gradient_checkpointing=true" not in str(refused.value)
