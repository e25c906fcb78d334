"""Evaluate stage: exact-match accuracy of greedy answers on held-out conversations.

The prepare stage keeps the eval split's conversations verbatim
(``eval_samples.jsonl``). Each is asked without its last (assistant) turn,
through the tokenizer's chat template exactly as the server asks it, and the
greedy answer must equal that turn (surrounding whitespace aside). The base
model is scored on the same conversations once per (base, dataset fingerprint)
and cached, so "before" costs nothing on the next run of the same data.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import BaseModel, Field

from ladle import storage
from ladle.assets import ladle_home
from ladle.data.prepare import PreparedDataset

EVAL_VERSION = "1"  # bump when a score for the same inputs would change


class Score(BaseModel):
    accuracy: float = Field(description="Share of held-out prompts answered exactly (0..1).")
    correct: int
    total: int
    answers: list[str] = Field(description="The greedy answers, in sample order (the first few).")


class Evaluation(BaseModel):
    metric: str = "exact_match"
    examples: int = Field(description="Held-out conversations scored (0: none available, accuracy is null).")
    accuracy_before: float | None = Field(description="The base model's exact match on the same prompts.")
    accuracy_after: float | None = Field(description="The fine-tuned (merged) model's exact match.")
    base_cached: bool = Field(False, description="The base score came from the cache (same base and data).")
    examples_shown: list[dict] = Field(
        default_factory=list, description="A few prompts with expected and given answers."
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


def exact_match(model_dir: Path, samples: list[list[dict]], batch_size: int = 32, shown: int = 5) -> Score:
    """Greedy answers of the model in ``model_dir`` to each sample's prompt, scored against its last turn.

    Generation is batched with left padding and stops at EOS or one token past
    the longest reference in the batch: a longer answer cannot be exact anyway.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    answers: list[str] = []
    for start in range(0, len(samples), batch_size):
        batch = samples[start : start + batch_size]
        texts = [tokenizer.apply_chat_template(prompt_of(m), tokenize=False, add_generation_prompt=True) for m in batch]
        enc = tokenizer(texts, add_special_tokens=False, return_tensors="pt", padding=True).to(device)
        longest = max(len(tokenizer(m[-1]["content"], add_special_tokens=False).input_ids) for m in batch)
        with torch.no_grad():
            out = model.generate(
                **enc,
                max_new_tokens=longest + 1,
                do_sample=False,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        new = out[:, enc.input_ids.shape[1] :]
        answers += [tokenizer.decode(row, skip_special_tokens=True) for row in new]
    correct = sum(answer.strip() == m[-1]["content"].strip() for answer, m in zip(answers, samples, strict=False))
    return Score(
        accuracy=round(correct / max(1, len(samples)), 4), correct=correct, total=len(samples), answers=answers[:shown]
    )


def base_key(base_dir: Path, prepared: PreparedDataset, examples: int) -> str:
    """Identity of a base score: the base's config and weight files (names, sizes), the data, the count."""
    digest = hashlib.sha256(f"ladle-eval/{EVAL_VERSION}/{prepared.fingerprint}/{examples}".encode())
    digest.update((base_dir / "config.json").read_bytes())
    for file in sorted(base_dir.glob("*.safetensors")) + sorted(base_dir.glob("*.bin")):
        digest.update(f"{file.name}:{file.stat().st_size}:{file.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:24]


def base_score(
    base_dir: Path, prepared: PreparedDataset, samples: list[list[dict]], batch_size: int
) -> tuple[Score, bool]:
    """The base model's score, from the cache when this base and data were scored before."""
    cache = ladle_home() / "eval-cache" / f"{base_key(base_dir, prepared, len(samples))}.json"
    if cache.is_file():
        return Score.model_validate_json(cache.read_text()), True
    score = exact_match(base_dir, samples, batch_size)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(score.model_dump_json())
    tmp.replace(cache)
    return score, False


def evaluate(
    base_dir: Path, model_dir: Path, prepared: PreparedDataset, max_examples: int, batch_size: int = 32
) -> Evaluation:
    """Exact match before (base) and after (``model_dir``) on up to ``max_examples`` held-out conversations."""
    samples = load_samples(prepared, max_examples)
    if not samples:
        why = "eval.max_examples = 0" if max_examples <= 0 else "no held-out conversation (text data, or no eval split)"
        return Evaluation(examples=0, accuracy_before=None, accuracy_after=None, note=f"accuracy not measured: {why}")
    before, cached = base_score(base_dir, prepared, samples, batch_size)
    after = exact_match(model_dir, samples, batch_size)
    shown = [
        {"prompt": prompt_of(m)[-1]["content"], "expected": m[-1]["content"], "before": b, "after": a}
        for m, b, a in zip(samples, before.answers, after.answers, strict=False)
    ]
    return Evaluation(
        examples=len(samples),
        accuracy_before=before.accuracy,
        accuracy_after=after.accuracy,
        base_cached=cached,
        examples_shown=shown,
    )
