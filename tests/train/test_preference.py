"""Preference tuning's loss against TRL's own trainers, and every strategy's first steps against DDP's.

On a fixed batch of pairs, ladle's loss and LoRA gradients equal TRL's ``DPOTrainer`` (trl 1.16, float32, 1e-5
relative) for each loss it shares with it, through each way ladle computes log-probabilities (the model's own
head over padded rows; the chunked fused head over padding-free joined rows); SimPO, which TRL keeps in its CPO
trainer, equals ``CPOTrainer.cpo_loss`` on log-probabilities computed side by side without packing.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from ladle.platform import storage
from tests.helpers import launch_all

PAIRS = [  # prompt, chosen, rejected token ids (EOS = 2 closes every completion)
    ([1, 5, 6, 7], [8, 9, 2], [10, 2]),
    ([1, 11, 12], [13, 2], [14, 15, 16, 2]),
    ([1, 20, 21, 22, 23], [24, 25, 26, 2], [24, 27, 2]),
]
# chosen completions of one length: RPO's term (a per-pair token mean here, a micro-batch token mean in TRL) agrees
SAME_LENGTH = [
    ([1, 5, 6, 7], [8, 2], [10, 2]),
    ([1, 11, 12], [13, 2], [14, 15, 16, 2]),
    ([1, 20, 21, 22], [24, 2], [27, 2]),
]
SEQ_LEN = 16


def tiny_lora_model(dropout: float = 0.0):
    """A 2-layer Llama with LoRA on every linear layer (``dropout``: LoRA's and the attention's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=dropout,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float()
    lora = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=dropout,
        target_modules="all-linear",
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    inner = Tokenizer(models.WordLevel({str(i): i for i in range(97)}, unk_token="0"))
    inner.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=inner, pad_token="0", eos_token="2")


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's DPOTrainer over a LoRA model; it keeps a copy of the adapter as the reference (``ref``), and the
    trained adapter is then moved away from it so the log-ratios are not zero."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    model = tiny_lora_model()
    args = DPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=len(PAIRS),
        disable_dropout=True,
        bf16=False,
    )
    rows = Dataset.from_list(
        [{"prompt": "5 6 7", "chosen": "8 9", "rejected": "10"}] * 2
    )  # never read: the batch below
    trainer = DPOTrainer(model=model, args=args, train_dataset=rows, processing_class=word_tokenizer())
    assert "ref" in trainer.model.peft_config
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B.default" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    return trainer


