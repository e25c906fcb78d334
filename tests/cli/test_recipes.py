"""`ladle recipes`, `--deepspeed`, and `ladle plan` sizing a recorded machine from a shipped recipe."""

from __future__ import annotations

import json
import re

import pytest

from tests.helpers import NVSWITCH_8, assert_clean_error, run_cli

SHIPPED = [
    "deepseek-v3-pipeline",
    "llama3-70b-64k-sp",
    "llama3-70b-fsdp2",
    "llama3-70b-nd",
    "llama3-8b-lora",
    "llama3-8b-qlora",
    "llama3.2-1b-lora",
    "llama3.2-1b-qlora",
    "qwen3-32b-zeropp",
    "smollm2-135m-calculator-grpo-cpu",
    "smollm2-135m-calculator-sft-cpu",
    "smollm2-135m-cpu",
    "smollm2-135m-dpo-cpu",
    "smollm2-135m-flywheel-cpu",
    "smollm2-135m-grpo-cpu",
    "tiny-cpu",
    "tiny-dpo-cpu",
    "tiny-grpo-cpu",
]


def test_recipes_list_show_use(tmp_path):
    listed = json.loads(run_cli("recipes", "list", "--json").stdout.strip().splitlines()[-1])
    assert sorted(listed) == SHIPPED and "ZeRO++" in listed["qwen3-32b-zeropp"]
    shown = run_cli("recipes", "show", "qwen3-32b-zeropp")
    assert shown.returncode == 0 and "strategy: zero++" in shown.stdout
    target = tmp_path / "mine.yaml"
    assert run_cli("recipes", "use", "llama3-8b-lora", "--to", str(target)).returncode == 0
    assert "base: ladle://models/llama-3.1-8b" in target.read_text()
    assert_clean_error(run_cli("recipes", "use", "llama3-8b-lora", "--to", str(target)), "the file exists", "--force")


@pytest.mark.parametrize("name", ["../recipes/tiny-cpu", "/etc/passwd", "a/b", ".hidden"])
def test_recipe_names_are_never_paths(name):
    assert_clean_error(run_cli("recipes", "show", name), "a recipe name is letters, digits", "(no paths)")


def test_unknown_recipe_lists_the_choices():
    assert_clean_error(run_cli("recipes", "show", "llama9"), "NAME = 'llama9': no such recipe", "tiny-cpu")


def test_plan_a_recipe_on_a_recorded_machine_sizes_it(tmp_path):
    topo = tmp_path / "topo.txt"
    topo.write_text(NVSWITCH_8)
    done = run_cli(
        "plan", "recipes/llama3-70b-fsdp2.yaml", "--topology-file", str(topo), "--gpu-memory", "80", "--json"
    )
    made = json.loads(done.stdout.strip().splitlines()[-1])
    assert made["strategy"] == "fsdp2" and made["params"] == 70_553_706_496 and made["world_size"] == 8
    by_name = {c["strategy"]: c for c in made["candidates"]}
    assert by_name["fsdp2"]["fits"] and not by_name["ddp"]["fits"]  # a 141 GB bf16 replica cannot fit 80 GB
    assert made["strategy_options"]["compile"] is True
    # The merged 141 GB model is evaluated with its layers over all 8 GPUs: its share and an eval batch's logits.
    per_gpu = made["memory"]["evaluate"] / 2**30
    assert 70_553_706_496 * 2 / 8 / 2**30 < per_gpu < 72, per_gpu
    text = run_cli("plan", "recipes/llama3-70b-fsdp2.yaml", "--topology-file", str(topo), "--gpu-memory", "80").stderr
    assert "## Candidates (fastest first)" in text and "strategy fsdp2 (explicit): needs" in text
    assert re.search(r"evaluate: [\d.]+ GiB per device over its layers spread over 8 GPUs", " ".join(text.split()))


def test_deepspeed_flag_sets_the_strategy_and_prints_the_json(tmp_path):
    topo = tmp_path / "topo.txt"
    topo.write_text(NVSWITCH_8)
    done = run_cli(
        "plan", "recipes/llama3-8b-lora.yaml", "--topology-file", str(topo), "--deepspeed", "zero_pp", "--json"
    )
    made = json.loads(done.stdout.strip().splitlines()[-1])
    assert made["strategy"] == "zero++" and made["launcher_config"]["zero_optimization"]["stage"] == 3
    assert_clean_error(
        run_cli("plan", "recipes/tiny-cpu.yaml", "--deepspeed", "4"), "--deepspeed = '4': unknown ZeRO stage"
    )
    assert_clean_error(run_cli("plan", "recipes/tiny-cpu.yaml", "--gpu-memory", "-3"), "--gpu-memory = -3.0")


def test_a_shipped_config_without_weights_cannot_train():
    assert_clean_error(
        run_cli("run", "recipes/llama3.2-1b-lora.yaml", "--set", "data.path=ladle://demo-alpaca"),
        "has a config.json but no weights",
        "--set base=/path/to/model",
    )


def test_plan_and_probe_never_import_torch_or_transformers(tmp_path):
    """The fast path: `ladle plan` / `ladle probe` for known architectures load neither (timed in bench/cold_start.py)."""
    import subprocess
    import sys

    topo = tmp_path / "topo.txt"
    topo.write_text(NVSWITCH_8)
    code = (
        "import sys\n"
        "from ladle.cli.main import app\n"
        "for argv in ([ 'plan', 'recipes/llama3-70b-fsdp2.yaml', '--topology-file', sys.argv[1], '--gpu-memory', '80', '--json'],"
        " ['probe', '--topology-file', sys.argv[1], '--json']):\n"
        "    try:\n"
        "        app(argv)\n"
        "    except SystemExit as e:\n"
        "        assert not e.code, e.code\n"
        "heavy = [m for m in ('torch', 'transformers', 'deepspeed', 'peft', 'accelerate') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, str(topo)], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]


def test_a_plan_that_does_not_fit_still_reports_its_numbers_in_json(tmp_path):
    """DeepSeek-V3 on one 8x80 GiB node: the failure object carries the model size and every candidate."""
    topo = tmp_path / "topo.txt"
    topo.write_text(NVSWITCH_8)
    done = run_cli(
        "plan",
        "recipes/deepseek-v3-pipeline.yaml",
        "--topology-file",
        str(topo),
        "--gpu-memory",
        "80",
        "--set",
        "parallelism.nodes=1",
        "--set",
        "parallelism.strategy=auto",
        "--json",
    )
    assert_clean_error(done, "parallelism.strategy = auto: no strategy fits 72.0 GiB usable of 80.0 GiB per rank")
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed["status"] == "failed" and failed["params"] == 671_026_404_352 and failed["trainable_params"] > 0
    assert {c["strategy"] for c in failed["candidates"]} >= {"ddp", "zero3", "fsdp2"}
    assert all(not c["fits"] and c["per_rank_gib"] > 72 for c in failed["candidates"])
    assert failed["world_size"] == 8 and failed["device"] == "cuda"


def test_recipes_show_json_and_its_failure():
    shown = json.loads(run_cli("recipes", "show", "tiny-cpu", "--json").stdout.strip().splitlines()[-1])
    assert shown["name"] == "tiny-cpu" and "base: ladle://tiny-llama" in shown["yaml"]
    missing = run_cli("recipes", "show", "llama9", "--json")
    failed = json.loads(missing.stdout.strip().splitlines()[-1])
    assert failed["status"] == "failed" and "tiny-cpu" in failed["recipes"]
