"""The registries keep their promise: a strategy or serving backend is one class. A class defined here is
accepted by the config, planned, sized and rendered without touching any other module; no module outside
the registries compares their names; the three wrong answers the name comparisons gave are fixed; and the
package has no import cycle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ladle import strategies
from ladle.config import build_config, json_schema, markdown_reference
from ladle.errors import ConfigError
from ladle.machine.topology import probe
from ladle.plan.planner import make_plan, sizing_job
from ladle.serve import backends
from ladle.sizing.params import read_config
from ladle.strategies import Candidate, Strategy, Target
from tests.helpers import A100_X8, ROOT, T4_X2

CPU = probe(env={}, query_output="")
A100 = probe(env={}, query_output=A100_X8)
T4 = probe(env={}, query_output=T4_X2)
MINIMAL = {"base": "b", "data": {"path": "d"}}


class Toy(Strategy):
    """A strategy the rest of ladle has never heard of: a full replica per rank that ranks itself first."""

    name = "toy"
    aliases = ("toy-alias",)
    summary = "a test strategy, ranked first wherever there is more than one rank"

    def validate(self, cfg, topo, target) -> list[str]:
        return [] if target.world_size > 1 else ["parallelism.strategy = toy: needs 2 ranks. Add a rank."]

    def candidates(self, job, interconnect, cfg) -> list[Candidate]:
        return [Candidate(self, -1, "the toy always goes first")] if job.world > 1 else []

    def configure(self, cfg, plan) -> tuple[dict, list[str]]:
        return {"toy_ranks": plan.world_size}, [f"toy over {plan.world_size} ranks"]

    def wrap(self, accelerator, model, make_optimizer, plan):
        return accelerator.prepare(model, make_optimizer(model))

    def check_applied(self, accelerator, model, plan) -> dict:
        return {"wrapper": type(model).__name__}


@pytest.fixture(autouse=True)
def bitsandbytes_present(monkeypatch):
    """These plans are for GPU hosts that have bitsandbytes; its absence here is tested in test_memory_truth.py."""
    monkeypatch.setattr("ladle.plan.planner.bitsandbytes_installed", lambda: True)


@pytest.fixture
def toy():
    strategy = strategies.register(Toy())
    yield strategy
    strategies.unregister(strategy.name)


def test_a_new_strategy_class_is_accepted_planned_and_rendered(toy):
    by_alias = build_config({**MINIMAL, "parallelism": {"strategy": "toy-alias"}}, [])
    assert by_alias.parallelism.strategy == "toy"
    plan = make_plan(by_alias, CPU)
    assert (plan.strategy, plan.world_size, plan.launcher_config) == ("toy", 2, {"toy_ranks": 2})
    assert "toy over 2 ranks" in plan.reasons and "parallelism.strategy = toy (explicit)" in plan.overrides
    assert "| strategy | toy |" in plan.to_markdown() and "## toy launcher config" in plan.to_markdown()
    assert "--multi_gpu" in plan.launch_command(["SPEC.json"])
    one_rank = build_config({**MINIMAL, "parallelism": {"strategy": "toy", "cpu_processes": 1}}, [])
    with pytest.raises(ConfigError, match="parallelism.strategy = toy: needs 2 ranks"):
        make_plan(one_rank, CPU)


def test_a_new_strategy_is_sized_and_chosen_by_its_rank(toy):
    model = read_config(ROOT / "recipes" / "models" / "llama-3.2-1b")
    plan = make_plan(build_config(MINIMAL, []), A100, model=model)
    assert plan.strategy == "toy"
    assert plan.candidates[0]["strategy"] == "toy" and plan.candidates[0]["why"] == "the toy always goes first"
    assert any(r.startswith("strategy toy: the toy always goes first; needs ") for r in plan.reasons)


def test_a_new_strategy_is_in_the_schema_docs_and_choices(toy):
    field = json_schema()["$defs"]["ParallelismConfig"]["properties"]["strategy"]
    assert "toy" in field["enum"] and "toy (alias toy-alias): a test strategy" in field["description"]
    assert "\\| toy |" in markdown_reference()
    with pytest.raises(ConfigError, match=r"Input should be 'auto', 'ddp', .* 'tp' or 'toy'"):
        build_config({**MINIMAL, "parallelism": {"strategy": "toy2"}}, [])


def test_registering_a_taken_name_is_refused(toy):
    with pytest.raises(ValueError, match=r"the name\(s\) \['toy', 'toy-alias'\] are already registered"):
        strategies.register(Toy())


# -- the registries' names appear nowhere else --------------------------------------------------------

CALLS_ON_NAMES = {"startswith", "endswith", "removeprefix", "removesuffix"}


def name_literals(path: Path, names: set[str]) -> list[str]:
    """String constants in ``path`` that are a registered name (or a name with a ``+variant``), or a prefix
    of one tested with ``startswith`` and the like."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CALLS_ON_NAMES:
            texts = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            hits = [t for t in texts if len(t) >= 3 and any(n.startswith(t) or n.endswith(t) for n in names)]
            found += [f"{path.name}:{node.lineno} {node.func.attr}({t!r})" for t in hits]
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_text and re.fullmatch(r"(\S+?)(\+\w+)*", node.value) and node.value.split("+")[0] in names:
            found.append(f"{path.name}:{node.lineno} {node.value!r}")
    return found


