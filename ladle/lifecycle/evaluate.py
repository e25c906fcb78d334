"""Evaluate stage: the task metric and eval loss of a model folder on the held-out split.

Two measures, both on data the model never trained on:

- ``loss``: token-weighted next-token loss over the prepared eval rows (the same rows and the same sum the
  trainer's ``eval_loss_after`` uses), lower is better;
- ``eval.metric``: ``exact_match`` (each held-out conversation is asked without its last, assistant, turn
  through the tokenizer's chat template exactly as the server asks it, and the greedy answer must equal that
  turn, surrounding whitespace aside), or a user's ``module:function`` called with the model folder and the
  conversations.

Any model folder is scored the same way: the base, the new model, and the champion it must beat. A score is
cached by (model files, dataset fingerprint, metric, examples), so the base and the champion are scored once
per dataset and "before" costs nothing on the next run of the same data.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, Field

from ladle.assets import ladle_home
from ladle.config import EvalConfig
from ladle.data.prepare import PreparedDataset
from ladle.data.probe import PROBE_BUILTIN, answered, load_probe, probe_digest, probe_file  # noqa: F401 - re-exported
from ladle.errors import LadleError
from ladle.machine.placement import load_placed
from ladle.platform import storage
from ladle.platform.files import write_atomic
from ladle.sizing import eval_loss_rows

EVAL_VERSION = "3"  # bump when a score for the same inputs would change (3: preference pairs)


class Score(BaseModel):
    values: dict[str, float] = Field(description="Metric name -> value (`loss`, and `eval.metric`).")
    correct: int | None = Field(None, description="Exact answers (exact_match only).")
    total: int = Field(0, description="Held-out conversations scored by the task metric.")
    answers: list[str] = Field(default_factory=list, description="Greedy answers, in sample order (the first few).")
    probe: list[dict] = Field(
        default_factory=list, description="eval.probe's questions with the greedy answer and whether it was right."
    )


class Evaluation(BaseModel):
    metric: str = Field("exact_match", description="The task metric (`eval.metric`).")
    greater_is_better: bool = True
    examples: int = Field(description="Held-out conversations scored (0: none available, the metric is null).")
    eval_rows: int = Field(0, description="Packed eval rows the loss is summed over.")
    base: dict[str, float] = Field(default_factory=dict, description="The base model's scores.")
    model: dict[str, float] = Field(default_factory=dict, description="The fine-tuned (merged) model's scores.")
    accuracy_before: float | None = Field(None, description="The base model's exact match on the same prompts.")
    accuracy_after: float | None = Field(None, description="The fine-tuned (merged) model's exact match.")
    base_cached: bool = Field(False, description="The base score came from the cache (same base and data).")
    examples_shown: list[dict] = Field(
        default_factory=list, description="A few prompts with expected and given answers."
    )
    probe_questions: int = Field(0, description="eval.probe's questions (0: no probe).")
    probe_shown: list[dict] = Field(
        default_factory=list, description="Each probe question with the base's and the new model's answers."
    )
    note: str = ""


def load_samples(prepared: PreparedDataset, limit: int) -> list[list[dict]]:
    """Up to ``limit`` held-out conversations (each ending with the reference assistant turn)."""
    if not prepared.eval_samples or limit <= 0:
        return []
    text = storage.read_bytes(storage.join(prepared.url, prepared.eval_samples)).decode("utf-8")
    return [json.loads(line)["messages"] for line in text.splitlines()[:limit] if line.strip()]


def prompt_of(messages: list[dict]) -> list[dict]:
    """The conversation up to (not including) its last, reference turn."""
    return messages[:-1]


def load_model(model_dir: Path):
    """``(model, tokenizer, device)``: bf16 on GPUs, float32 on CPU, in eval mode; ``device`` takes the inputs.

    A model larger than one GPU is spread over every visible GPU (``load_placed``). Inside ``one_load`` a
    folder is loaded once, whatever asks for it (a score's metric and its loss)."""
    key = str(Path(model_dir).resolve())
    if not _SHARED.get("open"):
        return load_placed(Path(model_dir))
    if _SHARED.get("key") != key:
        _SHARED.update(key=key, value=load_placed(Path(model_dir)))
    return _SHARED["value"]


_SHARED: dict = {}


@contextlib.contextmanager
def one_load():
    """Loads inside share the model; at the end it is let go, so the next model (the champion's, the server's)
    does not meet this one in memory."""
    _SHARED.clear()
    _SHARED["open"] = True
    try:
        yield
    finally:
        _SHARED.clear()


def greedy_answers(
    model_dir: Path, prompts: list[list[dict]], batch_size: int, max_new_tokens: Callable[..., int]
) -> list[str]:
    """Greedy answers of the model in ``model_dir`` to each prompt (a conversation up to the turn to answer),
    asked through the tokenizer's chat template exactly as the server asks it; batched with left padding,
    stopping at EOS or ``max_new_tokens(tokenizer, indices of the batch's prompts)``."""
    import torch

    model, tokenizer, device = load_model(model_dir)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    answers: list[str] = []
    for start in range(0, len(prompts), batch_size):
        batch = prompts[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in batch]
        enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(device)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=max_new_tokens(tokenizer, list(range(start, start + len(batch)))),
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = out[:, enc.input_ids.shape[1] :]
        answers += [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    return answers


def exact_match(model_dir: Path, samples: list[list[dict]], batch_size: int = 32, shown: int = 5) -> Score:
    """Greedy answers of the model in ``model_dir`` to each sample's prompt, scored against its last turn.

    Generation stops at EOS or one token past the longest reference in the batch: a longer answer cannot be
    exact anyway.
    """

    def longest_reference(tokenizer, rows: list[int]) -> int:
        return max(len(tokenizer(samples[i][-1]["content"], add_special_tokens=False).input_ids) for i in rows) + 1

    answers = greedy_answers(model_dir, [prompt_of(m) for m in samples], batch_size, longest_reference)
    correct = sum(answer.strip() == m[-1]["content"].strip() for answer, m in zip(answers, samples, strict=False))
    return Score(
        values={"exact_match": round(correct / max(1, len(samples)), 4)},
        correct=correct,
        total=len(samples),
        answers=answers[:shown],
    )


def probe_score(model_dir: Path, cfg: EvalConfig) -> tuple[float, list[dict]]:
    """The fraction of ``eval.probe``'s questions the model answers right, and each question's answer."""
    questions = load_probe(cfg.probe)
    prompts = [[{"role": "user", "content": q["question"]}] for q in questions]
    answers = greedy_answers(model_dir, prompts, cfg.batch_size, lambda tok, rows: cfg.probe_max_new_tokens)
    marks = [answered(a, q["answers"]) for a, q in zip(answers, questions, strict=True)]
    detail = [
        {"question": q["question"], "answer": a, "right": m} for q, a, m in zip(questions, answers, marks, strict=True)
    ]
    return round(sum(marks) / len(marks), 4), detail


def is_pairs(prepared: PreparedDataset) -> bool:
    return prepared.report.format == "preference"


def is_prompts(prepared: PreparedDataset) -> bool:
    return prepared.report.format == "prompt"


def load_prompt_rows(prepared: PreparedDataset, limit: int) -> list[dict]:
    """Up to ``limit`` held-out prompt rows (training.objective: grpo): ids, prompt and columns."""
    from ladle.data.prompts import read_split

    if limit <= 0:
        return []
    return read_split(prepared.url, prepared.shards.get("eval", []))[:limit]


def shown_prompt(prompt) -> str:
    return prompt if isinstance(prompt, str) else str(prompt[-1].get("content"))


def reward_score(model_dir: Path, rows: list[dict], rewards, batch_size: int) -> Score:
    """``reward``: the mean weighted reward of the model's greedy completion of each held-out prompt, scored by
    the run's rewards as in training (a completion no reward applies to is left out of the mean)."""
    import torch

    from ladle import rewards as reward_fns
    from ladle.data.tokenize import stop_ids

    model, tokenizer, device = load_model(model_dir)
    if rewards.environment:
        return episode_score(model, tokenizer, device, rows, rewards, batch_size)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = stop_ids(model, tokenizer)  # training's engine's rule: a completion ends at, and keeps, its EOS
    completions: list[list[int]] = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start : start + batch_size]
        width = max(len(r["ids"]) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, row in enumerate(batch):
            ids[i, width - len(row["ids"]) :] = torch.tensor(row["ids"])
            mask[i, width - len(row["ids"]) :] = 1
        with torch.no_grad():
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=rewards.max_completion_tokens,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=sorted(stops),
            )
        for row in out[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in stops), None)
            completions.append(row if end is None else row[: end + 1])
    loaded = rewards.loaded()
    summed = reward_fns.weighted_sum(loaded, reward_fns.table(loaded, tokenizer, rows, completions))
    kept = summed[~torch.isnan(summed)]
    texts = reward_fns.completions_of(tokenizer, rows, completions)
    return Score(
        values={"reward": round(float(kept.mean()), 4) if len(kept) else 0.0},
        total=len(rows),
        answers=[reward_fns.text_of(t) for t in texts[:5]],
    )


