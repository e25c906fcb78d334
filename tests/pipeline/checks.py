"""Checks shared by the end-to-end tests: what a finished run must have produced."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ladle.platform import storage
from tests.helpers import offline_greedy


def local_copy(url: str) -> Path:
    if storage.is_local(url):
        return Path(url)
    return storage.download_dir(url, Path(tempfile.mkdtemp(prefix="ladle-check-")))


def check_summary(summary: dict, steps: int) -> None:
    assert summary["status"] == "ok"
    assert (summary["strategy"], summary["world_size"], summary["backend"]) == ("ddp", 2, "gloo")
    assert summary["steps"] == steps
    assert summary["eval_loss_after"] < summary["eval_loss_before"]
    assert summary["train_loss_last"] < summary["train_loss_first"]
    assert summary["endpoint"].startswith("http://127.0.0.1:")
    for key in ("answer", "mlflow_run_id", "flow_run_id", "output_url", "train_loss_first", "eval_loss_before"):
        assert key in summary
    # Accuracy on held-out prompts: the random-init base answers none; the smoke request asks one of them.
    assert summary["eval_examples"] > 0 and summary["eval_accuracy_before"] == 0.0
    assert 0.0 <= summary["eval_accuracy_after"] <= 1.0
    assert summary["expected"] is not None
    assert summary["answer_correct"] == (summary["answer"].strip() == summary["expected"].strip())
    # The served model is the trained one: its held-out log-probabilities equal the training process's forward.
    found = summary["parity"]
    assert found["ok"] is True and found["reference"] == "training process", found
    assert found["answer_tokens"] > 0 and found["max_abs"] <= 1e-4, found


def check_served_answer_is_offline_greedy(summary: dict, max_new_tokens: int) -> None:
    merged = local_copy(summary["merged_model_url"])
    expected = offline_greedy(merged, [{"role": "user", "content": summary["prompt"]}], max_new_tokens)
    assert summary["answer"] == expected


def check_merged_equals_base_plus_adapter(summary: dict, base_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = local_copy(storage.join(summary["output_url"], "adapter"))
    merged = local_copy(summary["merged_model_url"])
    ids = torch.tensor([[1, 4, 50, 60, 70, 2, 5, 80]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        expected = PeftModel.from_pretrained(base, adapter).eval()(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)


def check_mlflow(summary: dict, steps: int, model_name: str, world_size: int = 2) -> None:
    """The MLflow run of a finished pipeline: its params, metrics and artifacts, and the registered version.
    ``world_size``: the processes the run trained on (2 gloo processes on a CPU host; 1 on one GPU)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.flow_run_id"] == summary["flow_run_id"]
    assert run.data.params["plan.strategy"] == "ddp"
    assert summary["world_size"] == world_size and run.data.params["plan.world_size"] == str(world_size)
    assert "config.training.lr" in run.data.params
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in losses] == list(range(1, steps + 1))
    assert abs(losses[0].value - summary["train_loss_first"]) < 1e-6
    evals = client.get_metric_history(run.info.run_id, "eval_loss")
    assert [m.step for m in evals] == [0, steps]
    assert run.data.metrics["eval_accuracy_after"] == summary["eval_accuracy_after"]
    assert run.data.metrics["eval_accuracy_before"] == summary["eval_accuracy_before"]
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {
        "config.yaml",
        "plan.json",
        "data_report.json",
        "loss_curve.png",
        "length_histogram.png",
        "evaluation.json",
    } <= artifacts
    versions = client.search_model_versions(f"name='{model_name}'")
    mine = [v for v in versions if v.run_id == run.info.run_id]
    assert len(mine) == 1 and mine[0].source == summary["merged_model_url"]
