"""Write recipes/data/smollm2-replay.jsonl: general questions with SmolLM2-135M-Instruct's own greedy answers.

    .venv/bin/python bench/smollm2_replay.py

Rehearsal data for recipes/smollm2-135m-cpu.yaml. Fine-tuned on the colour tasks alone, the model forgets
how it answers everything else (measured: the general-ability probe fell from 0.69 to 0.31-0.38 whatever the
learning rate, the LoRA targets or a task system prompt); mixed into the training data, its own answers to
other questions keep that behaviour where it was. The targets are the base model's own outputs (right or
wrong), so they teach no facts: none of these questions is in the probe (ladle://general-probe), which
stays a held-out measure. Each answer is cut after its last full sentence within 64 tokens.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "recipes" / "data" / "smollm2-replay.jsonl"

CAPITALS = [
    "Portugal",
    "Greece",
    "Egypt",
    "India",
    "Australia",
    "Brazil",
    "Mexico",
    "Argentina",
    "Kenya",
    "Norway",
    "Sweden",
    "Finland",
    "Poland",
    "Ireland",
    "Scotland",
    "Turkey",
    "Thailand",
    "Vietnam",
    "Peru",
    "Chile",
    "Cuba",
    "Austria",
    "Belgium",
    "Denmark",
    "Hungary",
    "Indonesia",
    "Nigeria",
    "Morocco",
]
SUMS = [(3, 4), (5, 6), (7, 8), (10, 15), (12, 9), (20, 30), (1, 1), (9, 9), (14, 6), (25, 25)]
PRODUCTS = [(2, 3), (4, 5), (6, 7), (3, 3), (10, 10), (8, 2), (9, 4), (5, 5)]
OPPOSITES = ["up", "big", "fast", "happy", "light", "old", "early", "wet", "open", "loud"]
COLOURED = ["grass", "snow", "a banana", "a tomato", "coal", "milk", "a lemon", "chocolate"]
SOUNDS = ["cow", "dog", "cat", "duck", "sheep", "lion"]
LEGS = ["dog", "bird", "cat", "horse", "chicken", "ant"]
OTHERS = [
    "Who wrote Hamlet?",
    "Who discovered penicillin?",
    "What is the largest mammal?",
    "What is the fastest land animal?",
    "Name a fruit that is yellow.",
    "What is the smallest prime number?",
    "How many minutes are in an hour?",
    "How many months are in a year?",
    "What season comes after winter?",
    "What is the largest desert in the world?",
    "What is the longest river in Africa?",
    "What language is spoken in Mexico?",
    "What is the chemical symbol for gold?",
    "What planet do we live on?",
    "What is the main ingredient of bread?",
    "What do caterpillars turn into?",
    "Which instrument has 88 keys?",
    "What is frozen water called?",
    "How many sides does a triangle have?",
    "How many sides does a square have?",
    "Write a short greeting.",
    "Give me a tip for staying healthy.",
    "Explain what a computer is in one sentence.",
    "Tell me a fun fact about the ocean.",
    "What is photosynthesis?",
    "Why do we need sleep?",
    "What is the weather like in a desert?",
    "Suggest a name for a pet cat.",
    "What is a triangle?",
    "How do you make a cup of tea?",
]


def questions() -> list[str]:
    out = [f"What is the capital of {c}?" for c in CAPITALS]
    out += [f"What is {a} plus {b}?" for a, b in SUMS]
    out += [f"What is {a} times {b}?" for a, b in PRODUCTS]
    out += [f"What is the opposite of {w}?" for w in OPPOSITES]
    out += [f"What colour is {thing}?" for thing in COLOURED]
    out += [f"What sound does a {a} make?" for a in SOUNDS]
    out += [f"How many legs does a {a} have?" for a in LEGS]
    return out + OTHERS


def whole_sentences(text: str) -> str:
    text = text.strip()
    end = max(text.rfind(". "), text.rfind("! "), text.rfind("? "))
    return text if text.endswith((".", "!", "?")) or end < 0 else text[: end + 1]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from ladle.assets import resolve_base
    from ladle.lifecycle.evaluate import greedy_answers, load_probe

    asked = questions()
    probe = {q["question"] for q in load_probe("ladle://general-probe")}
    assert not probe & set(asked), probe & set(asked)
    model = resolve_base("ladle://smollm2-135m-instruct", "float32")
    answers = greedy_answers(model, [[{"role": "user", "content": q}] for q in asked], 32, lambda tok, rows: 64)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    with OUT.open("w", encoding="utf-8") as fh:
        for question, answer in zip(asked, answers, strict=True):
            fh.write(json.dumps({"instruction": question, "input": "", "output": whole_sentences(answer)}) + "\n")
    print(f"wrote {len(asked)} rows to {OUT}")


if __name__ == "__main__":
    main()
