"""Samples to token ids and labels, in batches, through the tokenizer's chat template.

Labels are the token ids where a loss applies and -100 elsewhere. For chats,
only assistant turns (their content through the closing EOS) are trained when
``train_on == "response"``; plain text and pre-tokenized rows without labels
train every token. The first label of every example is -100: it is never
predicted, and it keeps packed examples from predicting across a boundary.
"""

from __future__ import annotations

from dataclasses import dataclass

from ladle.data.formats import Chat, RowError, Sample, Tokens

IGNORE = -100


class TooLong(RowError):
    """An example over ``seq_len`` under ``truncation: drop`` (reported, but not a bad row)."""


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]

    @property
    def trained(self) -> int:
        return sum(label != IGNORE for label in self.labels)


def chat_text(
    tokenizer, messages: list[dict], train_on: str, tools: list[dict] | None = None
) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation (with the ``tools`` it may call) and the character spans that carry a loss: each
    assistant turn, its tool calls included, as the template writes them; tool results are context.

    Raises:
        RowError: the template rejects the roles, renders no tools where the row lists some, is not
            prefix-stable, or does not close an assistant turn with EOS.
    """
    if tools and "tools" not in (tokenizer.chat_template or ""):
        raise RowError(
            "the row lists tools but the chat template does not render them (it never reads `tools`); train tool "
            "calls on a base whose template does (Qwen 2.5, Llama 3.1, Hermes, ...)"
        )

    def render(part: list[dict], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, tools=tools, tokenize=False, add_generation_prompt=prompt)

    try:
        text = render(messages)
    except Exception as exc:  # noqa: BLE001 - jinja raises TemplateError, which carries the reason
        raise RowError(f"chat template failed: {exc}") from None
    if train_on == "all":
        return text, [(0, len(text))]
    eos = tokenizer.eos_token
    spans = []
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(messages[:k], prompt=True) if k else ""
        last = k == len(messages) - 1
        through = text if last else render(messages[: k + 1])
        if not text.startswith(through) or not through.startswith(before):
            raise RowError("chat template output is not prefix-stable; cannot locate the response")
        cut = through.rfind(eos, len(before)) if eos else -1
        if cut < 0:
            raise RowError("assistant turn does not end with the EOS token in the chat template")
        spans.append((len(before), cut + len(eos)))
    return text, spans


def _text_and_spans(tokenizer, sample: Sample, train_on: str) -> tuple[str, list[tuple[int, int]]]:
    if isinstance(sample, Chat):
        return chat_text(tokenizer, sample.messages, train_on, sample.tools)
    text = (tokenizer.bos_token or "") + sample.text + (tokenizer.eos_token or "")
    return text, [(0, len(text))]


def _fit(ids: list[int], labels: list[int], seq_len: int, truncation: str) -> tuple[Example, bool]:
    labels = [IGNORE, *labels[1:]]
    if len(ids) > seq_len:
        if truncation == "drop":
            raise TooLong(f"too long: {len(ids)} tokens > seq_len={seq_len} (data.truncation=drop)")
        ids, labels = ids[:seq_len], labels[:seq_len]
        if all(label == IGNORE for label in labels):
            raise RowError(f"no trained tokens within seq_len={seq_len}")
        return Example(ids, labels), True
    if all(label == IGNORE for label in labels):
        raise RowError("no trained tokens")
    return Example(ids, labels), False


def tokenize_batch(
    tokenizer, samples: list[Sample], train_on: str, seq_len: int, truncation: str
) -> list[tuple[Example | RowError, bool]]:
    """Tokenize samples together (one fast-tokenizer call); per sample, an example or the reason it failed.

    Returns:
        ``(example or RowError, truncated)`` for each sample, in order.
    """
    out: list[tuple[Example | RowError, bool] | None] = [None] * len(samples)
    texts, spans, where = [], [], []
    for i, sample in enumerate(samples):
        if isinstance(sample, Tokens):
            out[i] = _guard(lambda s=sample: _fit(s.input_ids, s.labels or s.input_ids, seq_len, truncation))
            continue
        try:
            text, span = _text_and_spans(tokenizer, sample, train_on)
        except RowError as exc:
            out[i] = (exc, False)
            continue
        texts.append(text)
        spans.append(span)
        where.append(i)
    if texts:
        enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        for j, i in enumerate(where):
            out[i] = _guard(
                lambda j=j: _label(
                    tokenizer, enc["input_ids"][j], enc["offset_mapping"][j], spans[j], seq_len, truncation
                )
            )
    return out  # type: ignore[return-value]


def _guard(fn) -> tuple[Example | RowError, bool]:
    try:
        return fn()
    except RowError as exc:
        return exc, False


def _label(tokenizer, ids, offsets, spans, seq_len, truncation) -> tuple[Example, bool]:
    bos = tokenizer.bos_token_id
    if bos is not None and len(ids) > 1 and ids[0] == bos and ids[1] == bos:
        raise RowError("BOS token doubled (the text or template adds it twice)")
    labels = [
        tok if any(s <= start < e for s, e in spans) else IGNORE for tok, (start, _) in zip(ids, offsets, strict=False)
    ]
    return _fit(list(ids), labels, seq_len, truncation)


def stop_ids(model, tokenizer) -> set[int]:
    """The token ids that end a generation: the model's ``generation_config`` EOS set (a chat model's end-of-turn
    among them), else the tokenizer's EOS. One rule for ladle's engine (rollouts, serving) and the evaluation's
    ``generate``, so the gate scores the completions training rewarded."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = eos if eos is not None else tokenizer.eos_token_id
    return {int(e) for e in (eos if isinstance(eos, list | tuple) else [eos]) if e is not None}