def trl_loss_and_grads(trainer, loss: str, smoothing: float, pairs=PAIRS) -> tuple[float, dict]:
    from trl.trainer.dpo_trainer import DataCollatorForPreference

    trainer.loss_types = [loss] if loss != "sigmoid+sft" else ["sigmoid", "sft"]
    trainer.loss_weights = [1.0] * len(trainer.loss_types)
    trainer.label_smoothing, trainer.beta = smoothing, 0.1
    batch = DataCollatorForPreference(pad_token_id=0)(
        [{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in pairs]
    )
    model = trainer.model
    model.zero_grad(set_to_none=True)
    value = trainer.compute_loss(model, batch)
    value.backward()
    return float(value), trained_grads(model)


def trained_grads(model) -> dict:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def pair_data(pairs=PAIRS) -> dict[str, torch.Tensor]:
    from ladle.data.packing import pack_examples
    from ladle.data.preference import pair_row

    rows = pack_examples([pair_row(p, c, r, SEQ_LEN, None, "right") for p, c, r in pairs], 2 * SEQ_LEN, 0, pack=False)
    return {
        "input_ids": torch.tensor(rows.input_ids),
        "labels": torch.tensor(rows.labels),
        "position_ids": torch.tensor(rows.position_ids),
        "real_tokens": torch.tensor(rows.real_tokens_per_row),
    }


@pytest.mark.parametrize("fast_paths", ["plain", "fused+joined"], indirect=True)
@pytest.mark.parametrize(
    ("loss", "smoothing", "pairs"),
    [("sigmoid", 0.0, PAIRS), ("ipo", 0.0, PAIRS), ("robust", 0.1, PAIRS), ("sigmoid+sft", 0.0, SAME_LENGTH)],
    ids=["sigmoid", "ipo", "robust", "sigmoid+sft"],
)
def test_loss_and_lora_gradients_equal_trl_dpo_trainer(trl_trainer, fast_paths, loss, smoothing, pairs):
    from ladle.train.preference import PairLoss, pair_logps

    expected, expected_grads = trl_loss_and_grads(trl_trainer, loss, smoothing, pairs)
    model = trl_trainer.model
    path, install = fast_paths
    install(model)
    data = pair_data(pairs)
    rows = list(range(len(pairs)))
    model.set_adapter("ref")  # the reference, computed by ladle's own path
    with torch.no_grad():
        data["reference"] = pair_logps(model, data, rows, "cpu")[0].double()
    model.set_adapter("default")
    model.zero_grad(set_to_none=True)
    sft = 1.0 if loss == "sigmoid+sft" else 0.0
    pair_loss = PairLoss(loss.removesuffix("+sft"), 0.1, smoothing, 0.5, "precomputed", sft)
    total, count = pair_loss(model, data, rows, "cpu")
    (total / count).backward()
    grads = trained_grads(model)
    assert count == len(pairs)
    assert float(total / count) == pytest.approx(expected, rel=1e-5, abs=1e-7), path
    assert set(grads) == set(expected_grads) and grads
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().clamp(min=1e-12)
        assert (grad - expected_grads[name]).abs().max() / scale < 1e-5, (path, name)
    stats = pair_loss.take_stats(SimpleNamespace(device="cpu", num_processes=1))
    assert 0.0 <= stats["preference_accuracy"] <= 1.0
    assert stats["reward_margin"] == pytest.approx(stats["rewards_chosen"] - stats["rewards_rejected"], abs=1e-9)


def test_dropout_is_off_for_the_policy_as_trls_disable_dropout_does():
    """With LoRA dropout and attention dropout in the model, the policy's log-probabilities in train mode were
    noisy against a reference scored in eval mode; with dropout off they equal the eval-mode ones, every call."""
    from ladle.train.preference import disable_dropout, pair_logps

    model = tiny_lora_model(dropout=0.3)
    data = pair_data()
    model.eval()
    with torch.no_grad():
        reference = pair_logps(model, data, [0, 1, 2], "cpu")[0]
        model.train()
        assert not torch.equal(pair_logps(model, data, [0, 1, 2], "cpu")[0], reference)  # dropout on: noise
        said = disable_dropout(model)
        assert said == "off: 14 dropout layer(s) and 2 attention dropout rate(s) set to 0", said
        for _ in range(2):
            assert torch.equal(pair_logps(model, data, [0, 1, 2], "cpu")[0], reference)
    assert disable_dropout(model) == "off: the model has none"


def test_a_rank_without_eval_rows_counts_no_pair_of_anothers():
    """Two replicas, three held-out pairs: rank 1 holds one, and its second forward repeats a batch to keep the
    ranks in step (a sharded forward is a collective); it must count only its own pair. With one pair, rank 1 has
    none and its forward scores another rank's row: it counts nothing (that row was counted twice before)."""

    from ladle.train.preference import PairLoss
    from ladle.train.runtime.base import runtime_for

    class Rank1:
        process_index, num_processes, device = 1, 2, "cpu"

        def reduce(self, tensor, reduction):
            return tensor

    model = tiny_lora_model()
    data = pair_data()
    runtime = runtime_for("ddp")
    for rows, own in ((3, {1}), (1, set())):
        part = {k: v[:rows] for k, v in data.items()}
        loss_fn = PairLoss("simpo", 2.0, 0.0, 0.5, "auto")  # no reference needed
        runtime.evaluate(Rank1(), model, part, 1, loss_fn)
        assert set(loss_fn.stats) == own, (rows, loss_fn.stats)


def test_simpo_equals_trl_cpo_loss():
    """SimPO (reference-free): ladle's loss equals TRL's CPO trainer's ``cpo_loss`` (loss_type simpo) applied to
    per-token average log-probabilities computed one side at a time, unpacked."""
    import torch.nn.functional as F
    from trl.experimental.cpo import CPOTrainer

    from ladle.train.preference import PairLoss

    model = tiny_lora_model()
    averages = []
    with torch.no_grad():
        for prompt, chosen, rejected in PAIRS:
            sides = []
            for completion in (chosen, rejected):
                ids = torch.tensor([prompt + completion])
                logps = F.log_softmax(model(input_ids=ids).logits[0, :-1].float(), -1)
                picked = logps[torch.arange(ids.size(1) - 1), ids[0, 1:]][len(prompt) - 1 :]
                sides.append(picked.mean())
            averages.append(sides)
    averages = torch.tensor(averages)
    cpo = SimpleNamespace(
        alpha=0.0, loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1, accelerator=SimpleNamespace()
    )
    cpo.accelerator.device = "cpu"
    expected = CPOTrainer.cpo_loss(cpo, averages[:, 0], averages[:, 1])[0].mean()
    with torch.no_grad():
        total, count = PairLoss("simpo", 2.0, 0.1, 0.5, "auto")(model, pair_data(), [0, 1, 2], "cpu")
    assert float(total / count) == pytest.approx(float(expected), rel=1e-5)


def dpo_spec(strategy: str, root: Path, *overrides: str):
    from ladle.config import build_config
    from tests.helpers import train_spec

    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": "ladle://demo-preference", "seq_len": 64},
            "parallelism": {"strategy": strategy},
            "training": {
                "objective": "dpo",
                "max_steps": 3,
                "lr": 3e-3,
                "micro_batch_size": 2,
                "global_batch_size": 8,
                "lora": {"target_modules": "all-linear", "modules_to_save": ["lm_head"]},
            },
        },
        list(overrides),
    )
    return train_spec(cfg, root, strategy + "".join(overrides))