def test_no_strategy_name_literal_outside_the_strategies():
    names = {n for s in strategies.REGISTRY.values() for n in (s.name, *s.aliases)}
    files = [ROOT / "ladle" / f for f in ("plan/planner.py", "plan/memory.py", "sizing/__init__.py", "train/worker.py")]
    files += sorted((ROOT / "ladle" / "config").glob("*.py"))
    files += sorted((ROOT / "ladle" / "cli").glob("*.py"))
    found = [hit for path in files for hit in name_literals(path, names)]
    assert not found, found


def test_no_backend_name_literal_outside_the_backends():
    names = set(backends.REGISTRY)
    files = [
        ROOT / "ladle" / f for f in ("plan/planner.py", "fleet/deploy.py", "serve/__main__.py", "fleet/kubernetes.py")
    ]
    files += sorted((ROOT / "ladle" / "config").glob("*.py"))
    files += [p for p in sorted((ROOT / "ladle" / "cli").glob("*.py")) if p.name != "env.py"]  # env lists packages
    found = [hit for path in files for hit in name_literals(path, names)]
    assert not found, found


class GpuOnly(backends.Backend):
    name = "gpu-only"
    title = "The GPU-only test backend"
    summary = "a test backend that needs CUDA"
    requires_cuda = True

    def encode(self, prompt):
        raise NotImplementedError("never started: the host check refuses it here")

    def encode_chat(self, messages):
        raise NotImplementedError("never started: the host check refuses it here")

    def submit(self, job):
        raise NotImplementedError("never started: the host check refuses it here")


def test_a_new_backend_is_accepted_and_checked_by_the_one_host_check():
    backends.register(GpuOnly)
    try:
        cfg = build_config({**MINIMAL, "serve": {"backend": "gpu-only"}}, [])
        with pytest.raises(ConfigError) as planned:
            make_plan(cfg, CPU)
        with pytest.raises(Exception) as deployed:
            GpuOnly.check_host(has_cuda=False)
        message = "serve.backend = gpu-only: The GPU-only test backend has no CPU path and this host has no CUDA GPU."
        assert message in str(planned.value) and str(deployed.value).startswith(message)
        assert "Use serve.backend=transformers" in str(deployed.value)
        assert "gpu-only" in json_schema()["$defs"]["ServeConfig"]["properties"]["backend"]["enum"]
    finally:
        backends.REGISTRY.unregister("gpu-only")


def test_backend_options_are_typed_and_checked():
    mii = backends.get("mii")
    assert mii.parse_options(["tensor_parallel=2"]) == {"tensor_parallel": 2}
    with pytest.raises(
        Exception, match=r"backend mii accepts no option .tp. \(it accepts: tensor_parallel, replica_num"
    ):
        mii.parse_options(["tp=2"])
    with pytest.raises(Exception, match="tensor_parallel must be a int"):
        mii.parse_options(["tensor_parallel=two"])


# -- the three wrong answers name comparisons gave ------------------------------------------------------


def test_qlora_integer_storage_is_refused_when_auto_picks_a_sharded_strategy():
    """`strategy: auto` chose FSDP2 (a 32B 4-bit base does not fit one T4), whose shards must be floats;
    the check used to read the config's "auto" and let the plan through."""
    model = read_config(ROOT / "recipes" / "models" / "qwen3-32b")
    training = {"micro_batch_size": 1, "gradient_checkpointing": True, "quantization": {"mode": "nf4"}}
    cfg = build_config({**MINIMAL, "training": training}, [])
    assert make_plan(cfg, T4, model=model).strategy == "fsdp2"
    with pytest.raises(ConfigError, match=r"storage_dtype = uint8 with parallelism.strategy = auto \(planned: fsdp2\)"):
        make_plan(
            build_config({**MINIMAL, "training": training}, ["training.quantization.storage_dtype=uint8"]),
            T4,
            model=model,
        )


