"""lm-evaluation-harness, a client this project did not write, scores the served model: its ``local-completions``
model (token ids as the prompt, ``echo`` with ``logprobs``, as it sends them) on a small multiple-choice task
shipped with the tests gives the accuracy, and each answer's log-likelihood, that lm-eval's own ``hf`` model
computes on the same weights."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).with_name("data") / "colours_mc.jsonl"
TASK = """task: ladle_colours
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    (folder / "ladle_colours.yaml").write_text(TASK.format(data=DATA), encoding="utf-8")
    return TaskManager(include_path=str(folder))


def evaluate(model: str, model_args: dict, tasks) -> tuple[dict, list[dict]]:
    import lm_eval

    out = lm_eval.simple_evaluate(
        model=model, model_args=model_args, tasks=["ladle_colours"], task_manager=tasks, log_samples=True
    )
    return out["results"]["ladle_colours"], out["samples"]["ladle_colours"]


def test_local_completions_against_the_server_equals_lm_evals_hf_model(server, tiny_model, tasks, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    served, served_samples = evaluate(
        "local-completions",
        {
            "base_url": f"{server.url}/v1/completions",
            "model": "tiny",
            "tokenizer_backend": "huggingface",
            "tokenizer": str(tiny_model),
            "num_concurrent": 4,
            "max_retries": 1,
        },
        tasks,
    )
    local, local_samples = evaluate("hf", {"pretrained": str(tiny_model), "dtype": "float32", "device": "cpu"}, tasks)
    assert len(served_samples) == len(local_samples) == 16
    assert served["acc,none"] == local["acc,none"] and served["acc_norm,none"] == local["acc_norm,none"]
    by_doc = {s["doc_id"]: s for s in local_samples}
    for sample in served_samples:
        theirs = by_doc[sample["doc_id"]]
        served_ll = [float(r[0]) for r in sample["filtered_resps"]]
        local_ll = [float(r[0]) for r in theirs["filtered_resps"]]
        assert served_ll == pytest.approx(local_ll, abs=1e-4)  # every choice's log-likelihood, not only the pick
