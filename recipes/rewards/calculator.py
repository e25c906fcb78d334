"""Rewards for the calculator agent (``ladle://calculator-prompts``), written as TRL's GRPOTrainer calls them: the
completion of an agent's episode is its messages, the last one its final answer."""

import re

NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _answer(completion) -> str:
    if isinstance(completion, str):
        return completion
    said = [m for m in completion if m.get("role") == "assistant"]
    return str(said[-1].get("content") or "") if said else ""


def right_answer(completions, answer, **kwargs):
    """1 where the final answer's last number is the right result (commas allowed), else 0."""
    scores = []
    for completion, expected in zip(completions, answer, strict=False):
        numbers = NUMBER.findall(_answer(completion))
        scores.append(float(bool(numbers) and numbers[-1].replace(",", "") == str(expected)))
    return scores
