"""KTO (``training.objective: kto``): on a fixed batch of judged answers, ladle's loss and LoRA gradients equal TRL's
``KTOTrainer`` (trl 1.16, ``loss_type="kto"``, float32, 1e-5 relative: the guide's rule for sums of a few hundred
terms), through both ways ladle computes log-probabilities; the rows come out of ``ladle data prepare`` in TRL's
shape (the KL side: the completion of the row before, TRL's rotation within a batch); a 2-process run trains."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.train.test_preference import SEQ_LEN, tiny_lora_model, trained_grads, word_tokenizer

ROWS = [  # prompt, completion token ids (EOS = 2 closes each), label
    ([1, 5, 6, 7], [8, 9, 2], True),
    ([1, 11, 12], [13, 2], False),
    ([1, 20, 21, 22, 23], [24, 25, 26, 2], True),
    ([1, 30, 31], [32, 33, 2], False),
]


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory):
    """TRL's KTOTrainer over a LoRA model; its reference is a copy of the adapter (``ref``), and the trained adapter
    is then moved away from it so the log-ratios (and the KL estimate) are not zero."""
    from datasets import Dataset
    from trl import KTOConfig, KTOTrainer

    model = tiny_lora_model()
    args = KTOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl-kto")),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=len(ROWS),
        bf16=False,
        beta=0.1,
    )
    rows = Dataset.from_list([{"prompt": "5 6 7", "completion": "8 9", "label": i % 2 == 0} for i in range(4)])
    trainer = KTOTrainer(model=model, args=args, train_dataset=rows, processing_class=word_tokenizer())
    assert "ref" in trainer.model.peft_config
    g = torch.Generator().manual_seed(1)  # a move that raises the KL sides' log-ratios: z > 0
    with torch.no_grad():
        for name, param in trainer.model.named_parameters():
            if "lora_B.default" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=g))
    return trainer


def kto_data(rows=ROWS) -> dict[str, torch.Tensor]:
    from ladle.data.packing import pack_examples
    from ladle.data.preference import pair_row

    examples = []
    for i, (prompt, completion, label) in enumerate(rows):
        example = pair_row(prompt, completion, rows[i - 1][1], SEQ_LEN, None, "right", allow_equal=True)
        example.label = int(label)
        examples.append(example)
    packed = pack_examples(examples, 2 * SEQ_LEN, 0, pack=False)
    return {
        "input_ids": torch.tensor(packed.input_ids),
        "labels": torch.tensor(packed.labels),
        "position_ids": torch.tensor(packed.position_ids),
        "real_tokens": torch.tensor(packed.real_tokens_per_row),
        "label": torch.tensor(packed.label),
    }


@pytest.mark.parametrize("fast_paths", ["plain", "fused+joined"], indirect=True)
@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.33, 0.8)], ids=["even", "weighted"])
def test_loss_and_lora_gradients_equal_trl_kto_trainer(trl_trainer, fast_paths, weights):
    from trl.trainer.kto_trainer import DataCollatorForUnpairedPreference

    from ladle.train.preference import KtoLoss, pair_logps

    trl_trainer.desirable_weight, trl_trainer.undesirable_weight = weights
    batch = DataCollatorForUnpairedPreference(pad_token_id=0)(
        [
            {"prompt_ids": p, "completion_ids": c, "KL_completion_ids": ROWS[i - 1][1], "label": label}
            for i, (p, c, label) in enumerate(ROWS)
        ]
    )
    model = trl_trainer.model
    model.zero_grad(set_to_none=True)
    expected = trl_trainer.compute_loss(model, batch)
    expected.backward()
    expected_grads = trained_grads(model)
    trl_kl = trl_trainer._metrics["train"]["kl"][-1]

    path, install = fast_paths
    install(model)
    data = kto_data()
    rows = list(range(len(ROWS)))
    model.set_adapter("ref")
    with torch.no_grad():
        data["reference"] = pair_logps(model, data, rows, "cpu")[0].double()
    model.set_adapter("default")
    model.zero_grad(set_to_none=True)
    loss = KtoLoss(0.1, "precomputed", *weights)
    total, count = loss(model, data, rows, "cpu")
    (total / count).backward()
    grads = trained_grads(model)
    assert count == len(ROWS)
    assert float(total / count) == pytest.approx(float(expected), rel=1e-5, abs=1e-7), path
    assert set(grads) == set(expected_grads) and grads
    for name, grad in grads.items():
        scale = expected_grads[name].abs().max().clamp(min=1e-12)
        assert (grad - expected_grads[name]).abs().max() / scale < 1e-5, (path, name)
    stats = loss.take_stats(SimpleNamespace(device="cpu", num_processes=1))
    assert stats["kl"] == pytest.approx(trl_kl, rel=1e-5, abs=1e-7) and stats["kl"] > 0  # the KL term is in play
    assert stats["reward_margin"] == pytest.approx(stats["rewards_chosen"] - stats["rewards_rejected"], abs=1e-9)


def test_at_the_reference_every_answer_costs_half_its_weight():
    from ladle.train.preference import KtoLoss

    data = kto_data()
    data["reference"] = torch.randn(len(ROWS), 2, dtype=torch.float64)
    loss = KtoLoss(0.1, "precomputed", 1.5, 0.5)
    assert loss.at_reference(data) == pytest.approx((1.5 * 0.5 + 0.5 * 0.5) / 2)
    assert loss.take_stats(SimpleNamespace(device="cpu", num_processes=1))["kl"] == 0.0
    # A policy that moved away on the KL sides (a negative estimate) has z = 0, as TRL clamps it.
    logps = torch.tensor([[-1.0, -5.0], [-2.0, -6.0]])
    reference = torch.tensor([[-1.5, -4.0], [-1.0, -5.0]])
    losses, rewards, kl = loss.kto_losses(logps, reference, torch.tensor([True, False]))
    assert float(kl) == 0.0 and rewards.tolist() == pytest.approx([0.05, -0.1])
    assert losses.tolist() == pytest.approx(
        [1.5 * (1 - torch.sigmoid(torch.tensor(0.05)).item()), 0.5 * (1 - torch.sigmoid(torch.tensor(0.1)).item())]
    )


def test_prepare_writes_trls_unpaired_rows_with_the_kl_side_and_refuses_other_shapes(tiny_model, tokenizer, tmp_path):
    """TRL's KTO shape (and what ``ladle data from-traffic`` writes: prompt and completion as turns) prepares into
    two-sided rows: the answer, then the completion of the row before after this row's prompt; the label in its own
    column; only desirable answers become the held-out reference conversations."""
    from ladle.config import build_config
    from ladle.data.packing import read_rows
    from ladle.data.prepare import prepare
    from ladle.errors import LadleError
    from ladle.platform import storage

    answers = ["red", "blue", "green", "black", "white", "yellow"]
    rows = [
        {
            "prompt": [{"role": "user", "content": f"Name colour {i}."}],
            "completion": [{"role": "assistant", "content": answer}],
            "label": i % 3 != 0,
        }
        for i, answer in enumerate(answers)
    ]
    rows.append({"prompt": "Name colour 9.", "completion": "purple", "label": "yes"})  # a bad label: dropped
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": str(path), "eval_ratio": 0.0, "seq_len": 32, "max_bad_fraction": 0.5},
            "training": {"objective": "kto"},
            "output": str(tmp_path / "out"),
        },
        [],
    )
    prepared = prepare(cfg.data, tiny_model, str(tmp_path / "out"), objective="kto")
    assert prepared.report.format == "kto" and prepared.report.rows_used == 6
    assert prepared.report.dropped[0]["reason"].startswith("label = 'yes'")
    table = read_rows(storage.read_bytes(storage.join(prepared.url, prepared.shards["train"][0])))
    assert table["label"] == [int(r["label"]) for r in rows[:6]]
    for i, (labels, positions) in enumerate(zip(table["labels"], table["position_ids"], strict=True)):
        second = [j for j in range(1, len(positions)) if positions[j] == 0][0]
        answer = tokenizer.decode([t for t in labels[:second] if t != -100])
        kl_side = tokenizer.decode([t for t in labels[second:] if t != -100])
        assert answer.startswith(answers[i]) and kl_side.startswith(answers[i - 1]), (answer, kl_side)

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    with pytest.raises(LadleError, match="training.objective = kto needs unpaired preferences"):
        prepare(cfg.data.model_copy(update={"path": str(pairs)}), tiny_model, str(tmp_path), objective="kto")


def kto_spec(strategy: str, root, data: str, *overrides: str):
    from ladle.config import build_config
    from tests.helpers import train_spec

    cfg = build_config(
        {
            "base": "ladle://tiny-llama",
            "data": {"path": data, "seq_len": 64},
            "parallelism": {"strategy": strategy},
            "training": {
                "objective": "kto",
                "max_steps": 3,
                "lr": 3e-3,
                "micro_batch_size": 2,
                "global_batch_size": 8,
                "lora": {"target_modules": "all-linear", "modules_to_save": ["lm_head"]},
            },
        },
        list(overrides),
    )
    return train_spec(cfg, root, strategy)


def test_two_processes_learn_under_ddp_and_fsdp2_alike(tmp_path):
    """The demo's preference pairs as users' thumbs (each chosen answer up, each rejected down) on 2 processes: the
    first loss is the reference's (every answer half its weight), the loss falls, the held-out rewards part the
    desirable from the undesirable answers, and FSDP2 (its head vocabulary-parallel) reaches DDP's losses."""
    from ladle.assets.demo import demo_rows, preference_rows
    from tests.helpers import launch_all

    rows = []
    for pair in preference_rows(demo_rows(200)):
        prompt = [{"role": "user", "content": pair["prompt"]}]
        rows.append({"prompt": prompt, "completion": pair["chosen"], "label": True})
        rows.append({"prompt": prompt, "completion": pair["rejected"], "label": False})
    data = tmp_path / "thumbs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = launch_all({s: kto_spec(s, tmp_path, str(data)) for s in ("ddp", "fsdp2")})
    ddp = results["ddp"]
    assert ddp.train_losses[0] == pytest.approx(0.5, abs=1e-5)
    assert ddp.train_losses[-1] < ddp.train_losses[0] - 0.01, ddp.train_losses
    after = ddp.preference
    assert after["eval_rewards_chosen_after"] > after["eval_rewards_rejected_after"], after
    assert ddp.kernels["reference"].startswith("precomputed")
    assert results["fsdp2"].train_losses == pytest.approx(ddp.train_losses, rel=1e-4)
    assert results["fsdp2"].kernels["fused_loss"].startswith("vocabulary-parallel")