def episode_score(model, tokenizer, device, rows: list[dict], rewards, batch_size: int) -> Score:
    """An agent's ``reward``: one greedy episode per held-out prompt, run as training runs them (ladle's engine,
    the template's tool format, the tools in their host), scored by the run's rewards on the whole episode."""
    import torch

    from ladle import rewards as reward_fns
    from ladle.agents import environments, episodes, held_out

    env = environments.load(rewards.environment, rewards.files)
    ep = rewards.episode
    settings = episodes.Settings(ep.max_turns, rewards.max_completion_tokens, ep.max_tool_result_tokens)
    done = held_out.play(model, tokenizer, device, rows, env, settings, ep, batch_size)
    scored = [{**r, "ids": e.prompt_ids} for r, e in zip(rows, done, strict=True)]
    records = [e.record() for e in done]
    loaded = rewards.loaded()
    table = reward_fns.table(loaded, tokenizer, scored, [e.ids for e in done], episodes=records)
    summed = reward_fns.weighted_sum(loaded, table)
    kept = summed[~torch.isnan(summed)]
    return Score(
        values={"reward": round(float(kept.mean()), 4) if len(kept) else 0.0},
        total=len(rows),
        answers=[reward_fns.text_of(r["messages"]) for r in records[:5]],
    )