def check_against_ddp(results: dict) -> None:
    ddp = results["ddp"]
    assert ddp.train_losses[0] == pytest.approx(0.693147, abs=1e-5)  # the policy starts as the reference
    assert ddp.train_losses[-1] < ddp.train_losses[0] - 0.1
    assert ddp.preference["eval_preference_accuracy_before"] == 0.5  # every margin 0: every pair a tie
    assert ddp.preference["eval_preference_accuracy_after"] > 0.6
    for name, result in results.items():
        assert result.train_losses == pytest.approx(ddp.train_losses, rel=1e-4), name
        assert result.preference["eval_preference_accuracy_after"] == pytest.approx(
            ddp.preference["eval_preference_accuracy_after"], abs=1e-9
        )


def test_deepspeed_stages_reach_ddps_first_losses(tmp_path):
    """2 processes, LoRA with a trained head, 2 x 2 x 2 pairs per step: ZeRO-1, ZeRO-2 and ZeRO++ (its frozen ends
    kept sharded, as ZeRO-3's) reach DDP's losses and held-out accuracy."""
    results = launch_all({s: dpo_spec(s, tmp_path) for s in ("ddp", "zero1", "zero2", "zero++")})
    check_against_ddp(results)
    assert [results[s].strategy for s in ("zero1", "zero2", "zero++")] == ["zero1", "zero2", "zero++"]
    assert results["zero++"].kernels["reference"].startswith("precomputed: ")


def test_sharded_strategies_reach_ddps_first_losses_and_resume_on_another_world_size(tmp_path):
    """ZeRO-3 and FSDP2 (its head vocabulary-parallel, per token) reach DDP's losses and held-out accuracy; so does
    FSDP2 with the reference taken from the base with the adapters (and the head's trained copy) turned off.
    FSDP2's checkpoint of step 2 (2 ranks, each its shards) resumes on one process with the same global batch: the
    last step is DDP's, and the stored reference log-probabilities serve the rows the new layout reads."""
    from ladle.train.checkpoint import step_dir
    from ladle.train.preference import REFERENCE_FILE
    from ladle.train.run import launch

    specs = {s: dpo_spec(s, tmp_path) for s in ("ddp", "zero3")}
    specs["fsdp2"] = dpo_spec("fsdp2", tmp_path, "training.checkpoint_every=2")
    specs["adapters_off"] = dpo_spec("fsdp2", tmp_path, "training.preference.reference=adapters_off")
    results = launch_all(specs)
    check_against_ddp(results)
    assert results["fsdp2"].kernels["fused_loss"].startswith("vocabulary-parallel")
    assert results["zero3"].strategy == "zero3"
    assert results["adapters_off"].kernels["reference"] == "adapters_off"

    one = dpo_spec("ddp", tmp_path / "one", "parallelism.cpu_processes=1")
    source = specs["fsdp2"].run_url
    storage.upload_dir(
        step_dir(storage.join(source, "checkpoints"), 2), step_dir(storage.join(one.run_url, "checkpoints"), 2)
    )
    storage.write_bytes(
        storage.join(one.run_url, REFERENCE_FILE), storage.read_bytes(storage.join(source, REFERENCE_FILE))
    )
    resumed = launch(one)
    assert (resumed.resumed_from_step, resumed.world_size) == (2, 1)
    assert resumed.train_losses == pytest.approx(results["ddp"].train_losses, rel=1e-4)
    assert resumed.kernels["reference"] == "precomputed: read from this run's earlier attempt"


def test_full_fine_tune_under_zero3_resumes_with_its_stored_reference(tmp_path):
    """A full fine-tune (no adapters, no eval split) starts at log 2 and learns; run again at the same place, it
    resumes from its checkpoint and reads the reference stored by the first attempt instead of scoring the pairs
    again (the model it would score by then is no longer the reference)."""
    from ladle.train.preference import REFERENCE_FILE

    # no eval split: the eval before and after are an empty split's
    spec = dpo_spec(
        "zero3", tmp_path, "training.lora.enabled=false", "training.checkpoint_every=2", "data.eval_ratio=0"
    )
    first = launch_all({"full": spec})["full"]
    assert first.model_url and first.train_losses[0] == pytest.approx(0.693147, abs=1e-5)
    assert first.train_losses[-1] < first.train_losses[0]
    assert (Path(spec.run_url) / REFERENCE_FILE).is_file()
    # Run again, on for more steps: it resumes from the checkpoint at step 2, reads back the reference rows the
    # first attempt scored and scores now the rows only the later steps read (by the model as loaded, still the
    # reference: the checkpoint loads after); no NaN row reaches a step (they trained to NaN before).
    longer = spec.config.model_copy(deep=True)
    longer.training.max_steps = 6
    more = launch_all({"full": spec.model_copy(update={"config": longer})})["full"]
    assert more.resumed_from_step == 2
    assert more.train_losses[:3] == pytest.approx(first.train_losses, rel=1e-4)
    said = more.kernels["reference"]
    assert re.fullmatch(
        r"precomputed: \d+ pair rows in .* s before the first step, \d+ read from this run's earlier attempt", said
    ), said
    assert len(more.train_losses) == 6 and all(math.isfinite(loss) for loss in more.train_losses), more.train_losses
