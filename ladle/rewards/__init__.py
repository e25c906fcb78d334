"""Reward functions of ``training.rl.rewards`` (``training.objective: grpo``): loaded, checked and called the way
TRL's ``GRPOTrainer`` calls them, so a reward written for TRL runs here unchanged.

A reward is ``fn(prompts=..., completions=..., completion_ids=..., **columns) -> list[float | None]``: one value per
completion (``None``: not applicable to it), the prompts as the data gave them (a string, or a message list), the
completions as strings for string prompts and as ``[{"role": "assistant", "content": ...}]`` for message lists,
and every other column of the prompt's row as a keyword argument (one value per completion).

A reward named by a file (``my_rewards.py:exact``) travels with the run: the launcher reads the file once
(``bundle``) and the training spec carries its text to every rank, on this machine, a Slurm node or a Kubernetes
pod; its digest is part of the run's fingerprint (``digest``). Where a reward cannot be imported, has the wrong
signature, raises, or returns the wrong number of values, the run stops with one error naming it
(``RewardError``), its last checkpoint kept.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import math
import re
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from ladle.config.training import BUILTIN_REWARDS, EpisodeConfig, RewardConfig
from ladle.errors import LadleError


class RewardSet(BaseModel):
    """What scores completions outside the training processes (the evaluate stage): the rewards, their files'
    text, and how long a completion may be."""

    rewards: list[RewardConfig]
    files: dict[str, str] = {}
    max_completion_tokens: int = 512
    environment: str | None = None  # an agent's (training.rl.environment): the evaluation runs episodes
    episode: EpisodeConfig = EpisodeConfig()

    def loaded(self) -> list[Reward]:
        return load_all(self.rewards, self.files)

    @classmethod
    def of_run(cls, training, files: dict[str, str]) -> RewardSet | None:
        """A run's rewards (``training``: its config section, ``files``: what ``bundle`` read); None unless grpo."""
        if training.objective != "grpo":
            return None
        rl = training.rl
        return cls(
            rewards=rl.rewards,
            files=files,
            max_completion_tokens=rl.max_completion_tokens,
            environment=rl.environment,
            episode=rl.episode,
        )


class RewardError(LadleError):
    """A reward function cannot be used or failed: the run stops, its last checkpoint kept."""


@dataclass
class Reward:
    """One loaded reward: its name (as logged: ``reward/NAME``), weight and function."""

    name: str
    weight: float
    fn: Callable
    accepts_any: bool  # takes **kwargs: every column is passed, as TRL passes them
    params: frozenset[str]  # the names it takes (a column it names is passed when the data has it)
    required: frozenset[str] = frozenset()  # the names it takes without a default: columns every row must have

    failed: int = 0  # completions whose call raised, since the count was last read (``take_failed``)

    def __call__(
        self, prompts: list, completions: list, completion_ids: list[list[int]], columns: dict, state=None
    ) -> list:
        """This reward's values for ``completions``, checked: one finite float or None each.

        A call that raises is made again one completion at a time: a completion whose own call raises scores None
        (the reward does not apply to it) and is counted (``failed``; the step's ``reward/NAME/failed``), so one
        model output (a JSON nested past Python's recursion limit, a bad schema in one row) cannot end a run.

        Raises:
            RewardError: it raised on every completion (the function, the exception and the first row named), or
                returned the wrong number or kind of values.
        """
        offered = {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **columns}
        try:
            return checked(self.name, self.fn(**self.kwargs(offered, state)), len(completions))
        except RewardError:
            raise
        except Exception:  # noqa: BLE001 - a user's function: which completion raised is found below
            pass
        values: list[float | None] = []
        first: tuple[int, Exception] | None = None
        for i in range(len(completions)):
            one = {k: v[i : i + 1] for k, v in offered.items()}
            try:
                values += checked(self.name, self.fn(**self.kwargs(one, state)), 1)
            except RewardError:
                raise
            except Exception as exc:  # noqa: BLE001 - this completion's score, not the run's end
                first = first or (i, exc)
                values.append(None)
                self.failed += 1
        if first is not None and all(v is None for v in values):
            i, exc = first
            raise RewardError(
                f"training.rl.rewards: {self.name} raised {type(exc).__name__}: {exc} on every one of its "
                f"{len(completions)} completions (the first: row {i}, prompt {shown(prompts[i])!r}). Fix the "
                "function; the run stopped at this step, its last checkpoint kept."
            ) from exc
        return values

    def kwargs(self, offered: dict, state=None) -> dict:
        """What the function is called with: every value offered (``**kwargs``) or those it names; TRL's
        ``trainer_state`` (a ``transformers.TrainerState``: ``global_step``, ``max_steps``) where it takes it."""
        if state is not None and (self.accepts_any or "trainer_state" in self.params):
            offered = {**offered, "trainer_state": state}
        return offered if self.accepts_any else {k: v for k, v in offered.items() if k in self.params}

    def take_failed(self) -> int:
        """The completions that raised since the last call (and the count starts again)."""
        count, self.failed = self.failed, 0
        return count