def eval_rows(prepared: PreparedDataset) -> dict | None:
    """The packed eval rows as tensors; None without any."""
    import torch

    from ladle.data.packing import read_rows

    shards = prepared.shards.get("eval", [])
    if not shards or is_prompts(prepared):  # prompt rows have no tokens to score a loss on
        return None
    parts = [read_rows(storage.read_bytes(storage.join(prepared.url, shard))) for shard in shards]
    return {key: torch.tensor([v for part in parts for v in part[key]], dtype=torch.long) for key in parts[0]}


def eval_loss(model_dir: Path, prepared: PreparedDataset) -> float | None:
    """Token-weighted next-token loss of the model over every packed eval row (for preference pairs, over the
    chosen completions only: how likely the model finds the preferred answers); None without eval rows."""
    import torch

    from ladle.data.packing import IGNORE
    from ladle.train.loss import token_loss
    from ladle.train.preference import sides

    data = eval_rows(prepared)
    if data is None:
        return None
    if is_pairs(prepared):  # the chosen side's tokens only
        data["labels"] = data["labels"].masked_fill(sides(data["position_ids"]) > 0, IGNORE)
    model, _, device = load_model(model_dir)
    total, tokens = 0.0, 0
    with torch.no_grad():
        step = eval_loss_rows(data["input_ids"].shape[1], model.config.get_text_config().vocab_size)
        for start in range(0, len(data["input_ids"]), step):
            rows = list(range(start, min(start + step, len(data["input_ids"]))))
            loss, count = token_loss(model, data, rows, device)
            total, tokens = total + float(loss), tokens + count
    return round(total / max(tokens, 1), 6)


