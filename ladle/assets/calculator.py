"""The calculator's data (``ladle://calculator-*``): arithmetic a small model cannot do in its head, asked in a few
phrasings, for an agent that calls the built-in ``calculator`` environment's one tool.

- ``calculator-sft``: whole episodes to warm a model up on the tool-call format (a call of ``calculate`` with the
  question's expression, its result, the result as the answer), with the tool listed in the row (``tools``).
- ``calculator-prompts`` and ``calculator-prompts-heldout``: questions alone with their ``answer`` column, for
  GRPO with ``training.rl.environment: calculator``; none of the held-out questions is in the others.
"""

from __future__ import annotations

import random

SEED = 8675309
CALCULATE = {  # the built-in environment's tool as the chat template receives it (tests/assets hold them equal)
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {
                    "type": "string",
                    "description": 'Numbers with + - * / and brackets, e.g. "12 * (3 + 4)".',
                }
            },
            "required": ["expression"],
        },
    },
}
PHRASINGS = {
    "*": ["What is {a} * {b}?", "How much is {a} times {b}?", "Multiply {a} by {b}.", "Compute {a} x {b}."],
    "+": ["What is {a} + {b}?", "Add {a} and {b}.", "What is the sum of {a} and {b}?", "Compute {a} plus {b}."],
    "-": ["What is {a} - {b}?", "Subtract {b} from {a}.", "How much is {a} minus {b}?", "Compute {a} - {b}."],
}


def questions(n: int, seed: int = SEED, literal: bool = False) -> list[dict]:
    """``n`` distinct questions: ``question``, ``expression`` and ``answer`` (products of 3- by 2-digit numbers,
    sums and differences of 4-digit ones); ``literal``: only the phrasing that writes the expression out."""
    rng = random.Random(seed)
    out, seen = [], set()
    while len(out) < n:
        op = rng.choice("*+-")
        a, b = (
            (rng.randint(100, 999), rng.randint(11, 99))
            if op == "*"
            else (rng.randint(1000, 9999), rng.randint(1000, 9999))
        )
        if (op, a, b) in seen:
            continue
        seen.add((op, a, b))
        value = {"*": a * b, "+": a + b, "-": a - b}[op]
        phrasing = PHRASINGS[op][0] if literal else rng.choice(PHRASINGS[op])
        out.append(
            {
                "question": phrasing.format(a=a, b=b),
                "expression": f"{a} {op} {b}",
                "answer": str(value),
            }
        )
    return out


SFT_ROWS, PROMPT_ROWS, HELD_OUT = 200, 400, 64


def split() -> tuple[list[dict], list[dict], list[dict]]:
    """The warm-up's episodes (the literal phrasing only: "What is 347 * 29?"), and the prompts and held-out
    questions in every phrasing ("Subtract 1520 from 8113.", "How much is 347 times 29?"), none in two sets:
    the warm-up teaches the format, and GRPO has the other phrasings left to learn to turn into expressions."""
    every = questions(PROMPT_ROWS + HELD_OUT)
    taken = {q["expression"] for q in every}
    warm = [q for q in questions(SFT_ROWS + len(every), SEED + 1, literal=True) if q["expression"] not in taken]
    return warm[:SFT_ROWS], every[:PROMPT_ROWS], every[PROMPT_ROWS:]


def sft_rows() -> list[dict]:
    return [
        {
            "messages": [
                {"role": "user", "content": q["question"]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {
                            "type": "function",
                            "function": {"name": "calculate", "arguments": {"expression": q["expression"]}},
                        }
                    ],
                },
                {"role": "tool", "name": "calculate", "content": q["answer"]},
                {"role": "assistant", "content": q["answer"]},
            ],
            "tools": [CALCULATE],
        }
        for q in split()[0]
    ]


def prompt_rows(held_out: bool) -> list[dict]:
    rows = split()[2] if held_out else split()[1]
    return [{"prompt": [{"role": "user", "content": q["question"]}], "answer": q["answer"]} for q in rows]