def shown(prompt, limit: int = 80) -> str:
    """A prompt (text, or a conversation's last turn) cut to ``limit`` characters, for an error line."""
    text = prompt if isinstance(prompt, str) else str((prompt or [{}])[-1].get("content", prompt))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def checked(name: str, values, count: int) -> list[float | None]:
    """``values`` as one float (or None) per completion; numpy's numbers and arrays are numbers too (a TRL reward
    often returns ``np.float32`` values or an array).

    Raises:
        RewardError: naming the reward, what it returned and what was expected.
    """
    if hasattr(values, "tolist") and not isinstance(values, list | tuple):  # a numpy array or a tensor
        values = values.tolist()
    if not isinstance(values, list | tuple) or len(values) != count:
        got = f"{len(values)} values" if isinstance(values, list | tuple) else type(values).__name__
        raise RewardError(
            f"training.rl.rewards: {name} returned {got} for {count} completions; a reward returns a list with one "
            "float (or None: not applicable) per completion, in order."
        )
    out: list[float | None] = []
    for i, value in enumerate(values):
        if value is None:
            out.append(None)
            continue
        number = value.item() if hasattr(value, "item") and not isinstance(value, bool) else value  # np.float32
        if isinstance(number, bool) or not isinstance(number, int | float) or not math.isfinite(float(number)):
            raise RewardError(
                f"training.rl.rewards: {name} returned {value!r} for completion {i}; each value must be a finite "
                "float, or None when the reward does not apply."
            )
        out.append(float(number))
    return out


def bundle(cfg_rewards: list[RewardConfig], root: Path | None = None) -> dict[str, str]:
    """The text of every reward named by a file (``path.py:function``), by its path as written: what travels
    with the run.

    Raises:
        RewardError: a file that does not exist.
    """
    files = {}
    for reward in cfg_rewards:
        path = file_of(reward.fn)
        if path is None:
            continue
        found = (root or Path.cwd()) / path if not Path(path).is_absolute() else Path(path)
        if not found.is_file():
            raise RewardError(
                f"training.rl.rewards: fn = {reward.fn!r}: no file {found}. Give the path of a Python file "
                "(relative to where ladle runs) and a function in it, e.g. my_rewards.py:exact."
            )
        files[path] = found.read_text(encoding="utf-8")
    return files


def digest(files: dict[str, str], cfg_rewards: list[RewardConfig]) -> str:
    """What the rewards are: their settings and the text of their files (part of the run's fingerprint)."""
    h = hashlib.sha256(json.dumps([r.model_dump(mode="json") for r in cfg_rewards], sort_keys=True).encode())
    for path in sorted(files):
        h.update(path.encode() + b"\0" + files[path].encode())
    return h.hexdigest()[:24]


def file_of(fn: str) -> str | None:
    """The file a ``path.py:function`` entry names; None for a module entry or a built-in."""
    target = fn.rsplit(":", 1)[0] if ":" in fn else ""
    return target if target.endswith(".py") else None


def load_all(cfg_rewards: list[RewardConfig], files: dict[str, str]) -> list[Reward]:
    """Every reward of ``training.rl.rewards``, loaded and its signature checked.

    Raises:
        RewardError: one that cannot be imported or does not take prompts and completions.
    """
    return [load(reward, files) for reward in cfg_rewards]


def load(reward: RewardConfig, files: dict[str, str]) -> Reward:
    if reward.fn in BUILTIN_REWARDS:
        return Reward(reward.fn, reward.weight, builtin(reward), True, frozenset())
    if ":" not in reward.fn:
        raise RewardError(
            f"training.rl.rewards: fn = {reward.fn!r}: not a built-in ({', '.join(BUILTIN_REWARDS)}) and not "
            "`path/to/file.py:function` or `package.module:function`."
        )
    if reward.args:
        raise RewardError(
            f"training.rl.rewards: fn = {reward.fn!r} has args {sorted(reward.args)}: only built-ins take args; "
            "a function receives the data's columns. Remove args."
        )
    target, name = reward.fn.rsplit(":", 1)
    module = module_from(reward.fn, target, files)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(
            f"training.rl.rewards: fn = {reward.fn!r}: {target} has no function {name!r}. Check the name."
        )
    return Reward(name, reward.weight, fn, *accepted(reward.fn, fn))