def pair_logps(model_dir: Path, prepared: PreparedDataset) -> list[list[float]]:
    """The model's summed log-probability of each held-out pair's chosen and rejected completion, cached per
    (model files, data)."""
    import torch

    from ladle.train import preference

    key = hashlib.sha256(f"ladle-pairs/{EVAL_VERSION}/{prepared.fingerprint}/{files_key(model_dir)}".encode())
    cache = ladle_home() / "eval-cache" / f"pairs-{key.hexdigest()[:24]}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    data = eval_rows(prepared)
    model, _, device = load_model(model_dir)
    table: list[list[float]] = []
    with torch.no_grad():
        step = eval_loss_rows(data["input_ids"].shape[1], model.config.get_text_config().vocab_size)
        for start in range(0, len(data["input_ids"]), step):
            rows = list(range(start, min(start + step, len(data["input_ids"]))))
            table += preference.pair_logps(model, data, rows, device)[0].double().tolist()
    write_atomic(cache, json.dumps(table))
    return table


def preference_accuracy(model: list[list[float]], reference: list[list[float]]) -> float:
    """Held-out pairs whose implicit reward (the log-ratio against the reference) ranks chosen above rejected,
    a tie counting half: the reference itself scores 0.5."""
    import torch

    from ladle.train.preference import ranked_right

    if len(model) != len(reference):
        raise ValueError(f"{len(model)} pairs scored against {len(reference)} reference pairs")
    ratios = torch.tensor(model, dtype=torch.float64) - torch.tensor(reference, dtype=torch.float64)
    if len(ratios) == 0:
        return 0.0
    return round(float(ranked_right(ratios[:, 0] - ratios[:, 1]).mean()), 4)


def user_metric(entry_point: str) -> Callable[[Path, list[list[dict]]], float]:
    """The function an ``eval.metric`` entry point names.

    Raises:
        LadleError: the module or function cannot be imported.
    """
    module_name, _, attr = entry_point.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise LadleError(
            f"eval.metric = {entry_point!r}: cannot import it ({err}). Make `{module_name}` importable (installed, "
            "or on PYTHONPATH) and define `{attr}(model_dir, conversations) -> float` in it."
        ) from None
    return fn


def task_score(cfg: EvalConfig, model_dir: Path, samples: list[list[dict]]) -> Score:
    """``eval.metric`` of ``model_dir`` on ``samples``.

    Raises:
        LadleError: a user metric that does not return a finite number.
    """
    if cfg.metric in ("exact_match", "preference_accuracy"):  # the pairs' task metric, shown beside their accuracy
        return exact_match(model_dir, samples, cfg.batch_size)
    value = user_metric(cfg.metric)(model_dir, samples)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LadleError(f"eval.metric = {cfg.metric!r}: returned {value!r}; it must return a finite number (a float).")
    return Score(values={cfg.metric: float(value)}, total=len(samples))


def files_key(model_dir: Path) -> str:
    """The model's config and weight files (names, sizes, times)."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for file in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        digest.update(f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}".encode())
    return digest.hexdigest()


def model_key(
    model_dir: Path,
    prepared: PreparedDataset,
    cfg: EvalConfig,
    examples: int,
    reference: Path | None = None,
    rewards=None,
) -> str:
    """Identity of a score: the model's files, the data, the metric (and the pairs' reference model's files)."""
    probe = f"{probe_digest(cfg.probe)}/{cfg.probe_max_new_tokens}" if cfg.probe else "-"
    against = files_key(reference) if reference is not None else "-"
    digest = hashlib.sha256(
        f"ladle-eval/{EVAL_VERSION}/{prepared.fingerprint}/{examples}/{cfg.metric}/{probe}/{against}".encode()
    )
    digest.update(files_key(model_dir).encode())
    if rewards is not None:  # the rewards' settings and files decide the reward score
        from ladle.rewards import digest as rewards_digest

        digest.update(f"{rewards_digest(rewards.files, rewards.rewards)}/{rewards.max_completion_tokens}".encode())
        if rewards.environment:  # the episodes' environment and limits decide it too
            digest.update(f"{rewards.environment}/{rewards.episode.model_dump_json()}".encode())
    return digest.hexdigest()[:24]


