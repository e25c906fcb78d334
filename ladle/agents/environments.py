"""An agent's environment (``training.rl.environment``), named and checked before any weight loads.

Two of the field's conventions:

- **Tools** (TRL's ``environment_factory``): a class whose public methods are the tools, each one's typed
  signature and docstring its JSON schema (as ``transformers.utils.get_json_schema`` makes it for
  ``apply_chat_template(tools=...)``, in OpenAI's shape).
- **Steps** (gym-style, as OpenEnv and SkyRL's text environments): a class with ``step(action)``, which receives
  each model turn's text and returns the next observation (sent back as a user turn), or ``(observation, reward,
  done)``, or a dict of those; the episode ends when ``done`` is true, and its rewards add up (``env_reward``).

Either may have ``reset(**columns)``, called at each episode's start with the prompt row's columns, whose text (if
any) is added to the prompt's last user turn. ``calculator`` names the built-in one (``ladle.agents.builtin``).

A third shape, the one verifiers, NeMo Gym and ART use, is an **agent program**: a function (plain or ``async``)
``program(client, model, messages, **columns)`` that plays one episode by talking to an OpenAI-compatible endpoint
(``client``: an ``openai.OpenAI``, or ``openai.AsyncOpenAI`` for an ``async`` one) and may return its own reward.
ladle serves the live policy at that endpoint during training and records every call's token ids
(``ladle.agents.programs``); the program's own tools run in its own process (``ladle.agents.program_host``).

The class is imported here only to read its tools; its code runs in the tool host (``ladle.agents.host``), one
subprocess per training rank, never in the training process. A class named by file (``envs/shop.py:Shop``)
travels with the run like a reward's file: its text is read once (``bundle``), is part of the run's fingerprint,
and the host executes that copy on every rank.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import types
from dataclasses import dataclass
from pathlib import Path

from ladle.agents.builtin import ENVIRONMENTS
from ladle.errors import LadleError

FIELD = "training.rl.environment"
NOT_TOOLS = frozenset({"reset", "step"})


class EnvironmentError_(LadleError):  # noqa: N801 - the builtin EnvironmentError is OSError's alias
    """An environment that cannot be used: naming the field, the value and the fix."""


@dataclass(frozen=True)
class Environment:
    """A checked environment: where its class is, its file's text (where it travels with the run), and its
    tools as the chat template takes them."""

    entry: str  # as configured
    target: str  # "package.module:Class" or "path/file.py:Class"
    source: str | None  # the file's text for a class named by file
    tools: tuple[dict, ...]
    resets: bool  # it has reset(**columns)
    steps: bool = False  # gym-style: step(action) takes each turn's text (no tools)
    program: bool = False  # an agent program: a function that talks to an OpenAI endpoint (its tools its own)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]


def target_of(entry: str) -> str:
    return ENVIRONMENTS.get(entry, entry)


def file_of(target: str) -> str | None:
    path = target.rsplit(":", 1)[0]
    return path if path.endswith(".py") else None


def bundle(entry: str | None, root: Path | None = None) -> dict[str, str]:
    """``{path: text}`` of the environment's file (empty for a module or a built-in)."""
    if not entry:
        return {}
    path = file_of(target_of(entry))
    if path is None:
        return {}
    file = Path(path) if root is None or Path(path).is_absolute() else root / path
    if not file.is_file():
        raise EnvironmentError_(
            f"{FIELD} = {entry!r}: no such file {str(file)!r}. Give `path/to/file.py:Class` (relative to where "
            "ladle runs), `package.module:Class`, or `calculator`."
        )
    return {path: file.read_text()}


def digest(entry: str | None, files: dict[str, str]) -> str:
    """What identifies the environment in the run's fingerprint: its name and its file's text."""
    text = files.get(file_of(target_of(entry)) or "", "") if entry else ""
    return hashlib.sha256(f"{entry}\0{text}".encode()).hexdigest()[:16]


def load_class(target: str, source: str | None, entry: str):
    """The class ``target`` names (from ``source`` where it is a file's).

    Raises:
        EnvironmentError_: it cannot be imported, or is not a class.
    """
    found = load_object(target, source, entry)
    if not inspect.isclass(found):
        raise EnvironmentError_(f"{FIELD} = {entry!r}: {target} is not a class.")
    return found


