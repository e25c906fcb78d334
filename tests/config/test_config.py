import json

import pytest

from ladle.config import MAX_GPU_COUNT, LadleConfig, build_config, json_schema, load_config, parse_gpus
from ladle.errors import ConfigError, LadleError
from tests.helpers import ROOT

MINIMAL = {"base": "ladle://tiny-llama", "data": {"path": "ladle://demo-alpaca"}}


def test_demo_recipe_validates():
    cfg = load_config(ROOT / "recipes" / "tiny-cpu.yaml")
    assert cfg.schema_version == 1
    assert cfg.parallelism.gpus == "auto"
    assert cfg.training.lora.target_modules == "all-linear"


def test_real_model_recipe_validates_and_gates_on_the_probe():
    cfg = load_config(ROOT / "recipes" / "smollm2-135m-cpu.yaml")
    assert cfg.base == "ladle://smollm2-135m-instruct" and cfg.training.lora.modules_to_save == []
    assert cfg.eval.probe == "ladle://general-probe" and cfg.promote.max_probe_drop == 0.1
    assert cfg.data.path == "ladle://demo-alpaca-replay" and cfg.data.eval_path == "ladle://demo-alpaca-heldout"


def test_set_parses_values_as_yaml():
    cfg = build_config(
        MINIMAL,
        ["training.lr=1e-4", "training.lora.target_modules=[q_proj,v_proj]", "training.max_steps=7", "data.pack=false"],
    )
    assert cfg.training.lr == 1e-4
    assert cfg.training.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.training.max_steps == 7
    assert cfg.data.pack is False


def test_unknown_key_names_the_path():
    with pytest.raises(ConfigError) as info:
        build_config(MINIMAL, ["training.learning_rate=1e-4"])
    assert "training.learning_rate: unknown key" in str(info.value)
    assert "ladle schema" in str(info.value)


def test_wrong_type_names_field_value_and_fix():
    with pytest.raises(ConfigError) as info:
        build_config(MINIMAL, ["training.max_steps=many"])
    message = str(info.value)
    assert message.startswith('training.max_steps = "many":')
    assert "--set training.max_steps=" in message


def test_a_union_field_gets_one_line_naming_the_field_and_every_accepted_form():
    with pytest.raises(ConfigError) as info:
        build_config(MINIMAL, ["training.kernels.packed_attention=sometimes", "training.micro_batch_size=-3"])
    assert info.value.problems == [
        "training.micro_batch_size = -3: Input should be greater than or equal to 1 or Input should be 'auto'. "
        "Fix it in config or with --set training.micro_batch_size=...",
        'training.kernels.packed_attention = "sometimes": Input should be a valid boolean, unable to interpret '
        "input or Input should be 'auto'. Fix it in config or with --set training.kernels.packed_attention=...",
    ]


def test_every_problem_reported_at_once():
    with pytest.raises(ConfigError) as info:
        build_config(MINIMAL, ["training.lr=-1", "data.seq_len=3", "bogus=1"])
    assert len(info.value.problems) == 3


def test_missing_required_field():
    with pytest.raises(ConfigError, match=r"base: required but missing"):
        build_config({"data": {"path": "x.jsonl"}}, [])


def test_malformed_override():
    with pytest.raises(LadleError, match="expected dotted.path=value"):
        build_config(MINIMAL, ["training.lr"])


@pytest.mark.parametrize(
    "value, expected", [("auto", "auto"), ("AUTO", "auto"), ("1", 1), (8, 8), (str(MAX_GPU_COUNT), MAX_GPU_COUNT)]
)
def test_gpus_accepted(value, expected):
    assert parse_gpus(value) == expected


@pytest.mark.parametrize("value", [True, False, 0, -1, "0", "-2", "two", "1.5", 129, "129", None, 2.0])
def test_gpus_rejected(value):
    with pytest.raises(ValueError, match="auto' or an integer 1..128"):
        parse_gpus(value)


def test_gpus_error_through_config():
    with pytest.raises(ConfigError, match=r"parallelism.gpus = \"0\": .*1..128"):
        build_config(MINIMAL, [], gpus="0")


def test_schema_describes_every_field():
    schema = json_schema()
    missing = []

    def walk(node, path):
        for name, prop in node.get("properties", {}).items():
            if "description" not in prop:
                missing.append(f"{path}{name}")

    walk(schema, "")
    for name, definition in schema.get("$defs", {}).items():
        walk(definition, f"{name}.")
    assert missing == []
    json.dumps(schema)


def test_extra_forbidden_everywhere():
    for section in ("data", "training", "parallelism", "serve", "tracking"):
        with pytest.raises(ConfigError, match=f"{section}.nope: unknown key"):
            build_config(MINIMAL, [f"{section}.nope=1"])


def test_model_roundtrip():
    cfg = build_config(MINIMAL, [])
    assert LadleConfig.model_validate(cfg.model_dump()) == cfg


