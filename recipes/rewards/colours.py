"""Rewards for the demo's colour-list tasks, written as TRL's GRPOTrainer calls them (so they run there unchanged):
``fn(prompts, completions, **columns) -> list[float]``, the row's ``answer`` column arriving as ``answer``."""


def _text(completion) -> str:
    return completion if isinstance(completion, str) else completion[0]["content"]


def items_in_place(prompts, completions, answer, **kwargs):
    """The fraction of the answer's items the completion has in their places (a longer completion is penalised by
    its extra items): partial credit, so a list that is right up to its fourth item scores above one that is not."""
    scores = []
    for completion, expected in zip(completions, answer, strict=False):
        got, want = _text(completion).split(), expected.split()
        right = sum(g == w for g, w in zip(got, want, strict=False))
        scores.append(right / max(len(want), len(got), 1))
    return scores
