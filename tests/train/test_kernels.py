"""The step's fast paths on CPU (``training.kernels``): the fused loss's value and gradients, compiled blocks,
LoRA computed in 16-bit under autocast, and what the plan decides and refuses."""

from __future__ import annotations

import pytest
import torch

from ladle.config import build_config
from ladle.data.packing import IGNORE
from ladle.plan import kernels as plan_kernels
from ladle.train import kernels, run_state
from ladle.train.kernels import FusedHead
from ladle.train.loss import token_cross_entropy


def tiny(lora: bool, dtype=torch.float32):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ladle.assets import tiny_model_dir

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=dtype)
    if lora:
        model = get_peft_model(
            model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
        )
    return model


def batch(model, rows=3, seq=40):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (rows, seq), generator=g)
    labels = ids.clone()
    labels[:, :9] = IGNORE  # a prompt per row
    labels[1, 20:] = IGNORE  # padding
    return ids, labels


def close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    """Equal within ``tolerance`` of the larger tensor's largest element (summation order differs)."""
    return bool((a - b).abs().max() <= tolerance * b.abs().max() + 1e-12)


def loss_and_grads(model, ids, labels, fused: FusedHead | None):
    """A training forward as the worker runs one (``use_cache=False``: no KV cache is built, nor compiled), then
    backward; the loss and every gradient."""
    model.zero_grad(set_to_none=True)
    if fused is not None:
        fused.expect(labels)
        loss = model(input_ids=ids, use_cache=False).logits
    else:
        loss, _ = token_cross_entropy(model(input_ids=ids, use_cache=False).logits, labels)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [True, False], ids=["lora (frozen head)", "full (trained head)"])
def test_chunked_loss_equals_plain(lora):
    model = tiny(lora)
    ids, labels = batch(model)
    plain, plain_grads = loss_and_grads(model, ids, labels, None)
    head = model.get_output_embeddings()
    fused = FusedHead.install(head, "chunked", chunk=7)  # several chunks and a ragged last one
    loss, grads = loss_and_grads(model, ids, labels, fused)
    assert fused.count == int((labels[:, 1:] != IGNORE).sum()) > 7
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(plain.item(), rel=1e-5)  # float32 sums of positive terms (testing guide)
    assert grads.keys() == plain_grads.keys() and grads
    assert ("lm_head.weight" in grads) is not lora
    for name, grad in grads.items():
        assert close(grad, plain_grads[name], 1e-5), name
    # Without labels handed over, the head is the plain head again (generation, the evaluate stage).
    assert model(input_ids=ids).logits.shape == (*ids.shape, model.config.vocab_size)
    # No trained token: a zero loss that still backpropagates.
    empty, _ = loss_and_grads(model, ids, torch.full_like(labels, IGNORE), fused)
    assert empty.item() == 0.0


def test_token_loss_uses_the_fused_head_and_says_when_it_was_not_called():
    from ladle.train.loss import token_loss

    model = tiny(lora=True)
    ids, labels = batch(model)
    data = {"input_ids": ids, "labels": labels, "position_ids": torch.arange(ids.size(1)).repeat(ids.size(0), 1)}
    plain, count = token_loss(model, data, [0, 1, 2], "cpu")
    fused_head = FusedHead.install(model.get_output_embeddings(), "chunked", chunk=16)
    run_state.on(model).fused = fused_head
    fused, fused_count = token_loss(model, data, [0, 1, 2], "cpu")
    assert fused_count == count == fused_head.count
    assert fused.item() == pytest.approx(plain.item(), rel=1e-5)  # float32 sums of positive terms (testing guide)
    other = tiny(lora=True)  # another run's model in the same process: the plain loss, not this run's head
    assert token_loss(other, data, [0, 1, 2], "cpu")[1] == count
    run_state.on(other).fused = fused_head  # a state whose head is not this model's
    with pytest.raises(RuntimeError, match="was not called"):
        token_loss(other, data, [0], "cpu")
    assert fused_head.labels is None  # nothing left over for the next forward


def test_compiled_blocks_train_as_eager_blocks():
    """Per-block torch.compile (inductor, C++ on the CPU) gives the eager loss and gradients."""
    model = tiny(lora=True)
    ids, labels = batch(model, rows=2, seq=32)
    eager, eager_grads = loss_and_grads(model, ids, labels, None)
    said = kernels.compile_blocks(model, {"compile": True}, "ddp")
    assert said == f"on: {model.config.num_hidden_layers} blocks"
    compiled, grads = loss_and_grads(model, ids, labels, None)
    assert compiled.item() == pytest.approx(eager.item(), rel=1e-5)
    for name, grad in grads.items():
        assert close(grad, eager_grads[name], 1e-3), name
    # names are unchanged (no `_orig_mod.`), so saved adapters and checkpoints keep their keys
    assert not [n for n, _ in model.named_parameters() if "_orig_mod" in n]


