"""The whole flow, for real, through the CLI: probe -> plan -> prepare -> train (2 gloo processes) -> merge -> evaluate -> deploy.

The same flow with every artifact on S3 runs through a deployment and a worker (test_deployment.py)."""

from __future__ import annotations

import json

import httpx
import pytest

from ladle.platform import storage
from ladle.train.checkpoint import complete_steps
from tests.helpers import ROOT, run_cli
from tests.pipeline import checks

pytestmark = pytest.mark.pipeline
STEPS = 200  # the demo as `make demo` runs it: its accuracy target needs every step
SHORT = 24  # the same command for fewer steps: every stage, artifact and record, in a fraction of the time
RECIPE = str(ROOT / "recipes" / "tiny-cpu.yaml")


def demo_command(out, *sets: str):
    """`make demo`'s command through the CLI, its output in ``out`` (``done.output``), with ``--set`` ``sets``."""
    done = run_cli("run", RECIPE, "--json", "--set", f"output={out}", *(arg for s in sets for arg in ("--set", s)))
    done.output = out
    return done


@pytest.fixture(scope="module")
def local_run(tmp_path_factory, tiny_model):
    """`make demo`'s run (the recipe as shipped); read by the slow tests below."""
    return demo_command(tmp_path_factory.mktemp("e2e-local"))


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, tiny_model):
    """`make demo`'s command for SHORT steps (a checkpoint every SHORT / 2); read by every test of the pipeline's
    stages below."""
    steps = (f"training.max_steps={SHORT}", f"training.checkpoint_every={SHORT // 2}")
    return demo_command(tmp_path_factory.mktemp("e2e-short"), *steps)


# slow: the whole pipeline through the CLI is proven in make test by the short run's tests below (every stage,
# artifact and record) and the lifecycle's (tests/pipeline/test_deployment.py); this adds the demo's scale, 200
# steps to exact answers on held-out prompts.
@pytest.mark.slow
def test_demo_visibly_learns(local_run):
    """Held-out prompts (never trained on): the base answers none, the fine-tune nearly all, the smoke answer is right."""
    summary = json.loads(local_run.stdout.strip().splitlines()[-1])
    checks.check_summary(summary, STEPS)
    assert summary["eval_accuracy_before"] == 0.0
    assert summary["eval_accuracy_after"] >= 0.9, summary
    assert summary["answer_correct"] is True and summary["answer"] == summary["expected"]
    assert summary["prefect_api_startup_s"] > 0  # ladle started (and owned) the temporary API server


def test_cli_run_succeeds_with_json_last_line(short_run):
    assert short_run.returncode == 0, short_run.stderr[-4000:]
    summary = json.loads(short_run.stdout.strip().splitlines()[-1])
    checks.check_summary(summary, SHORT)
    assert summary["prefect_api_startup_s"] > 0  # ladle started (and owned) the temporary API server
    assert "Traceback" not in short_run.stdout + short_run.stderr


def test_cli_run_warns_about_cpu_host(short_run):
    assert "--gpus auto found no GPU" in short_run.stderr


def test_progress_relayed_to_prefect_log(short_run):
    assert f"step {SHORT}/{SHORT} loss" in short_run.stderr
    assert "launch: python -m ladle.train.launch --multi_gpu --num_processes 2" in short_run.stderr


def test_served_answer_is_offline_greedy(short_run):
    summary = json.loads(short_run.stdout.strip().splitlines()[-1])
    checks.check_served_answer_is_offline_greedy(summary, max_new_tokens=16)


def test_merged_equals_base_plus_adapter(short_run, tiny_model):
    checks.check_merged_equals_base_plus_adapter(json.loads(short_run.stdout.strip().splitlines()[-1]), tiny_model)


def test_mlflow_run_has_params_metrics_artifacts_and_model_version(short_run):
    checks.check_mlflow(json.loads(short_run.stdout.strip().splitlines()[-1]), SHORT, "tiny-cpu")


