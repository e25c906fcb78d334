"""The model lifecycle through real components, driven only by `prefect deployment run` and the `ladle` CLI.

prefect server start + a process worker, an `mlflow server` on SQLite, a moto S3 server holding every
artifact (its credentials in an ArtifactStore block), MLflow credentials in the worker's environment:

1. run 1 trains and becomes champion; the promotion event triggers the serving deployment, which serves it
   behind ladle's front;
2. run 2 on deliberately worse data is evaluated and not promoted: champion and served version unchanged;
3. run 3 on better data (under a given run_id) is promoted, and the front swaps to it while clients send
   requests (zero failures);
4. `ladle model rollback` puts run 1's version back in service;
5. the nightly deployment with unchanged data, base and settings ends "skipped" without training;
6. the deployment's parameter schema is typed, and no secret appears in any log, parameter, MLflow
   param/tag/artifact, Prefect artifact or stored file;
7. `ladle model canary` gives run 3's version a canary: its event runs the serving deployment, which splits
   live traffic, and the front's verdict makes it champion, with no request failing.

Each step is a test of its own (``test_lifecycle_N_...``, run in that order), sharing one server, worker and
store through the ``lifecycle`` fixture, so that no single test holds the whole scenario's time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from ladle.fleet import champion
from ladle.fleet import front as router
from ladle.platform import storage
from ladle.platform.processes import stop_process
from ladle.serve import records
from ladle.train.run import free_port
from tests.helpers import (
    ROOT,
    Traffic,
    assert_clean_error,
    deployments_file,
    fresh_registry,
    run_cli,
    start_service,
    wait_for_requests,
)
from tests.pipeline import checks

pytestmark = pytest.mark.pipeline
PREFECT = str(Path(sys.executable).with_name("prefect"))
TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def prefect(*args: str, env: dict, timeout: int = 180) -> subprocess.CompletedProcess:
    done = subprocess.run([PREFECT, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    assert done.returncode == 0, f"prefect {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    home = tmp_path_factory.mktemp("prefect-server")
    port = free_port()
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": f"http://127.0.0.1:{port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "LADLE_REPO": str(ROOT),
        # A serving run that finds the `champion` deployment's one slot taken (its concurrency_limit: swaps one
        # after another) is rescheduled this many seconds later; Prefect's default is 30 s, which made a canary
        # queued behind the previous swap take 52 s instead of 22 s here. Queuing itself is unchanged.
        "PREFECT_SERVER_DEPLOYMENTS_CONCURRENCY_SLOT_WAIT_SECONDS": "3",
    }
    argv = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    server = start_service(argv, f"http://127.0.0.1:{port}/api/health", home, env)
    yield env
    stop_process(server, group=True)


SECRET_S3 = "s3-secret-9f1c2b7e4d"  # the artifact store's secret key, saved in a Prefect block
SECRET_MLFLOW = "mlflow-pass-5a8e3c1f0b"  # the MLflow password, in the worker's environment
MODEL = "tiny-cpu"  # the registered model of the tiny-cpu recipe
# The serving deployment runs canaries (step 6): short, on half the traffic. Its latency limit is loose because
# both servers share this machine's cores (tests/fleet/test_canary.py proves the latency rollback).
FEEDBACK_THRESHOLD = 3  # the feedback trigger's (20 as shipped), for step 8
CANARY = [
    "promote.canary.duration_s=6",
    "promote.canary.weight=0.5",
    "promote.canary.min_requests=3",
    "promote.canary.max_latency_ratio=20",
]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`mlflow server` on SQLite, serving artifacts itself; yields its URL."""
    home = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    argv = [str(Path(sys.executable).with_name("mlflow")), "server", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--backend-store-uri", fresh_registry(home), "--artifacts-destination", str(home / "art")]
    url = f"http://127.0.0.1:{port}"
    # MLflow's job runner (huey consumers for its GenAI jobs) polls all along and ladle uses none of its jobs:
    # off, it saves ~25 CPU-s of this module's ~3 minutes.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = start_service([*argv, "--workers", "1"], f"{url}/health", home, env=env)
    yield url
    stop_process(proc, group=True)


def scenario_data(folder: Path, demo: Path) -> dict[str, str]:
    """A fixed held-out file, a small clean training file, the same rows with wrong answers, and more clean rows."""
    rows = [json.loads(line) for line in demo.read_text().splitlines() if line.strip()]
    held_out, train = rows[:150], rows[150:]
    small = train[: len(train) // 4]
    answers = [r["output"] for r in small]
    files = {
        "eval": held_out,
        "small": small,
        "worse": [{**r, "output": a} for r, a in zip(small, answers[1:] + answers[:1], strict=True)],
        "better": train,
    }
    paths = {}
    for name, lines in files.items():
        paths[name] = str(folder / f"{name}.jsonl")
        Path(paths[name]).write_text("".join(json.dumps(r) + "\n" for r in lines))
    return paths


def api(env: dict, method: str, path: str, **body):
    answer = httpx.request(method, f"{env['PREFECT_API_URL']}{path}", json=body or None, timeout=30)
    answer.raise_for_status()
    return answer.json()


def run_deployment(env: dict, name: str, params: dict) -> str:
    started = prefect("deployment", "run", name, "--params", json.dumps(params), env=env)
    return next(line.split()[-1] for line in started.stdout.splitlines() if "UUID" in line)


def wait_run(env: dict, flow_run_id: str, timeout: float = 420) -> dict:
    deadline = time.monotonic() + timeout
    while (run := api(env, "GET", f"/flow_runs/{flow_run_id}"))["state"]["type"] not in TERMINAL:
        assert time.monotonic() < deadline, f"flow run {flow_run_id} still {run['state']['type']}"
        time.sleep(1)
    return run


def runs_of(env: dict, deployment: str) -> list[dict]:
    found = api(env, "GET", f"/deployments/name/{deployment}")
    return api(env, "POST", "/flow_runs/filter", flow_runs={"deployment_id": {"any_": [found["id"]]}})


def wait_served(front: str, version: str, timeout: float = 240) -> None:
    """Until the front answers with ``version`` behind it."""
    deadline, seen = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        try:
            seen = httpx.get(f"{front}/ready", timeout=2).json().get("version")
            if seen == version:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    pytest.fail(f"the front never served v{version} (last seen: {seen})")


def all_pages(env: dict, path: str) -> list[dict]:
    out, offset = [], 0
    while page := api(env, "POST", path, limit=200, offset=offset):
        out += page
        offset += len(page)
    return out


@pytest.fixture(scope="module")
def lifecycle(prefect_server, mlflow_server, s3_server, tmp_path_factory, demo_data):
    """One Prefect server, worker, MLflow server and S3 store for the lifecycle's steps, which run in order:
    each test below is one step, and reads what the steps before it left (``state``)."""
    tmp = tmp_path_factory.mktemp("lifecycle")
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_server.items():
            patch.setenv(key, value)  # this process reads results back from S3 too
        data = scenario_data(tmp, demo_data)
        front_port = free_port()
        tracking = mlflow_server.replace("http://", f"http://ladle:{SECRET_MLFLOW}@")
        # The worker holds no S3 credentials of its own: the block supplies them to each run.
        env = {k: v for k, v in prefect_server.items() if not k.startswith("AWS_")}
        env.update(MLFLOW_TRACKING_URI=tracking, PREFECT_WORKER_QUERY_SECONDS="1")
        prefect("work-pool", "create", "ladle-local", "--type", "process", env=env)
        prefect(
            "--no-prompt",
            "deploy",
            "--all",
            "--prefect-file",
            str(
                deployments_file(
                    tmp, FEEDBACK_THRESHOLD, front_port=front_port, artifact_store="lifecycle-store", overrides=CANARY
                )
            ),
            env=env,
        )
        store = (
            "from pydantic import SecretStr; from ladle.blocks import ArtifactStore; "
            f"ArtifactStore(url='s3://ladle/lifecycle', endpoint_url='{s3_server['AWS_ENDPOINT_URL']}', "
            f"access_key_id=SecretStr('testing'), secret_access_key=SecretStr('{SECRET_S3}'), "
            "region='us-east-1').save('lifecycle-store', overwrite=True)"
        )
        subprocess.run([sys.executable, "-c", store], env=env, check=True, cwd=ROOT, timeout=120)
        common = {
            "promote_metric": "loss",
            "artifact_store": "lifecycle-store",
            "overrides": [f"data.eval_path={data['eval']}", "eval.max_examples=8", "serve.max_new_tokens=8"],
        }
        with open(tmp / "worker.log", "w") as worker_log:
            worker = subprocess.Popen(
                [PREFECT, "worker", "start", "--pool", "ladle-local"],
                env=env,
                cwd=ROOT,
                stdout=worker_log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its flow-run processes stop with it
            )
        try:
            yield SimpleNamespace(
                env=env,
                front=f"http://127.0.0.1:{front_port}",
                tracking=tracking,
                mlflow=mlflow_server,
                data=data,
                common=common,
                # One process after the first run: the lifecycle is the subject.
                one={**common, "overrides": [*common["overrides"], "parallelism.cpu_processes=1"]},
                tmp=tmp,
                worker_log=tmp / "worker.log",
                state={},
            )
        finally:
            stop_process(worker, group=True)
            run_cli("model", "stop", MODEL, env=env)


def test_lifecycle_1_the_first_model_becomes_champion_and_is_served(lifecycle):
    """Run 1 (2 gloo processes) is promoted; its promotion event makes the serving deployment serve it."""
    lc = lifecycle
    params = {**lc.common, "data_path": lc.data["small"], "max_steps": 12}
    first = wait_run(lc.env, run_deployment(lc.env, "finetune-recipe/tiny-cpu", params))
    assert first["state"]["type"] == "COMPLETED", lc.worker_log.read_text()[-4000:]
    assert first["state"]["message"].startswith("promoted: loss"), first["state"]["message"]
    wait_served(lc.front, "1")
    fs, _ = storage.filesystem("s3://ladle")
    (only,) = fs.glob("ladle/lifecycle/runs/tiny-cpu-*/summary.json")  # the pipeline runs as a subflow
    summary = storage.read_json("s3://" + only)
    checks.check_summary(summary, 12)
    checks.check_mlflow(summary, 12, MODEL)
    assert summary["promoted"] is True and summary["registered_model"] == MODEL
    lc.state["first"] = True


def test_lifecycle_2_worse_data_is_not_promoted_and_the_champion_keeps_serving(lifecycle):
    """Run 2 on deliberately worse data, while clients use the champion: evaluated, not promoted; champion,
    served version and serving deployment untouched."""
    lc = lifecycle
    assert lc.state.get("first"), "step 1 did not complete"
    swaps_before = len(runs_of(lc.env, "serve-champion/champion"))
    params = {**lc.one, "data_path": lc.data["worse"], "max_steps": 12}
    with Traffic(lc.front, MODEL, clients=2, pause_s=0.25) as traffic:  # steady, leaving the cores to training
        worse = wait_run(lc.env, run_deployment(lc.env, "finetune-recipe/tiny-cpu", params))
        wait_for_requests(traffic, 6)
    assert worse["state"]["type"] == "COMPLETED", lc.worker_log.read_text()[-4000:]
    assert worse["state"]["message"].startswith("not promoted: loss"), worse["state"]["message"]
    assert traffic.failures() == [] and {r[1] for r in traffic.results} == {"1"}
    assert len(runs_of(lc.env, "serve-champion/champion")) == swaps_before
    listed = run_cli("model", "list", MODEL, "--tracking-uri", lc.tracking, "--json", env=lc.env)
    models = json.loads(listed.stdout.splitlines()[-1])
    assert {v["version"]: v["aliases"] for v in models["versions"]} == {"2": ["challenger"], "1": ["champion"]}
    assert models["versions"][0]["promotion"].startswith("not promoted")
    lc.state["swaps_before"] = swaps_before


def test_lifecycle_3_better_data_swaps_in_under_traffic_and_a_rollback_swaps_back(lifecycle):
    """Run 3 on better data (under its own run_id) is promoted and the front swaps to it while clients send
    requests; `ladle model rollback` brings run 1's version back; no request fails. The nightly deployment is
    submitted meanwhile (step 4 reads it)."""
    lc = lifecycle
    swaps_before = lc.state["swaps_before"]
    with Traffic(lc.front, MODEL, clients=2, pause_s=0.25) as traffic:
        wait_for_requests(traffic, 6)
        better = {**lc.one, "data_path": lc.data["better"], "max_steps": 16, "run_id": "better"}
        promoted = wait_run(lc.env, run_deployment(lc.env, "finetune-recipe/tiny-cpu", better))
        assert promoted["state"]["type"] == "COMPLETED", lc.worker_log.read_text()[-4000:]
        assert promoted["state"]["message"].startswith("promoted: loss"), promoted["state"]["message"]
        summary3 = storage.read_json("s3://ladle/lifecycle/runs/better/summary.json")  # the run_id's folder
        assert summary3["run_id"] == "better" and summary3["steps"] == 16
        wait_served(lc.front, "3")
        t_swap = time.monotonic()
        wait_for_requests(traffic, 6)

        rolled = run_cli("model", "rollback", MODEL, "--tracking-uri", lc.tracking, "--json", env=lc.env)
        assert json.loads(rolled.stdout.splitlines()[-1])["to"] == "1", rolled.stderr
        # Same data, base and training settings as v1 (max_steps 12): nothing to retrain.
        nightly = {**lc.common, "data_path": lc.data["small"], "max_steps": 12}
        lc.state["nightly_id"] = run_deployment(lc.env, "finetune-recipe/tiny-cpu-nightly", nightly)
        wait_served(lc.front, "1")
        t_back = time.monotonic()
        time.sleep(1.0)
        wait_for_requests(traffic, 6)
    assert traffic.failures() == [], traffic.failures()[:5]
    seen = [r[1] for r in traffic.results]
    assert seen[0] == "1" and "3" in seen and seen[-1] == "1" and "2" not in seen
    # Sent more than 1 s after the front named v1: answered by v1. (Timed by when a request was sent: one sent
    # to v3 before the switch can finish later on a loaded machine, and v3 drains it, as it should.)
    assert {r[1] for r in traffic.results if r[3] > t_back + 1.0} == {"1"}
    assert "3" in {r[1] for r in traffic.results if t_swap < r[0] < t_back}
    swaps = [wait_run(lc.env, r["id"], timeout=120) for r in runs_of(lc.env, "serve-champion/champion")]
    assert len(swaps) == swaps_before + 2 and all(r["state"]["type"] == "COMPLETED" for r in swaps)
    # Each swapped-out server was drained and stopped: one server is left, behind the front.
    upstream = champion.current_upstream(router.read_record(MODEL))
    assert upstream["version"] == "1" and records.alive(upstream)
    assert [r["pid"] for r in records.running() if r["model"] == MODEL] == [upstream["pid"]]


def test_lifecycle_4_the_nightly_run_with_nothing_changed_skips_without_training(lifecycle):
    lc = lifecycle
    nightly = wait_run(lc.env, lc.state["nightly_id"])
    assert nightly["state"]["type"] == "COMPLETED"
    assert nightly["state"]["message"].startswith("skipped: data, base and training unchanged since version 1")
    tasks = api(lc.env, "POST", "/task_runs/filter", task_runs={"flow_run_id": {"any_": [nightly["id"]]}})
    assert [t["name"] for t in tasks if t["name"].startswith("train")] == []
    listed = run_cli("model", "list", MODEL, "--tracking-uri", lc.tracking, "--json", env=lc.env)
    check = json.loads(listed.stdout.splitlines()[-1])["last_retraining_check"]
    assert check["decision"] == "skipped", check
    # Recorded by the pipeline, a subflow of the nightly deployment's run.
    subflow = api(lc.env, "GET", f"/flow_runs/{check['flow_run_id']}")
    parent = api(lc.env, "GET", f"/task_runs/{subflow['parent_task_run_id']}")
    assert parent["flow_run_id"] == nightly["id"], (subflow, parent)
    assert check["reason"] == "data, base and training unchanged since version 1"


def test_lifecycle_5_the_form_is_typed_and_no_secret_is_stored_anywhere(lifecycle):
    lc = lifecycle
    assert "nightly_id" in lc.state, "step 3 did not complete"
    schema = api(lc.env, "GET", "/deployments/name/finetune-recipe/tiny-cpu")["parameter_openapi_schema"]
    props = schema["properties"]
    assert "tiny-cpu" in props["recipe"]["enum"] and props["max_steps"]["anyOf"][0]["type"] == "integer"
    assert all(props[k].get("description") for k in ("recipe", "gpus", "data_path", "max_steps", "lr", "run_id"))
    assert_no_secret(lc.env, tracking_url=lc.mlflow, folder=lc.tmp / "mlflow-artifacts")


def assert_no_secret(env: dict, tracking_url: str, folder: Path) -> None:
    """Neither secret in Prefect logs, parameters or artifacts, MLflow params/tags/artifacts, or stored text files."""
    from mlflow.tracking import MlflowClient

    texts = {
        "prefect logs": json.dumps(all_pages(env, "/logs/filter")),
        "prefect flow runs (parameters)": json.dumps(all_pages(env, "/flow_runs/filter")),
        "prefect artifacts": json.dumps(all_pages(env, "/artifacts/filter")),
    }
    assert "lifecycle-store" in texts["prefect flow runs (parameters)"]  # the searched text is the real one
    client = MlflowClient(tracking_url)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 3
    texts["mlflow params and tags"] = json.dumps([[r.data.params, r.data.tags] for r in runs])
    texts["mlflow model versions"] = json.dumps([v.tags for v in client.search_model_versions(f"name = '{MODEL}'")])
    for run in runs:
        local = client.download_artifacts(run.info.run_id, "", str(folder / run.info.run_id))
        texts[f"mlflow artifacts of {run.info.run_id}"] = "".join(
            f.read_text(errors="ignore") for f in Path(local).rglob("*") if f.is_file() and f.suffix != ".png"
        )
    fs, _ = storage.filesystem("s3://ladle")
    stored = [p for p in fs.find("ladle/lifecycle") if p.endswith((".json", ".yaml", ".jsonl", ".txt", ".md"))]
    texts["artifact store"] = "".join(fs.cat(p).decode(errors="ignore") for p in stored)
    assert "loss" in texts["artifact store"] and "config.training.lr" in texts["mlflow params and tags"]
    for where, text in texts.items():
        for secret in (SECRET_S3, SECRET_MLFLOW):
            assert secret not in text, f"{secret} found in {where}"


def test_ladle_run_uses_the_configured_server_and_starts_none(prefect_server, tmp_path, tiny_model):
    """PREFECT_API_URL set: the flow run is recorded on that server and ladle starts no temporary one.

    The run fails inside the flow (a data error found by the prepare task), which proves the same routing as a
    full run at a fraction of its time (full runs through that server are the tests above), and that an error
    found inside Prefect is still one line, with no traceback, and that --json carries every bad row and the
    file of rejects.
    """
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(f"{{broken {i}\n" for i in range(5)))
    before = {
        r["id"] for r in httpx.post(f"{prefect_server['PREFECT_API_URL']}/flow_runs/filter", json={}, timeout=10).json()
    }
    done = run_cli(
        "run",
        str(ROOT / "recipes" / "tiny-cpu.yaml"),
        "--json",
        "--set",
        f"data.path={bad}",
        "--set",
        f"output={tmp_path / 'out'}",
        env=prefect_server,
        timeout=300,
    )
    line = assert_clean_error(
        done, "no usable training rows (read 5, dropped 5; line 1: malformed JSON", "rejects.jsonl"
    )
    assert line.startswith(f"error: data.path = '{bad}'")
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed["status"] == "failed" and [row["line"] for row in failed["dropped"]] == [1, 2, 3, 4, 5]
    rejects = [json.loads(x) for x in Path(failed["rejects"]).read_text().splitlines()]
    assert [(r["line"], r["raw"]) for r in rejects] == [(i + 1, f"{{broken {i}") for i in range(5)]
    assert failed["prefect_api_startup_s"] is None and failed["prefect_api_waited_s"] is None
    runs = httpx.post(f"{prefect_server['PREFECT_API_URL']}/flow_runs/filter", json={}, timeout=10).json()
    new = [r for r in runs if r["id"] not in before and r["name"] and r["flow_id"]]
    assert len(new) == 1 and new[0]["state"]["type"] == "FAILED"


def test_lifecycle_6_a_canary_asked_by_hand_takes_traffic_and_becomes_champion(lifecycle):
    """`ladle model canary` on v3 (rolled back in step 3): its `ladle.model.canary` event runs the serving
    deployment (promote.canary set on it), which serves v3 beside v1 on half the traffic; the front's verdict
    passes it, the registry makes it champion, the old server is stopped, and no request fails."""
    lc = lifecycle
    assert "nightly_id" in lc.state, "step 3 did not complete"
    serving_before = len(runs_of(lc.env, "serve-champion/champion"))
    with Traffic(lc.front, MODEL, clients=2, pause_s=0.1) as traffic:
        wait_for_requests(traffic, 4)
        asked = run_cli("model", "canary", MODEL, "3", "--tracking-uri", lc.tracking, "--json", env=lc.env)
        assert json.loads(asked.stdout.splitlines()[-1])["event_id"], asked.stderr
        wait_served(lc.front, "3", timeout=110)
        wait_for_requests(traffic, 4)
    assert traffic.failures() == [], traffic.failures()[:5]
    seen = [r[1] for r in traffic.results]
    assert seen[0] == "1" and seen[-1] == "3" and set(seen) == {"1", "3"}
    runs = [wait_run(lc.env, r["id"], timeout=60) for r in runs_of(lc.env, "serve-champion/champion")]
    assert len(runs) >= serving_before + 1 and all(r["state"]["type"] == "COMPLETED" for r in runs)
    messages = [r["state"]["message"] for r in runs]
    assert any("canary of v3 passed" in m for m in messages), messages
    listed = run_cli("model", "list", MODEL, "--tracking-uri", lc.tracking, "--json", env=lc.env)
    versions = {v["version"]: v for v in json.loads(listed.stdout.splitlines()[-1])["versions"]}
    assert versions["3"]["aliases"] == ["challenger", "champion"] and versions["3"]["promotion"].startswith(
        "canary passed"
    )
    upstream = champion.current_upstream(router.read_record(MODEL))
    assert upstream["version"] == "3" and [r["pid"] for r in records.running() if r["model"] == MODEL] == [
        upstream["pid"]
    ]


def test_lifecycle_7_the_prefect_and_mlflow_uis_show_the_run_its_artifacts_and_the_model(lifecycle, tmp_path):
    """What a user sees, in a real headless browser against the servers above: the Prefect UI's page of the
    pipeline's flow run (its artifacts on the timeline), two of ladle's artifacts rendered (the plan, the
    promotion decision), and MLflow's page of the registered model with its versions and aliases. The
    screenshots land in $LADLE_SCREENSHOTS when set (`make screenshots` writes the docs' images)."""
    from tests.browser import look, require_browser

    require_browser()
    lc = lifecycle
    assert "nightly_id" in lc.state, "step 3 did not complete"
    shots = Path(os.environ.get("LADLE_SCREENSHOTS") or tmp_path)
    ui = lc.env["PREFECT_API_URL"].removesuffix("/api")
    found = {
        key: api(lc.env, "POST", "/artifacts/filter", artifacts={"key": {"any_": [key]}}, sort="CREATED_DESC")
        for key in ("plan", "promotion")
    }
    plan, promotion = found["plan"][-1], found["promotion"][-1]  # run 1's: the oldest of each
    assert plan["flow_run_id"] == promotion["flow_run_id"]  # one pipeline run made both
    run = api(lc.env, "GET", f"/flow_runs/{plan['flow_run_id']}")

    page = look(f"{ui}/runs/flow-run/{run['id']}", shots / "prefect-flow-run.png")
    assert run["name"] in page and "Completed" in page, page[:2000]
    page = look(f"{ui}/artifacts/artifact/{plan['id']}", shots / "prefect-plan-artifact.png", size=(1400, 1100))
    assert "strategy" in page and "ddp" in page, page[:2000]
    page = look(f"{ui}/artifacts/artifact/{promotion['id']}", shots / "prefect-promotion-artifact.png")
    assert "promoted" in page and MODEL in page, page[:2000]
    page = look(f"{lc.mlflow}/#/models/{MODEL}", shots / "mlflow-registered-model.png")
    assert MODEL in page and "champion" in page and "Version 3" in page, page[:2000]


def test_lifecycle_8_enough_user_feedback_starts_the_retraining_deployment(lifecycle, tmp_path):
    """The event-driven retraining: a capturing server's writer (its own process, the Prefect API in its
    environment) keeps three feedbacks and emits ``ladle.feedback.received`` for each; the `tiny-cpu-on-feedback`
    deployment's trigger (threshold 3 here, 20 as shipped) starts a run of it, on the worker. That run learns from
    its output's traffic, where none was captured: fewer new rows than its retrain.min_new_feedback (10), so it
    ends skipped, saying how many it has, without training."""
    lc = lifecycle
    writer = (
        "import sys; from ladle.serve.capture import CaptureSettings, Recorder\n"
        "rec = Recorder(CaptureSettings(enabled=True, flush_s=0.1), sys.argv[1], 'tiny-cpu', '3')\n"
        "for i in range(3):\n"
        "    rec.record(f'chatcmpl-{i}', {'route': 'chat', 'request': {'messages': []}, 'answer': {'content': 'x'}})\n"
        "    rec.feedback({'response_id': f'chatcmpl-{i}', 'name': 'user_feedback', 'value': i > 0})\n"
        "rec.close()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", writer, str(tmp_path / "traffic")],
        env=lc.env,
        cwd=ROOT,
        timeout=120,
        text=True,
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "not emitted" not in done.stderr, done.stderr[-3000:]
    deployment = api(lc.env, "GET", "/deployments/name/finetune-recipe/tiny-cpu-on-feedback")
    assert deployment["parameters"]["overrides"] == ["retrain.from_traffic=true", "retrain.min_new_feedback=10"]
    deadline = time.monotonic() + 90
    while not (runs := api(lc.env, "POST", "/flow_runs/filter", deployments={"id": {"any_": [deployment["id"]]}})):
        assert time.monotonic() < deadline, "the feedback trigger started no run"
        time.sleep(1)
    (run,) = runs
    ended = wait_run(lc.env, run["id"], timeout=300)
    assert ended["state"]["type"] == "COMPLETED", ended["state"]
    said = ended["state"]["message"]
    assert said.startswith("skipped: 0 new sft rows from traffic since champion v3's window"), said
    assert "retrain.min_new_feedback = 10" in said