def saved_bytes(model, ids, labels) -> tuple[float, int]:
    """The loss under bf16 autocast, and the bytes of the distinct storages autograd saved for backward."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autocast("cpu", dtype=torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = token_cross_entropy(model(input_ids=ids).logits, labels)
    return loss.item(), sum(storages.values())


def test_lora_computes_in_the_run_dtype_under_autocast():
    """DDP's 16-bit run keeps float32 adapters under autocast; with peft's input cast off they compute in bf16
    and no second copy of each adapted input is saved."""
    model = tiny(lora=True, dtype=torch.bfloat16)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)  # peft's float32 master weights
    ids, labels = batch(model)
    cast_loss, cast_bytes = saved_bytes(model, ids, labels)
    said = kernels.lora_in_run_dtype(model, {"lora_compute": "run_dtype"}, "ddp", "cuda")
    assert said.startswith("run dtype under autocast (28 adapted layers")
    run_loss, run_bytes = saved_bytes(model, ids, labels)
    # peft's cast made a 16-bit copy of each adapted input for the adapter (float32, then autocast's bf16);
    # uncast, the adapter saves the input the base layer saves already: 10 % fewer bytes on the tiny model
    assert run_bytes < 0.95 * cast_bytes
    assert run_loss == pytest.approx(cast_loss, rel=2e-2)  # bf16 matmuls either way; only the inputs' cast differs
    # nothing to do where the strategy already holds adapters in the run's dtype, or on a CPU run
    assert kernels.lora_in_run_dtype(model, {"lora_compute": "run_dtype"}, "fsdp2", "cuda").startswith("run dtype")
    assert kernels.lora_in_run_dtype(model, {"lora_compute": "run_dtype"}, "ddp", "cpu") == "float32 (CPU run)"


def cfg_with(*overrides: str):
    return build_config({"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}, list(overrides))


def test_plan_decides_each_fast_path_with_its_reason():
    on_gpu, why = plan_kernels.decide(cfg_with().training.kernels, "ddp", "cuda", "bfloat16")
    assert on_gpu == {
        "compile": True,
        "fused_loss": "auto",
        "loss_chunk_mib": 256,
        "liger": "off",  # compiled blocks: inductor fuses what Liger's kernels would
        "lora_compute": "run_dtype",
        "padding_free": True,
        "packed_attention": "auto",  # measured on an H200: 1.26x, no mask saved (bench/RESULTS.md)
        "lora_fused": False,  # not yet run on a GPU
    }
    assert "per-block compile on" in why[0] and "LoRA adapters compute in bfloat16" in why[0]
    assert "fused LoRA layers off: not yet run on a GPU" in why[0]
    on_cpu, why = plan_kernels.decide(cfg_with().training.kernels, "ddp", "cpu", "float32")
    assert (on_cpu["compile"], on_cpu["fused_loss"], on_cpu["liger"], on_cpu["lora_compute"]) == (
        False,
        "chunked",
        "off",
        "float32",
    )
    assert on_cpu["lora_fused"] is True and "fused LoRA layers one autograd function per adapted layer" in why[0]
    sharded, why = plan_kernels.decide(cfg_with().training.kernels, "zero3", "cpu", "float32")
    assert sharded["lora_fused"] is False and "zero3 gathers each module's weights as called" in why[0]
    eager, _ = plan_kernels.decide(
        cfg_with("training.kernels.compile=false").training.kernels, "ddp", "cuda", "bfloat16"
    )
    assert (eager["compile"], eager["liger"]) == (False, "auto")
    staged, why = plan_kernels.decide(cfg_with().training.kernels, "pipeline", "cuda", "bfloat16")
    assert staged["fused_loss"] == "off" and "pipeline computes its loss in its own stages" in why[0]
    assert staged["compile"] is False
    from ladle import strategies

    fsdp2 = strategies.get("fsdp2")
    asked = cfg_with("parallelism.fsdp2.compile=true", "parallelism.strategy=fsdp2")
    named = fsdp2.compile_asked(fsdp2.options(asked))  # the strategy names its own option: no name compared here
    assert named == "parallelism.fsdp2.compile = true" and strategies.get("ddp").compile_asked(None) is None
    legacy, why = plan_kernels.decide(
        cfg_with("training.kernels.compile=false").training.kernels, "fsdp2", "cuda", "bfloat16", compile_asked=named
    )
    assert legacy["compile"] is True and "per-block compile on (parallelism.fsdp2.compile = true)" in why[0]


def test_plan_refuses_what_cannot_run():
    k = cfg_with("training.kernels.compile=true").training.kernels
    assert "runs with ddp, zero1, zero2, fsdp2 only" in plan_kernels.problems(k, "zero3", "cuda")[0]
    k = cfg_with("training.kernels.liger=true", "training.kernels.fused_loss=liger").training.kernels
    found = plan_kernels.problems(k, "ddp", "cpu")
    assert len(found) == 2
    assert found[0].startswith("training.kernels.liger = true: Liger's kernels are Triton kernels for CUDA")
    assert "Set training.kernels.fused_loss=chunked" in found[1]
    k = cfg_with("training.kernels.fused_loss=liger").training.kernels
    assert plan_kernels.problems(k, "ddp", "cuda") == []
    assert "which fsdp2 does not keep" in plan_kernels.problems(k, "fsdp2", "cuda")[0]
    k = cfg_with("training.kernels.lora_fused=true").training.kernels
    assert plan_kernels.problems(k, "fsdp2", "cuda") == []  # asked for on a GPU: it runs (not yet measured there)
    (found,) = plan_kernels.problems(k, "zero3", "cpu")
    assert found.startswith("training.kernels.lora_fused = true with parallelism.strategy = zero3")
    assert "runs with ddp, zero1, zero2, fsdp2 only. Set training.kernels.lora_fused=auto or false." in found


def test_the_memory_model_counts_one_chunk_of_logits():
    from ladle import sizing

    shape = sizing.ModelShape(
        params=8_000_000_000,
        trainable=0,
        layers=32,
        hidden=4096,
        intermediate=14336,
        vocab=128256,
        heads=32,
        kv_dim=1024,
        embedding_params=525_336_576,
        layer_params=218_112_000,
    )
    plain = sizing.logits_bytes(shape, 4096, 2)
    chunked = sizing.logits_bytes(shape, 4096, 2, chunk_bytes=256 * 2**20)
    assert plain == 4096 * 128256 * 10  # 4.9 GiB: bf16 logits, their float32 copy and log-softmax
    assert chunked == 523 * 128256 * 10  # 256 MiB of float32 logits at a time
    assert sizing.logits_bytes(shape, 100, 2, chunk_bytes=256 * 2**20) == 100 * 128256 * 10
    # Liger's chunks: tokens x hidden / vocabulary (4096 / 32 = 128 rows), plus the head input's gradient
    liger = sizing.logits_bytes(shape, 4096, 2, chunk_bytes=256 * 2**20, liger=True)
    assert liger == 128 * 128256 * 6 + 4096 * 4096 * 2
    # compiled blocks save 0.75 of the eager activations (measured on an H200; see sizing.COMPILED_ACTIVATIONS),
    # and a packed row's mask on CUDA is seq x seq x (1 + dtype) bytes per layer: 1,536 MiB on the 8B row
    assert 0.7 < sizing.COMPILED_ACTIVATIONS < 0.8
    assert sizing.attention_mask_bytes(32, 1, 4096, 2) == 1536 * 2**20


# Peaks measured on one H200 (bench/gpu_train.sh, 2026-11-26 and 2026-11-28; bench/RESULTS.md):
# torch.cuda.max_memory_allocated in MiB with the fast paths (LoRA on every linear layer, bf16, blocks compiled,
# Liger's loss where the head is plain), attention example by example or through the packed rows' mask.
RECORDED_H200 = [
    # (model, strategy, seq_len, micro-batch, LoRA rank, attention by example, measured MiB)
    ("8b", "ddp", 4096, 1, 16, True, 34980),
    ("8b", "ddp", 4096, 1, 16, False, 36515),
    ("0.73b", "ddp", 512, 2, 8, False, 2860),
    ("0.73b", "fsdp2", 512, 2, 8, False, 2975),
]


@pytest.mark.parametrize("model,strategy,seq,micro,rank,by_example,measured", RECORDED_H200)
def test_memory_model_within_five_percent_of_the_recorded_gpu_peaks(
    monkeypatch, model, strategy, seq, micro, rank, by_example, measured
):
    from types import SimpleNamespace

    from bench.gpu_truth import LLAMA3_8B
    from bench.memory import LARGE
    from ladle.plan.planner import plan_estimate

    # liger-kernel was installed on the GPU host: the planner asks ladle.plan.kernels (patching the worker's
    # ladle.train.kernels, as this test once did, left the planner expecting the chunked loss)
    monkeypatch.setattr(plan_kernels, "liger_importable", lambda: True)
    shape = {**LLAMA3_8B, "max_position_embeddings": 8192} if model == "8b" else LARGE
    config = {"model_type": "llama", "tie_word_embeddings": False, "vocab_size": 32000, **shape}
    cfg = build_config(
        {
            "base": "b",
            "data": {"path": "d", "seq_len": seq},
            "parallelism": {"strategy": strategy},
            "training": {
                "micro_batch_size": micro,
                "dtype": "bfloat16",
                "lora": {"r": rank, "target_modules": "all-linear", "modules_to_save": []},
                "kernels": {"packed_attention": "auto" if by_example else False},
            },
        },
        [],
    )
    plan = SimpleNamespace(
        strategy=strategy,
        gradient_checkpointing=False,  # the recorded runs kept every activation
        device="cuda",
        processes_per_machine=1,
        num_machines=1,
        dtype="bfloat16",
        micro_batch_size=micro,
        strategy_options={},  # the config's own (LoRA: nothing for fsdp2's gradient sync to settle)
        merged_rollouts=False,
    )
    est = plan_estimate(cfg, plan, config)
    predicted = (est.peak - est.context) / 2**20  # max_memory_allocated does not count the CUDA context
    print(f"{model} {strategy} by_example={by_example}: {predicted:.0f} / {measured} = {predicted / measured:.3f}")
    assert 0.95 <= predicted / measured <= 1.05, est.summary()