def test_tensor_parallel_is_sized_as_split_layers_not_as_zero3():
    model = read_config(ROOT / "recipes" / "models" / "llama-3.1-8b")
    cfg = build_config({**MINIMAL, "training": {"lora": {"enabled": False}, "micro_batch_size": 1}}, [])
    job = sizing_job(cfg, model, Target("cuda", 8, 1, "bfloat16"), micro=1)
    zero3 = strategies.get("zero3").estimate(job, strategies.get("zero3").options(cfg))
    tp = strategies.get("tp").estimate(job, None)
    s = job.shape
    per_rank = s.layer_params * s.layers // 8 + s.embedding_params
    assert (tp.weights, tp.gradients, tp.optimizer, tp.gathered) == (2 * per_rank, 2 * per_rank, 16 * per_rank, 0)
    assert tp.total != zero3.total and zero3.gathered > 0
    planned = make_plan(
        build_config(MINIMAL, ["parallelism.strategy=tp", "training.lora.enabled=false"]), A100, model=model
    ).candidates[0]
    assert planned["strategy"] == "tp" and "gathered" not in planned["breakdown"]


def test_zeropp_explicit_qwz_is_refused_when_auto_dtype_resolves_to_bf16():
    """An A100 computes in bf16, so `dtype: auto` is bf16 there; the rule used to compare the literal field."""
    cfg = build_config({**MINIMAL, "parallelism": {"strategy": "zero++", "deepspeed": {"quantized_weights": True}}}, [])
    with pytest.raises(ConfigError, match=r"training.dtype = bfloat16 \(auto: resolved to bfloat16\): qwZ"):
        make_plan(cfg, A100)
    fp16 = build_config(
        {**MINIMAL, "parallelism": {"strategy": "zero++", "deepspeed": {"quantized_weights": True}}},
        ["training.dtype=float16"],
    )
    assert make_plan(fp16, A100).launcher_config["zero_optimization"]["zero_quantized_weights"] is True


# -- the package's import graph ---------------------------------------------------------------------------

PACKAGES = {
    "ladle": ROOT / "ladle",
    "ladle.flows": ROOT / "flows",
    "ladle.tasks": ROOT / "tasks",
    "ladle.blocks": ROOT / "blocks",
}


def module_files() -> dict[str, Path]:
    out = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of the package that ``name`` imports anywhere: functions and ``TYPE_CHECKING`` blocks included (a
    circle a reader meets is a circle, whether or not Python runs it)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            targets = [base, *(f"{base}.{a.name}" for a in node.names)]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_import_cycles():
    known = module_files()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    cycles, done = [], set()

    def visit(node: str, trail: list[str]) -> None:
        if node in trail:
            cycles.append(" -> ".join(trail[trail.index(node) :] + [node]))
            return
        if node in done:
            return
        for nxt in sorted(graph[node]):
            visit(nxt, [*trail, node])
        done.add(node)

    for name in sorted(graph):
        visit(name, [])
    assert not cycles, cycles[:5]


def test_one_registry_shape_for_strategies_backends_and_compute_targets():
    """The three registries are one ``Registry``: a compute target defined here is accepted (any case), offered
    in the schema and the reference, found by ``compute.get``, and refused by name once gone."""
    from ladle import compute
    from ladle.compute.local import LocalTarget
    from ladle.pluggable import Registry

    assert all(isinstance(r, Registry) for r in (strategies.REGISTRY, backends.REGISTRY, compute.TARGETS))

    class Elsewhere(LocalTarget):
        name = "elsewhere"
        summary = "a test target that runs like local"

    compute.TARGETS.register(Elsewhere)
    try:
        with pytest.raises(ValueError, match="compute target 'elsewhere': the name"):
            compute.TARGETS.register(Elsewhere)
        cfg = build_config(MINIMAL, ["compute.target=ElseWhere"])
        assert cfg.compute.target == "elsewhere" and isinstance(compute.get(cfg), Elsewhere)
        assert "elsewhere" in json_schema()["$defs"]["ComputeConfig"]["properties"]["target"]["enum"]
        assert "elsewhere: a test target that runs like local" in markdown_reference()
    finally:
        compute.TARGETS.unregister("elsewhere")
    with pytest.raises(ConfigError, match=r"compute.target = \"elsewhere\": Input should be 'local', 'slurm' or"):
        build_config(MINIMAL, ["compute.target=elsewhere"])
    with pytest.raises(Exception, match=r"serve.backend = 'vllm': unknown serving backend. Use one of: transformers"):
        backends.get("vllm")