def test_checkpoints_are_complete(short_run):
    summary = json.loads(short_run.stdout.strip().splitlines()[-1])
    assert complete_steps(storage.join(summary["output_url"], "checkpoints")) == [SHORT // 2, SHORT]


# slow: DPO is proven in make test by tests/train/test_preference.py (TRL parity, 2-process strategies, resume) and
# unmerged serving by tests/serve/test_adapters.py; this adds the whole pipeline from the demo's champion.
@pytest.mark.slow
def test_preference_tuning_starts_from_the_champion_and_is_served_as_an_adapter_of_it(local_run, tmp_path, monkeypatch):
    """The shipped DPO recipe after the demo, in the demo's output (its registry), registering its adapter unmerged
    (``promote.merge=false``): the base is the demo's champion (``models:/tiny-cpu@champion``), the run records
    which version, logs the pair metrics per step, is gated on held-out preference accuracy against that champion
    and on parity (the adapter served on its base computes what training did). ``ladle model serve`` then puts it
    on a server of that base behind a front, says so in its JSON, and ``ladle model list`` shows which server holds
    which version."""
    from mlflow.tracking import MlflowClient

    from ladle.fleet.adapters import holders
    from ladle.fleet.champion import stop as stop_served
    from ladle.platform.processes import free_port

    recipe = str(ROOT / "recipes" / "tiny-dpo-cpu.yaml")
    sets = ["--set", f"output={local_run.output}", "--set", "promote.merge=false"]
    done = run_cli("run", recipe, "--json", *sets, "--set", "training.max_steps=12")  # 12 of its 20 steps
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert "promoted: preference_accuracy" in summary["promotion"], summary["promotion"]
    assert summary["promotion"].startswith("promoted")
    assert summary["served_unmerged"] is True and summary["parity"]["ok"] is True, summary["parity"]
    client = MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["config.base"] == "models:/tiny-cpu@champion"
    for name in ("rewards_chosen", "rewards_rejected", "reward_margin", "preference_accuracy"):
        assert len(client.get_metric_history(run.info.run_id, name)) == 12, name
    assert run.data.metrics["eval_preference_accuracy"] > 0.5
    (version,) = [v for v in client.search_model_versions("name='tiny-dpo-cpu'") if v.run_id == run.info.run_id]
    assert version.tags["ladle.base_version"] == "tiny-cpu v1"
    assert version.tags["ladle.kind"] == "adapter" and version.source.endswith("/adapter")
    assert client.get_model_version_by_alias("tiny-dpo-cpu", "champion").version == version.version

    home = {"LADLE_HOME": str(tmp_path / "home")}
    serve = [*sets, "--set", f"serve.front_port={free_port()}"]
    served = run_cli("model", "serve", recipe, "--json", *serve, env=home)
    assert served.returncode == 0, served.stderr[-4000:]
    where = json.loads(served.stdout.strip().splitlines()[-1])
    try:
        assert where["action"] == "started" and where["base"].startswith("base-")
        assert where["adapters"] == [
            {"name": "tiny-dpo-cpu", "versions": {str(version.version): ["challenger", "champion"]}}
        ]
        body = {"model": "tiny-dpo-cpu", "messages": [{"role": "user", "content": summary["prompt"]}], "max_tokens": 16}
        answer = httpx.post(f"{where['front_url']}/v1/chat/completions", json={**body, "temperature": 0}, timeout=60)
        assert answer.json()["choices"][0]["message"]["content"] == summary["answer"]
        monkeypatch.setenv("LADLE_HOME", home["LADLE_HOME"])  # what `ladle model list` and `stop` read, here
        held = holders()["tiny-dpo-cpu"]  # `ladle model list`'s served_on
        assert held["base"] == where["base"] and held["versions"] == {str(version.version): ["challenger", "champion"]}
    finally:
        monkeypatch.setenv("LADLE_HOME", home["LADLE_HOME"])
        assert stop_served(where["base"])["server_pid"] == where["server_pid"]  # `ladle model stop BASE`


# slow: GRPO is proven in make test by tests/train/test_grpo.py (TRL parity, engine rollouts on 1 and 2 ranks,
# resume, the probe's guard); this adds the whole pipeline from the demo's champion.
@pytest.mark.slow
def test_grpo_starts_from_the_champion_learns_what_it_could_not_and_is_promoted(local_run):
    """The shipped GRPO recipe after the demo (16 of its 60 steps): rollouts by ladle's engine inside the training
    processes, scored by a reward written as TRL calls one and by exact match; the held-out prompts' mean reward
    (lists longer than the supervised data showed) rises, gates promotion against the demo's champion, and every
    step's rewards, KL-free loss parts and the sampler-trainer gap are in MLflow."""
    from mlflow.tracking import MlflowClient

    recipe = str(ROOT / "recipes" / "tiny-grpo-cpu.yaml")
    done = run_cli("run", recipe, "--json", "--set", f"output={local_run.output}", "--set", "training.max_steps=16")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    before, after = summary["eval_before"]["reward"], summary["eval_after"]["reward"]
    assert after > before + 0.2, (before, after)
    assert summary["promotion"].startswith("promoted: reward"), summary["promotion"]
    client = MlflowClient(summary["mlflow_tracking_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.data.params["config.base"] == "models:/tiny-cpu@champion"
    history = {
        name: [m.value for m in client.get_metric_history(run.info.run_id, name)]
        for name in ("reward/items_in_place/mean", "reward/exact_match/mean", "rollout_logprob_gap", "clip_ratio")
    }
    assert all(len(values) == 16 for values in history.values()), {k: len(v) for k, v in history.items()}
    assert max(history["rollout_logprob_gap"]) < 1e-4
    (version,) = [v for v in client.search_model_versions("name='tiny-grpo-cpu'") if v.run_id == run.info.run_id]
    assert version.tags["ladle.base_version"] == "tiny-cpu v1"


# slow: make test proves each link apart: the capture and feedback through a real server and front
# (tests/serve/test_capture.py), the curation into rows and their preparation beside the recipe's data
# (tests/data/test_traffic.py); this runs the loop whole, from the demo's served champion. Last in the file: its run
# registers a tiny-cpu version, which the tests above read as the champion.
@pytest.mark.slow
def test_the_served_champions_traffic_and_corrections_become_the_next_runs_data(local_run, tmp_path, monkeypatch):
    """The flywheel on the demo: its champion served with capture on, users (the OpenAI SDK) ask a task it never
    learned and send corrections through the front; a run with ``retrain.from_traffic`` learns from them (the data
    report's traffic source), and its MLflow run and registered version keep the traffic's window and counts; a
    scheduled run with more ``retrain.min_new_feedback`` than the traffic gives skips, saying how many it has."""
    import openai
    from mlflow.tracking import MlflowClient

    from ladle.fleet.champion import stop as stop_served
    from ladle.platform.processes import free_port

    out = local_run.output
    home = {"LADLE_HOME": str(tmp_path / "home")}
    capture = ["--set", "serve.capture.enabled=true", "--set", "serve.capture.flush_s=0.2"]
    serve = ["--set", f"output={out}", *capture, "--set", f"serve.front_port={free_port()}"]
    served = run_cli("model", "serve", RECIPE, "--json", *serve, env=home)
    assert served.returncode == 0, served.stderr[-4000:]
    where = json.loads(served.stdout.strip().splitlines()[-1])
    try:
        client = openai.OpenAI(base_url=f"{where['front_url']}/v1", api_key="none", timeout=60, max_retries=0)
        lists = ["red blue", "green yellow black", "purple orange", "white red green", "black blue", "yellow white"]
        for colours in lists:
            asked = [{"role": "user", "content": f"What is the first colour?\n{colours}"}]
            answer = client.chat.completions.create(model="tiny-cpu", messages=asked, max_tokens=16, temperature=0)
            said = {"response_id": answer.id, "value": False, "correction": colours.split()[0]}
            kept = httpx.post(f"{where['front_url']}/v1/feedback", json=said, timeout=30)
            assert kept.status_code == 200, kept.text
    finally:
        monkeypatch.setenv("LADLE_HOME", home["LADLE_HOME"])
        stop_served("tiny-cpu")  # the server writes what waits as it stops

    learn = ["--set", f"output={out}", "--set", "retrain.from_traffic=true", "--set", "training.max_steps=40"]
    shadow = ["--set", "promote.shadow.requests=6"]  # the champion's six answers, replayed to the challenger
    done = run_cli("run", RECIPE, "--json", *learn, *shadow, "--set", "training.checkpoint_every=40")
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    said = [line for line in done.stderr.splitlines() if "traffic: " in line]
    assert any("traffic: 6 requests (6 with feedback) -> 6 sft rows" in line for line in said), said
    assert summary["shadow"]["requests"] == 6 and summary["shadow"]["scored"] == 6, summary["shadow"]
    assert summary["shadow"]["reason"] in done.stderr  # the deploy stage's log says what the replay found
    if summary["shadow"]["regressed"]:
        assert summary["promotion"].startswith("not promoted: shadow: regressed"), summary["promotion"]
    mlflow = MlflowClient(summary["mlflow_tracking_uri"])
    run = mlflow.get_run(summary["mlflow_run_id"])
    assert run.data.tags["ladle.traffic.requests"] == "6" and run.data.tags["ladle.traffic.with_feedback"] == "6"
    assert "sft=6" in run.data.tags["ladle.traffic.rows"]
    assert json.loads(run.data.params["config.data.sources"])[1]["name"] == "traffic-sft"
    with open(mlflow.download_artifacts(run.info.run_id, "data_report.json", str(tmp_path))) as handle:
        mix = {m["name"]: m for m in json.load(handle)["mix"]}
    assert mix["traffic-sft"]["training_records"] + mix["traffic-sft"]["held_out"] == 6
    (version,) = [v for v in mlflow.search_model_versions("name='tiny-cpu'") if v.run_id == run.info.run_id]
    assert version.tags["ladle.traffic.last_at"] == run.data.tags["ladle.traffic.last_at"]
    assert json.loads(version.tags["ladle.shadow"])["requests"] == 6
    with open(mlflow.download_artifacts(run.info.run_id, "shadow/report.json", str(tmp_path))) as handle:
        assert len(json.load(handle)["worst"]) == min(5, summary["shadow"]["losses"])

    skip = [*learn, "--set", "retrain.min_new_feedback=1000", "--skip-if-data-unchanged"]
    again = run_cli("run", RECIPE, "--json", *skip)
    assert again.returncode == 0, again.stderr[-4000:]
    skipped = json.loads(again.stdout.strip().splitlines()[-1])
    assert skipped["status"] == "skipped", skipped
    assert "new sft rows from traffic since champion v" in skipped["reason"]
    assert "retrain.min_new_feedback = 1000" in skipped["reason"]