def score(
    model_dir: Path,
    prepared: PreparedDataset,
    cfg: EvalConfig,
    cached: bool = True,
    reference: Path | None = None,
    rewards=None,
) -> tuple[Score, bool]:
    """``(scores of model_dir on the held-out split, whether they came from the cache)``.

    Scores: ``loss`` when there are eval rows, ``eval.metric`` when there are held-out conversations, and for
    preference pairs with a ``reference`` model (the base the run tuned), ``preference_accuracy``.
    """
    samples = load_samples(prepared, cfg.max_examples)
    prompt_rows = load_prompt_rows(prepared, cfg.max_examples) if is_prompts(prepared) and rewards else []
    reference = reference if is_pairs(prepared) and prepared.eval_rows else None
    key = model_key(model_dir, prepared, cfg, len(samples) or len(prompt_rows), reference, rewards)
    cache = ladle_home() / "eval-cache" / f"{key}.json"
    if cached and cache.is_file():
        return Score.model_validate_json(cache.read_text()), True
    with one_load():  # the metric and the loss share one load of the model
        result = task_score(cfg, model_dir, samples) if samples else Score(values={})
        if prompt_rows:
            result = reward_score(model_dir, prompt_rows, rewards, cfg.batch_size)
        loss = eval_loss(model_dir, prepared)
        if cfg.probe:
            result.values["probe"], result.probe = probe_score(model_dir, cfg)
        if reference is not None:
            mine = pair_logps(model_dir, prepared)
    if reference is not None:
        result.values["preference_accuracy"] = preference_accuracy(mine, pair_logps(reference, prepared))
    if loss is not None:
        result.values["loss"] = loss
    if cached:
        write_atomic(cache, result.model_dump_json())
    return result, False


def evaluate(base_dir: Path, model_dir: Path, prepared: PreparedDataset, cfg: EvalConfig, rewards=None) -> Evaluation:
    """The base's (cached) and the new model's scores on the same held-out split; ``rewards``
    (``ladle.rewards.RewardSet``, training.objective: grpo) score held-out prompts by their mean reward."""
    samples = load_samples(prepared, cfg.max_examples)
    prompt_rows = load_prompt_rows(prepared, cfg.max_examples) if is_prompts(prepared) and rewards else []
    before, cached = score(base_dir, prepared, cfg, reference=base_dir, rewards=rewards)
    after, _ = score(model_dir, prepared, cfg, cached=False, reference=base_dir, rewards=rewards)
    note = ""
    if not samples and not prompt_rows:
        why = (
            "eval.max_examples = 0"
            if cfg.max_examples <= 0
            else "no held-out conversation (text data, or no eval split)"
        )
        note = f"{cfg.metric} not measured: {why}"
    shown = [
        {"prompt": prompt_of(m)[-1]["content"], "expected": m[-1]["content"], "before": b, "after": a}
        for m, b, a in zip(samples, before.answers, after.answers, strict=False)
    ] + [
        {"prompt": shown_prompt(r["prompt"]), "expected": "(scored by the rewards)", "before": b, "after": a}
        for r, b, a in zip(prompt_rows, before.answers, after.answers, strict=False)
    ]
    probe_shown = [
        {
            "question": b["question"],
            "before": b["answer"],
            "right_before": b["right"],
            "after": a["answer"],
            "right_after": a["right"],
        }
        for b, a in zip(before.probe, after.probe, strict=False)
    ]
    return Evaluation(
        probe_questions=len(after.probe),
        probe_shown=probe_shown,
        metric=cfg.metric,
        greater_is_better=cfg.higher_wins(),
        examples=len(samples) or len(prompt_rows),
        eval_rows=prepared.eval_rows,
        base=before.values,
        model=after.values,
        accuracy_before=before.values.get("exact_match"),
        accuracy_after=after.values.get("exact_match"),
        base_cached=cached,
        examples_shown=shown,
        note=note,
    )