def package_of(module: str) -> str:
    """``ladle.plan.memory`` -> ``ladle.plan``; a root module (``ladle.errors``) is its own."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (ROOT / "ladle" / parts[-1]).is_dir() else module


def test_no_two_packages_import_each_other():
    """Deciding apart from applying, at the scale of packages: the planner, the strategies, the config and the
    compute targets sit below ``ladle.train`` and never import it (its runtime side imports them), and so on
    for every pair (functions and ``TYPE_CHECKING`` blocks included)."""
    known = {name: path for name, path in module_files().items() if name.startswith("ladle.")}
    edges: dict[str, set[str]] = {}
    for name, path in known.items():
        for target in imported(name, path, known):
            a, b = package_of(name), package_of(target)
            if a != b:
                edges.setdefault(a, set()).add(b)
    both = sorted({tuple(sorted((a, b))) for a in edges for b in edges[a] if a in edges.get(b, set())})
    assert not both, both
    assert "ladle.train" not in edges.get("ladle.strategies", set()) | edges.get("ladle.plan", set())


FLOORS = [  # top to bottom: docs/layout.md draws the same picture (flows/, tasks/, blocks/ install as ladle.*)
    ["cli"],
    ["flows"],
    ["tasks"],
    ["blocks"],
    ["fleet"],
    ["plan"],
    ["compute"],
    ["lifecycle"],
    ["train"],
    ["agents"],
    ["rewards"],
    ["serve"],
    ["kubernetes", "data"],
    ["config"],
    ["assets"],
    ["strategies"],
    ["machine"],
    ["platform", "sizing"],
    ["errors", "pluggable", "section"],
]
ARROWS_UP = {  # the imports that go up a floor, each with the reason it stays; a new one fails the test below
    ("config", "serve"): "the schema takes its backend choices and serve.limits from the backends' registry",
    ("serve", "lifecycle"): "a server following the registry reads its aliases and the copies of a version",
    ("train", "plan"): "each rank reads the plan it applies (plan.model.Plan) and the kernels it allows",
}


def part_of(module: str) -> str:
    """``ladle.plan.memory`` -> ``plan``; ``ladle.errors`` -> ``errors``."""
    return module.split(".")[1]


def floor_of(module: str) -> int:
    return next(i for i, floor in enumerate(FLOORS) if part_of(module) in floor)


def test_imports_go_down_the_floors():
    """Each package imports only those below it (functions and ``TYPE_CHECKING`` blocks included), but for the
    three arrows up that ``ARROWS_UP`` names with their reasons: a new one moves the shared thing down or becomes a
    parameter."""
    known = {name: path for name, path in module_files().items() if name.startswith("ladle.")}
    assert {part_of(name) for name in known} == {n for floor in FLOORS for n in floor}, "a package has no floor"
    up: dict[tuple[str, str], list[str]] = {}
    for name, path in known.items():
        for target in imported(name, path, known):
            if floor_of(target) < floor_of(name):
                up.setdefault((part_of(name), part_of(target)), []).append(f"{name} -> {target}")
    unexplained = {arrow: where for arrow, where in up.items() if arrow not in ARROWS_UP}
    assert not unexplained, unexplained
    assert len(ARROWS_UP) <= 3 and set(up) == set(ARROWS_UP), "an arrow in ARROWS_UP that is gone: remove it"


def test_no_strategy_name_is_compared_outside_the_strategies_package():
    """A strategy's behaviour is its traits and methods: code elsewhere never tests ``strategy == "fsdp2"``
    (adding a strategy would then mean finding every such test). Compares against any registered name are
    searched in the source of every other package."""
    import re
    from pathlib import Path

    from ladle import strategies

    names = "|".join(re.escape(n) for n in strategies.REGISTRY)
    compared = re.compile(rf"""(==|!=|\bin)\s*\(?["']({names})["']|["']({names})["']\s*(==|!=)""")
    root = Path(__file__).resolve().parents[2] / "ladle"
    found = [
        f"{path.relative_to(root.parent)}:{n}: {line.strip()}"
        for path in root.rglob("*.py")
        if "strategies" not in path.relative_to(root).parts[:1]
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if compared.search(line)
    ]
    assert found == [], found