def module_from(entry: str, target: str, files: dict[str, str]):
    path = file_of(entry)
    try:
        if path is None:
            return importlib.import_module(target)
        if path not in files:
            raise RewardError(f"training.rl.rewards: fn = {entry!r}: the file did not travel with the run")
        module = types.ModuleType(f"ladle_reward_{Path(path).stem}")
        module.__file__ = path
        exec(compile(files[path], path, "exec"), module.__dict__)  # the run's own copy of the user's file
        return module
    except RewardError:
        raise
    except Exception as exc:
        raise RewardError(
            f"training.rl.rewards: fn = {entry!r}: cannot import it ({type(exc).__name__}: {exc}). Make "
            f"{target} importable (installed, or a file path ending in .py), then run again."
        ) from exc


def accepted(entry: str, fn: Callable) -> tuple[bool, frozenset[str], frozenset[str]]:
    """Whether ``fn`` takes every keyword (``**kwargs``), the names it takes, and those of them without a
    default (a parameter with a default is a column passed when present, never demanded).

    Raises:
        RewardError: it cannot be called with ``completions`` by name.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError) as exc:
        raise RewardError(f"training.rl.rewards: fn = {entry!r}: no signature to check ({exc})") from exc
    any_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = frozenset(n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    required = {
        n for n, p in params.items() if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    }
    # TRL passes prompts= too, so a TRL reward takes it (or **kwargs); ladle passes only what a function names,
    # so one that reads just the completions and a column runs as well.
    if ("completions" not in named and not any_kw) or any(p.kind is p.POSITIONAL_ONLY for p in params.values()):
        raise RewardError(
            f"training.rl.rewards: fn = {entry!r} has the signature {inspect.signature(fn)}; a reward is called as "
            "TRL calls it, fn(prompts=..., completions=..., completion_ids=..., **columns). Give it those "
            "parameters (or **kwargs)."
        )
    return any_kw, named, frozenset(required)


PASSED = frozenset(
    {"prompts", "completions", "completion_ids", "trainer_state", "episodes"}
)  # what ladle passes, not columns


def columns_needed(cfg_rewards: list[RewardConfig], files: dict[str, str]) -> list[str] | None:
    """The data columns the rewards read by name (None: some reward takes every column, ``**kwargs``)."""
    names: set[str] = set()
    for reward in cfg_rewards:
        if reward.fn in BUILTIN_REWARDS:
            if "column" in reward.args:
                names.add(str(reward.args["column"]))
            continue
        loaded = load(reward, files)
        if loaded.accepts_any:
            return None
        names |= loaded.required - PASSED
    return sorted(names)


def completions_of(tokenizer, rows: list[dict], completion_ids: list[list[int]]) -> list:
    """The completions as TRL hands them to rewards: strings after string prompts, one assistant message after
    message-list prompts (special tokens skipped)."""
    texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    return [
        t if isinstance(row["prompt"], str) else [{"role": "assistant", "content": t}]
        for row, t in zip(rows, texts, strict=True)
    ]


def table(
    loaded: list[Reward],
    tokenizer,
    rows: list[dict],
    completion_ids: list[list[int]],
    state=None,
    episodes: list[dict] | None = None,
):
    """``[completions, rewards]`` (a float32 tensor): each reward's value on the completions of ``rows`` (each row
    a prepared prompt row: its prompt and columns), NaN where it does not apply. ``state``: what a reward taking
    TRL's ``trainer_state`` receives (``trainer_state(step, steps)``), None outside training.

    ``episodes`` (an agent's, ``ladle.agents.episodes``): each completion is then its episode's messages after
    the prompt (the assistant's turns with their ``tool_calls``, the tool results), as TRL hands a tool-using
    completion to rewards, and a reward naming ``episodes`` receives each episode's record (its turns, calls,
    results and how it ``ended``)."""
    import torch

    prompts = [row["prompt"] for row in rows]
    if episodes is None:
        completions = completions_of(tokenizer, rows, completion_ids)
    else:
        completions = [episode["messages"] for episode in episodes]
    names = sorted({k for row in rows for k in row.get("columns", {})})
    columns = {k: [row.get("columns", {}).get(k) for row in rows] for k in names}
    if episodes is not None:
        columns["episodes"] = episodes
    out = torch.full((len(rows), len(loaded)), float("nan"), dtype=torch.float32)
    for j, reward in enumerate(loaded):
        values = reward(prompts, completions, completion_ids, columns, state)
        out[:, j] = torch.tensor([float("nan") if v is None else v for v in values], dtype=torch.float32)
    return out


def trainer_state(step: int, steps: int):
    """TRL's ``trainer_state`` for a reward at ``step`` (0-based, the step being taken) of ``steps``: a
    ``transformers.TrainerState`` as TRL's ``GRPOTrainer`` passes ``self.state`` (rewards read ``global_step``)."""
    from transformers import TrainerState

    return TrainerState(global_step=step, max_steps=steps)


def weighted_sum(loaded: list[Reward], values):
    """Each completion's weighted sum of its rewards (NaN where none applies), from ``table``'s output."""
    import torch

    summed = (values * torch.tensor([r.weight for r in loaded], dtype=torch.float32)).nansum(dim=1)
    summed[torch.isnan(values).all(dim=1)] = float("nan")
    return summed


# Built-ins -------------------------------------------------------------------------------------------------------


def text_of(completion) -> str:
    """A completion's text: a string, or the content of the last assistant turn of a message list (an agent's
    episode: its final answer, after its tool calls and their results)."""
    if isinstance(completion, str):
        return completion
    answers = [turn for turn in completion if turn.get("role", "assistant") == "assistant"]
    return str(answers[-1].get("content") or "") if answers else ""


def builtin(reward: RewardConfig) -> Callable:
    """The built-in ``reward.fn`` bound to its ``args``.

    Raises:
        RewardError: a missing or malformed arg, naming it and the fix.
    """
    args, name = reward.args, reward.fn
    expected = {
        "exact_match": {"column"},
        "regex": {"pattern"},
        "length": {"max_tokens"},
        "json_schema": set(),
        "env_reward": set(),
    }
    unknown = set(args) - expected[name] - ({"schema", "column"} if name == "json_schema" else set())
    missing = expected[name] - set(args)
    if unknown or missing or (name == "json_schema" and ("schema" in args) == ("column" in args)):
        want = {
            "exact_match": "{column: NAME}",
            "regex": "{pattern: REGEX}",
            "length": "{max_tokens: N}",
            "env_reward": "none",
        }.get(name, "{schema: {...}} or {column: NAME}")
        raise RewardError(f"training.rl.rewards: {name} has args {dict(args)}; it takes args: {want}.")
    if name == "exact_match":
        return exact_match(str(args["column"]))
    if name == "env_reward":
        return env_reward
    if name == "regex":
        try:
            return regex(re.compile(str(args["pattern"])))
        except re.error as exc:
            raise RewardError(f"training.rl.rewards: regex pattern {args['pattern']!r}: {exc}. Fix it.") from exc
    if name == "length":
        if not isinstance(args["max_tokens"], int) or args["max_tokens"] < 1:
            raise RewardError(f"training.rl.rewards: length max_tokens = {args['max_tokens']!r}: a positive integer")
        return length(int(args["max_tokens"]))
    return json_schema(args.get("schema"), args.get("column"))


def env_reward(completions, episodes=None, **kwargs):
    """A gym-style environment's own rewards of each episode, summed, or what an agent program returned (None
    where it gave none)."""
    if episodes is None:
        raise KeyError("env_reward scores an agent's episodes: set training.rl.environment")
    return [e.get("env_reward") for e in episodes]


def exact_match(column: str) -> Callable:
    def score(completions, **kwargs):
        if column not in kwargs:
            raise KeyError(f"the data has no column {column!r} (columns: {sorted(kwargs)})")
        return [
            float(text_of(c).strip() == str(ref).strip()) for c, ref in zip(completions, kwargs[column], strict=True)
        ]

    return score


def regex(pattern: re.Pattern) -> Callable:
    def score(completions, **kwargs):
        return [float(pattern.match(text_of(c)) is not None) for c in completions]

    return score


def length(max_tokens: int) -> Callable:
    def score(completions, completion_ids, **kwargs):
        return [-max(0, len(ids) - max_tokens) / max_tokens for ids in completion_ids]

    return score


def json_schema(schema: dict | None, column: str | None) -> Callable:
    import jsonschema

    def score(completions, **kwargs):
        schemas = kwargs[column] if column else [schema] * len(completions)
        out = []
        for completion, wanted in zip(completions, schemas, strict=True):
            try:
                value = json.loads(text_of(completion))
                jsonschema.validate(value, json.loads(wanted) if isinstance(wanted, str) else wanted)
                out.append(1.0)
            except (ValueError, jsonschema.ValidationError):
                out.append(0.0)
        return out

    return score