def test_generated_reference_is_current():
    from ladle.config import markdown_reference

    assert (ROOT / "docs" / "config.md").read_text() == markdown_reference(), (
        "run: ladle schema --markdown > docs/config.md"
    )
    from ladle.config import json_schema

    # What editors validate a recipe against (the docs link it): the same fields, defaults and words.
    assert json.loads((ROOT / "docs" / "config.schema.json").read_text()) == json_schema(), (
        "run: ladle schema > docs/config.schema.json"
    )


def test_own_data_on_a_recipe_is_scored_on_its_own_held_out_rows(tmp_path):
    """A recipe with a held-out file for its own data, run on the user's data (`--set data.path=...`): the run is
    scored and smoke-tested on the user's rows (a share held out), and the CLI says so; naming a held-out file, or
    not replacing the data, keeps the recipe's file."""
    from tests.helpers import run_cli

    mine = tmp_path / "mine.jsonl"
    mine.write_text('{"instruction": "Say hi", "output": "hi"}\n' * 20)
    cfg = load_config("smollm2-135m-cpu", [f"data.path={mine}"])
    assert cfg.data.eval_path is None and cfg.data.eval_ratio == 0.1
    (note,) = cfg.notes
    assert "data.eval_path = 'ladle://demo-alpaca-heldout'" in note and "--set data.eval_path=FILE" in note
    kept = load_config("smollm2-135m-cpu", [f"data.path={mine}", f"data.eval_path={mine}"])
    assert kept.data.eval_path == str(mine) and not kept.notes
    assert load_config("smollm2-135m-cpu", ["training.lr=1e-4"]).data.eval_path == "ladle://demo-alpaca-heldout"
    shown = run_cli(
        "plan",
        "smollm2-135m-cpu",
        "--set",
        f"data.path={mine}",
        "--model-config",
        str(ROOT / "recipes" / "models" / "llama-3.2-1b"),
    )
    assert "note: data.path was set on the command line" in " ".join(shown.stderr.split())


@pytest.mark.parametrize("recipe", sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")))
def test_every_shipped_recipe_validates(recipe):
    """Each recipe is a valid config, its rewards importable where it names some (they ship with ladle)."""
    from ladle import rewards

    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml")
    assert cfg.name == recipe
    if cfg.training.objective == "grpo":
        assert rewards.load_all(cfg.training.rl.rewards, rewards.bundle(cfg.training.rl.rewards))


@pytest.mark.parametrize(
    ("sets", "fragment"),
    [
        (["training.lora.enabled=false"], "training.lora.enabled = false: a full fine-tune has no adapter"),
        (
            ["training.lora.modules_to_save=[lm_head, norm]"],
            "the input embedding (lm_head, embed_tokens) whole, not norm",
        ),
        (["serve.backend=mii"], "serve.backend = mii: that backend serves no adapters"),
    ],
)
def test_an_unmerged_adapter_refuses_what_cannot_serve_it(sets, fragment):
    with pytest.raises(ConfigError) as info:
        build_config(MINIMAL, ["promote.merge=false", *sets])
    assert fragment in str(info.value) and "promote.merge=true" in str(info.value)
    assert build_config(MINIMAL, ["promote.merge=false"]).promote.merge is False
    captured = build_config(MINIMAL, ["serve.capture.enabled=true", "output=s3://bucket/out"])
    assert captured.serve.capture.url == "s3://bucket/out/traffic"  # beside the runs, not the server's folder
    assert build_config(MINIMAL, []).serve.capture.url is None  # off: nothing decided
    # A head and an embedding saved whole are served beside the base, a copy per adapter (tests/serve).
    ends = build_config(MINIMAL, ["promote.merge=false", "training.lora.modules_to_save=[lm_head, embed_tokens]"])
    assert ends.training.lora.modules_to_save == ["lm_head", "embed_tokens"]
    canaried = build_config(MINIMAL, ["promote.merge=false", "promote.canary={weight: 0.2, duration_s: 60}"])
    assert canaried.promote.canary.weight == 0.2  # an adapter's canary runs at its base's front
    assert build_config(MINIMAL, ["promote.merge=false", "serve.target=kubernetes"]).serve.target == "kubernetes"


@pytest.mark.parametrize(
    ("sets", "fragment"),
    [
        (
            ["compute.slurm.time_limit='2'"],
            "training.preempt_grace_s = 120 is not shorter than compute.slurm.time_limit",
        ),
        (["training.preempt_grace_s=70000", "compute.slurm.time_limit=UNLIMITED"], "at most 65535 s"),
    ],
)
def test_a_grace_the_cluster_cannot_give_is_refused(sets, fragment):
    with pytest.raises(ConfigError) as info:
        build_config(MINIMAL, ["compute.target=slurm", *sets])
    assert fragment in str(info.value)
    assert (
        build_config(MINIMAL, ["compute.target=slurm", "compute.slurm.time_limit='3'"]).training.preempt_grace_s == 120
    )
