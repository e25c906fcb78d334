"""Bad input: one clear line naming the field or path and the fix, a non-zero exit, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import LLAMA3_8B, ROOT, assert_clean_error, run_cli

RECIPE = str(ROOT / "recipes" / "tiny-cpu.yaml")


@pytest.mark.parametrize(
    "overrides, fragments",
    [
        (["training.learnin_rate=1"], ["training.learnin_rate: unknown key", "ladle schema"]),
        (["training.max_steps=lots"], ['training.max_steps = "lots"', "--set training.max_steps="]),
        (["data.path=/nonexistent/rows.jsonl"], ["data.path = '/nonexistent/rows.jsonl': no such file"]),
        (["base=/tmp"], ["base = '/tmp': the folder holds no model (no config.json)"]),
        (["base=/nonexistent/model"], ["base = '/nonexistent/model': no such folder"]),
        (["serve.backend=mii"], ["serve.backend = mii: DeepSpeed-MII has no CPU path", "serve.backend=transformers"]),
    ],
)
def test_bad_config_values(overrides, fragments):
    args = [arg for item in overrides for arg in ("--set", item)]
    assert_clean_error(run_cli("run", RECIPE, *args, timeout=120), *fragments)


def test_empty_dataset(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert_clean_error(
        run_cli("run", RECIPE, "--set", f"data.path={empty}", timeout=120), "the dataset is empty (0 rows)"
    )


@pytest.mark.parametrize("gpus", ["0", "-1", "true", "two", "129"])
def test_bad_gpus_flag(gpus):
    assert_clean_error(run_cli("run", RECIPE, "--gpus", gpus, timeout=120), "parallelism.gpus", "1..128")


def test_gpus_on_cpu_host_prints_the_corrected_command():
    assert_clean_error(run_cli("run", RECIPE, "--gpus", "2", timeout=120), f"ladle run {RECIPE} --gpus auto")


def test_missing_config_file():
    assert_clean_error(run_cli("run", "nope.yaml", timeout=60), "config = 'nope.yaml': no such file")


def test_json_mode_reports_failure_as_last_line():
    done = run_cli("run", RECIPE, "--json", "--set", "training.nope=1", timeout=60)
    assert done.returncode == 2
    last = json.loads(done.stdout.strip().splitlines()[-1])
    assert last["status"] == "failed" and "training.nope" in last["error"]


# An error found inside the flow (the prepare task) is one line too, --json carrying every bad row:
# tests/pipeline/test_deployment.py::test_ladle_run_uses_the_configured_server_and_starts_none (the same run there,
# against a server already running).


def test_unreachable_prefect_api_is_one_line():
    """PREFECT_API_URL set: ladle starts no server, and says so when nothing answers there."""
    from ladle.train.run import free_port

    url = f"http://127.0.0.1:{free_port()}/api"
    done = run_cli("run", RECIPE, "--json", env={"PREFECT_API_URL": url}, timeout=120)
    assert_clean_error(done, f"PREFECT_API_URL = '{url}': no Prefect API answers there", "prefect server start")
    assert json.loads(done.stdout.strip().splitlines()[-1])["status"] == "failed"


def test_bad_embedded_server_budget_is_one_line():
    """Prefect itself would fail to import on it, with a traceback; ladle checks it first.
    (A budget that runs out is tested on the server handle itself: tests/platform/test_prefect_api.py.)"""
    done = run_cli("run", RECIPE, env={"PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "soon"}, timeout=120)
    assert_clean_error(
        done,
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS = 'soon': must be a positive whole number",
        "or unset it",
    )


def test_schema_and_env_commands():
    schema = json.loads(run_cli("schema", timeout=60).stdout)
    assert schema["properties"]["schema_version"]["const"] == 1 or "schema_version" in schema["properties"]
    env = run_cli("env", "--json", timeout=60)
    info = json.loads(env.stdout.strip().splitlines()[-1])
    assert info["packages"]["torch"].startswith("2.") and info["topology"]["gpu_count"] == 0


def test_data_commands(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        '{"instruction": "Add 1 and 2.", "output": "3"}\n{oops\n'
        + '{"instruction": "Add 2 and 2.", "output": "4"}\n' * 200
    )
    overrides = ["--set", f"data.path={rows}", "--set", f"output={tmp_path / 'out'}"]
    prepared = run_cli("data", "prepare", RECIPE, *overrides, "--json", timeout=120)
    assert prepared.returncode == 0, prepared.stderr[-2000:]
    report = json.loads(prepared.stdout.strip().splitlines()[-1])
    assert (report["rows_read"], report["rows_used"], report["dropped"][0]["line"]) == (202, 201, 2)
    inspected = json.loads(
        run_cli("data", "inspect", RECIPE, *overrides, "--json", timeout=120).stdout.strip().splitlines()[-1]
    )
    assert (inspected["format"], inspected["records"], inspected["invalid"]) == ("alpaca", 202, 1)
    masked = run_cli("data", "show-mask", RECIPE, *overrides, "-n", "1", "--json", timeout=120)
    row = json.loads(masked.stdout.strip().splitlines()[-1])["rows"][0]
    assert "".join(piece for piece, trained in row["tokens"] if trained) == "3<|end|>"
    bad = run_cli("data", "prepare", RECIPE, *overrides, "--set", "data.max_bad_fraction=0", "--json", timeout=120)
    assert_clean_error(bad, "1 of 202 rows unusable", "line 2: malformed JSON", "rejects.jsonl")
    failed = json.loads(bad.stdout.strip().splitlines()[-1])
    assert failed["status"] == "failed" and failed["rows_read"] == 202
    assert failed["dropped"] == [{"line": 2, "reason": failed["dropped"][0]["reason"], "source": str(rows)}]
    assert [json.loads(x)["raw"] for x in Path(failed["rejects"]).read_text().splitlines()] == ["{oops"]


def test_launch_bad_input(tmp_path):
    assert_clean_error(run_cli("launch", str(tmp_path / "nope.json"), "--node-rank", "1", timeout=60), "no such file")
    junk = tmp_path / "spec.json"
    junk.write_text("{}")
    assert_clean_error(run_cli("launch", str(junk), "--node-rank", "1", timeout=60), "not a ladle training spec")


def test_plan_reports_model_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA3_8B))
    lora = ["--set", "training.lora.r=8", "--set", "training.lora.target_modules=[q_proj,v_proj]"]
    done = run_cli(
        "plan",
        RECIPE,
        "--model-config",
        str(tmp_path),
        *lora,
        "--set",
        "parallelism.strategy=ddp",
        "--json",
        timeout=60,
    )
    plan = json.loads(done.stdout.strip().splitlines()[-1])
    # the adapters (3,407,872), plus the trained copies of both ends the recipe's modules_to_save asks for
    adapters, ends = 3_407_872, 2 * 128_256 * 4_096
    assert (plan["params"], plan["trainable_params"], plan["strategy"]) == (8_030_261_248, adapters + ends, "ddp")
    # an 8B base in float32 is 30 GiB per CPU process: the explicit choice wins, with the numbers
    assert any(w.startswith("parallelism.strategy = ddp needs") for w in plan["warnings"])
    too_big = run_cli("plan", RECIPE, "--model-config", str(tmp_path), *lora, "--json", timeout=60)
    assert_clean_error(too_big, "parallelism.strategy = auto: no strategy fits")
    failed = json.loads(too_big.stdout.strip().splitlines()[-1])  # what was computed comes with the failure
    assert (failed["status"], failed["params"], failed["trainable_params"]) == (
        "failed",
        8_030_261_248,
        adapters + ends,
    )
    assert failed["candidates"] and all(c["per_rank_gib"] > 0 and not c["fits"] for c in failed["candidates"])
    assert plan["launch_command"].startswith("python -m ladle.train.launch --multi_gpu --num_processes 2")
    (tmp_path / "config.json").write_text("{oops")
    assert_clean_error(run_cli("plan", RECIPE, "--model-config", str(tmp_path), timeout=60), "not valid JSON")


def test_probe_and_plan_against_a_recorded_machine(tmp_path):
    from tests.helpers import PAIRS_4

    recorded = tmp_path / "topo.txt"
    recorded.write_text(PAIRS_4)
    topo = json.loads(
        run_cli("probe", "--topology-file", str(recorded), "--json", timeout=60).stdout.strip().splitlines()[-1]
    )
    assert (topo["gpu_count"], topo["interconnect"], topo["nvlink_groups"]) == (4, "partial-nvlink", [[0, 1], [2, 3]])
    plan = json.loads(
        run_cli("plan", RECIPE, "--topology-file", str(recorded), "--json", timeout=60).stdout.strip().splitlines()[-1]
    )
    assert (plan["device"], plan["world_size"], plan["backend"]) == ("cuda", 4, "nccl")
    too_many = run_cli("plan", RECIPE, "--topology-file", str(recorded), "--gpus", "8", timeout=60)
    assert_clean_error(too_many, "parallelism.gpus = 8: this host has 4 visible GPU(s)", f"ladle run {RECIPE} --gpus 4")
    missing = run_cli("probe", "--topology-file", str(tmp_path / "nope.txt"), "--json", timeout=60)
    assert_clean_error(missing, "no such file")
    assert json.loads(missing.stdout.strip().splitlines()[-1])["status"] == "failed"
