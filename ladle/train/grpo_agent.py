"""GRPO for an agent (``training.rl.environment``): each completion is a multi-turn episode rolled out by
``ladle.agents.episodes`` through the served template and tool parser, its tool blocks masked out of the loss
(``grpo.Rollouts.loss_mask``). The environment is checked and its tool host started before any weight loads;
the host is closed with the run, on every path out.

What a person reads afterwards: each rank's episodes of the last step and the held-out episodes before and after
training (turns, calls, results, how each ended, its rewards), written under the run's ``episodes/`` and logged to
MLflow as artifacts of the same names.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field

from ladle.agents import environments, episodes, programs
from ladle.agents.tool_host import ToolHost
from ladle.platform import storage
from ladle.serve.tools import ToolError
from ladle.train import grpo


@dataclass
class Agent:
    env: environments.Environment
    host: ToolHost | None  # an environment's tool host; None for an agent program ...
    endpoint: programs.Endpoint | None = None  # ... which talks to the live policy's endpoint instead
    logs: dict[str, list[dict]] = field(default_factory=dict)  # episode logs by artifact name
    max_prompt_tokens: int = 0  # data.seq_len: a training episode's rendered prompt at most

    def close(self) -> None:
        if self.host is not None:
            self.host.close()
        if self.endpoint is not None:
            self.endpoint.close()

    def run(self, engine, tokenizer, rows: list[dict], rl, settings: episodes.Settings, seed, first: int = 0):
        """Each row's episode and the seconds spent generating: the environment's, or the agent program's."""
        if self.endpoint is not None:
            timeout = rl.episode.program_timeout_s
            return programs.run(engine, tokenizer, self.endpoint, self.env, rows, settings, seed, first, timeout)
        return episodes.run(engine, tokenizer, self.host, self.env, rows, settings, seed, first)


def start(rl, files: dict[str, str], tokenizer, seq_len: int = 0) -> Agent | None:
    """The environment loaded, the template's tool format checked and the host started (an agent program's
    endpoint instead, its tool format checked at the first request that sends tools); None without one.

    Raises:
        RuntimeError: the environment, the template or the host cannot serve episodes (the reason and the fix).
    """
    if not rl.environment:
        return None
    try:
        env = environments.load(rl.environment, files)
        if env.program:
            return Agent(env, None, programs.Endpoint(wait_s=rl.episode.program_timeout_s), max_prompt_tokens=seq_len)
        if not env.steps:  # a gym-style environment's turns are text: no tool calls to parse
            episodes.tool_format(tokenizer)
    except ToolError as exc:
        raise RuntimeError(
            f"training.rl.environment = {rl.environment!r}: {exc}. Set chat_template (e.g. "
            "ladle://templates/chatml-tools for ChatML models)."
        ) from None
    except environments.EnvironmentError_ as exc:
        raise RuntimeError(str(exc)) from None
    ep = rl.episode
    return Agent(env, ToolHost(env, ep.tool_timeout_s, ep.max_tool_result_tokens), max_prompt_tokens=seq_len)


def sample(agent: Agent, engine, tokenizer, rows: list[dict], rl, seed, first: int) -> grpo.Rollouts:
    """This rank's episodes for ``rows`` as rollouts: the prompt ids with the tools, every token after them,
    and the mask of the model's tokens."""
    eps, seconds = agent.run(
        engine, tokenizer, rows, rl, episodes.Settings.of(rl, False, agent.max_prompt_tokens), seed, first
    )
    return grpo.Rollouts(
        rows=[{**row, "ids": e.prompt_ids} for row, e in zip(rows, eps, strict=True)],
        completion_ids=[e.ids for e in eps],
        sampler_logps=[e.logps for e in eps],
        truncated=[e.ended == "length" for e in eps],
        seconds=seconds,
        masks=[e.mask for e in eps],
        episodes=[e.record() for e in eps],
    )


def greedy(agent: Agent, engine, tokenizer, rows: list[dict], rl) -> tuple[list[dict], list[list[int]], list[dict]]:
    """Held-out episodes, greedy: their rows (prompt ids with the tools), completions and records."""
    eps, _ = agent.run(engine, tokenizer, rows, rl, episodes.Settings.of(rl, True, agent.max_prompt_tokens), None)
    return (
        [{**r, "ids": e.prompt_ids} for r, e in zip(rows, eps, strict=True)],
        [e.ids for e in eps],
        [e.record() for e in eps],
    )


def stats(records: list[dict]) -> dict[str, float]:
    """The step's episodes in figures: turns and calls per episode, and the share that ended each way."""
    n = max(len(records), 1)
    ended = Counter(r["ended"] for r in records)
    out = {
        "episode/turns": sum(r["turns"] for r in records) / n,
        "episode/calls": sum(r["calls"] for r in records) / n,
        "episode/tool_tokens": sum(r["tool_tokens"] for r in records) / n,
    }
    for why in ("answer", "length", "max_turns", *episodes.FAILURES, *episodes.REFUSALS, *programs.PROGRAM_ENDS):
        out[f"episode/ended_{why}"] = ended.get(why, 0) / n
    return out


def with_rewards(records: list[dict], summed) -> list[dict]:
    return [{**r, "reward": None if v != v else float(v)} for r, v in zip(records, summed.tolist(), strict=True)]


PARITY_CASES = 8


def parity_cases(records: list[dict], tools: tuple[dict, ...], max_tokens: int) -> list[dict]:
    """The first turns of up to ``PARITY_CASES`` held-out episodes, greedy on the trained weights: their prompt,
    the tools (an environment's, or those an agent program sent), and the calls the rollout parsed (``ladle.lifecycle.parity.ToolCase``), episodes that called first."""
    cases = []
    for record in records:
        first = record["messages"][0] if record["messages"] else None
        if not first or not first.get("tool_calls"):
            continue
        calls = [
            {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
            for c in first["tool_calls"]
        ]
        sent = record.get("tools", list(tools))  # an agent program's: the tools its first request sent
        cases.append({"messages": record["prompt"], "tools": sent, "calls": calls, "max_tokens": max_tokens})
        if len(cases) == PARITY_CASES:
            break
    return cases


def write_logs(agent: Agent, run_url: str, tracking_uri: str | None, run_id: str | None) -> list[str]:
    """The episode logs as JSON lines under the run's ``episodes/`` and as MLflow artifacts; their names."""
    names = []
    for name, records in agent.logs.items():
        text = "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in records)
        storage.write_bytes(storage.join(run_url, "episodes", name), text.encode())
        if tracking_uri and run_id:
            from mlflow.tracking import MlflowClient

            MlflowClient(tracking_uri).log_text(run_id, text, f"episodes/{name}")
        names.append(name)
    return names