def load_object(target: str, source: str | None, entry: str):
    """The class or function ``target`` names (from ``source`` where it is a file's).

    Raises:
        EnvironmentError_: it cannot be imported, or is neither a class nor a function.
    """
    if ":" not in target:
        known = ", ".join(ENVIRONMENTS)
        raise EnvironmentError_(
            f"{FIELD} = {entry!r}: not a built-in ({known}) and not `path/to/file.py:Class` or `package.module:Class`."
        )
    where, name = target.rsplit(":", 1)
    try:
        if source is not None:
            module = types.ModuleType(f"ladle_environment_{Path(where).stem}")
            module.__file__ = where
            exec(compile(source, where, "exec"), module.__dict__)  # the run's own copy of the user's file
        else:
            module = importlib.import_module(where)
    except Exception as exc:
        raise EnvironmentError_(
            f"{FIELD} = {entry!r}: cannot import it ({type(exc).__name__}: {exc}). Make {where} importable "
            "(installed, or a file path ending in .py), then run again."
        ) from exc
    found = getattr(module, name, None)
    if not (inspect.isclass(found) or inspect.isfunction(found)):
        raise EnvironmentError_(
            f"{FIELD} = {entry!r}: {where} has no class or function {name!r}. Check the name: an environment is a "
            "class, an agent program a function."
        )
    return found


def check_program(fn, entry: str) -> None:
    """An agent program must take ``(client, model, messages, **columns)``.

    Raises:
        EnvironmentError_: its signature cannot take them.
    """
    try:
        inspect.signature(fn).bind_partial(object(), "model", [])  # the columns it names may be required
    except TypeError as exc:
        raise EnvironmentError_(
            f"{FIELD} = {entry!r}: the agent program {fn.__name__}{inspect.signature(fn)} cannot be called as "
            f"program(client, model, messages, **columns) ({exc}). Give it those three leading parameters; the "
            "prompt row's columns come as keyword arguments it names (or **columns)."
        ) from None


def tool_methods(cls) -> list[tuple[str, object]]:
    """The class's tools: its public methods other than ``reset``, in the order they are defined."""
    found = []
    for name, member in cls.__dict__.items():
        if name.startswith("_") or name in NOT_TOOLS or not callable(member):
            continue
        found.append((name, getattr(cls, name)))
    return found


def load(entry: str, files: dict[str, str]) -> Environment:
    """The environment ``entry`` names, its tools' schemas made and checked.

    Raises:
        EnvironmentError_: it cannot be imported, has no tools, or a tool's signature or docstring cannot make a
            schema (naming the tool and the fix).
    """
    from transformers.utils import get_json_schema

    target = target_of(entry)
    path = file_of(target)
    source = None
    if path is not None:
        if path not in files:
            raise EnvironmentError_(f"{FIELD} = {entry!r}: the file did not travel with the run")
        source = files[path]
    cls = load_object(target, source, entry)
    if inspect.isfunction(cls):
        check_program(cls, entry)
        return Environment(entry, target, source, (), False, program=True)
    resets = callable(getattr(cls, "reset", None))
    if callable(getattr(cls, "step", None)):
        return Environment(entry, target, source, (), resets, steps=True)
    methods = tool_methods(cls)
    if not methods:
        raise EnvironmentError_(
            f"{FIELD} = {entry!r}: {cls.__name__} has no public method to offer as a tool and no step(action). Give "
            "it methods with typed arguments and a docstring (an Args section), as TRL's environment_factory "
            "expects, or a gym-style step(action)."
        )
    tools = []
    for name, method in methods:
        try:
            schema = get_json_schema(method)
        except Exception as exc:  # noqa: BLE001 - transformers' parsing errors carry the reason
            raise EnvironmentError_(
                f"{FIELD} = {entry!r}: tool {cls.__name__}.{name} cannot be described to the model ({exc}). Give "
                "every argument a type hint and the method a docstring with an Args section describing each one."
            ) from None
        schema["function"]["parameters"].get("properties", {}).pop("self", None)
        # OpenAI's shape, what a client sends the server: its return type is not a field there, so the prompt the
        # rollouts render is the prompt the server renders for the same tools.
        schema["function"].pop("return", None)
        tools.append(schema)
    return Environment(entry, target, source, tuple(tools), resets)
