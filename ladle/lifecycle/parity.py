"""The served model is the trained one: a gate that compares what a server computes with what training computed.

Quality lost between training and serving is silent: a chat template that differs from the one training rendered,
a tokenizer that adds a second BOS, a special token mapped elsewhere, a merge that folded the adapter wrongly, an
adapter served on another base. Each one leaves the server answering, just worse. So before a version is
promoted, for a few held-out conversations (``PROBE_ROWS``):

1. **probe**: ladle's own data code renders each conversation and tokenizes it exactly as the training data was
   (``ladle.data.tokenize``), giving its token ids and which of them are the answer (``ProbeRow``);
2. **reference**: the training process, at the end of training, runs its model's forward over those ids (every
   rank, as a sharded forward needs) and records each token's log-probability (``ladle.train.worker``); a strategy
   that splits one forward over ranks (pipeline, sequence parallel) has none, and the reference is then the saved
   weights loaded by transformers (peft for an adapter) in this process (``saved_logps``), which is said;
3. **check**: the server tokenizes each conversation's prompt through its own template (``POST /tokenize``) and
   must give the prompt tokens training used; then it scores the probe's ids (``/v1/completions`` with ``echo``
   and ``logprobs``) and each answer token's log-probability must equal the reference's within the tolerance
   (float32: 1e-4; 16-bit: 0.25, per token, ``promote.parity_tolerance``).

A mismatch blocks promotion (``ladle.lifecycle.gate.guard_parity``) and says where the two differ: the first
prompt token that differs (with both tokens' text: a doubled BOS or another template shows there), or the answer
token whose log-probability differs most.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, Field

from ladle.data import formats

PROBE_ROWS = 2
"""Held-out conversations compared: enough to see a template or weights mismatch (each has tens of answer tokens),
few enough to cost a second."""

TOLERANCE = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.25}
"""Largest per-token log-probability difference allowed, by the dtype the model was trained in. 16-bit: the same
weights run by two kernels differ by ~0.01-0.1 per token; a wrong merge or template differs by whole nats (not yet
measured on a GPU)."""


class ProbeRow(BaseModel):
    ids: list[int] = Field(description="The conversation's tokens as training tokenized it.")
    prompt_tokens: int = Field(description="Tokens before the first answer token (what a chat request sends).")
    answer: list[int] = Field(description="Positions of the answer tokens (those that carried the loss).")
    messages: list[dict] = Field(description="The conversation up to its answer (the chat request's messages).")


class Parity(BaseModel):
    ok: bool | None = Field(description="True: the server computes what training did; None: not measured.")
    reference: str = Field(description="What the server was compared with (`training process`, `saved weights`).")
    rows: int = 0
    answer_tokens: int = 0
    max_abs: float | None = Field(None, description="Largest per-token log-probability difference.")
    mean_abs: float | None = None
    tolerance: float | None = None
    where: str | None = Field(None, description="Where the two differ, when they do; why not measured, when not.")


def probe(tokenizer, conversations: list[list[dict]], cfg) -> list[ProbeRow]:
    """The first ``PROBE_ROWS`` held-out conversations as training tokenized them (``cfg``: ``data.*``); rows the
    data code refuses are skipped, as training skipped them.

    The server is asked to render the conversation up to its last answer (``messages[:-1]``, the generation prompt
    open), so the tokens it must give are training's up to the first token of that answer: found from the
    conversation's responses (the last span of response tokens), whatever ``data.train_on`` says was trained, and
    however many turns come before. The log-probabilities are compared on the tokens that carried the loss."""
    from ladle.data.formats import Chat
    from ladle.data.tokenize import IGNORE, tokenize_batch

    def tokenized(messages: list[dict], train_on: str):
        (example, _), *_ = tokenize_batch(tokenizer, [Chat(messages=messages)], train_on, cfg.seq_len, "right")
        return example if hasattr(example, "input_ids") else None

    rows = []
    for messages in conversations:
        if len(rows) == PROBE_ROWS:
            break
        if not messages or messages[-1].get("role") != "assistant":
            continue
        example = tokenized(messages, cfg.train_on)
        responses = example if cfg.train_on == "response" or example is None else tokenized(messages, "response")
        if example is None or responses is None or responses.input_ids != example.input_ids:
            continue
        answer = [i for i, label in enumerate(example.labels) if label != IGNORE]
        start = last_span_start([i for i, label in enumerate(responses.labels) if label != IGNORE])
        if not answer or start is None:
            continue
        rows.append(ProbeRow(ids=example.input_ids, prompt_tokens=start, answer=answer, messages=messages[:-1]))
    return rows


def last_span_start(positions: list[int]) -> int | None:
    """The first position of the last run of consecutive ``positions`` (the last answer's first token)."""
    if not positions:
        return None
    start = positions[-1]
    for position in reversed(positions[:-1]):
        if position != start - 1:
            break
        start = position
    return start


def prompt_probe(rows: list[dict]) -> list[ProbeRow]:
    """GRPO's held-out prompts as probe rows: the server must render each chat prompt as training did (its ids,
    the generation prompt open), and score its tokens as the trained model does. Prompts given as plain text are
    left out (no chat template to compare)."""
    probes = []
    for row in rows:
        if len(probes) == PROBE_ROWS:
            break
        ids, messages = row.get("ids") or [], row.get("prompt")
        if isinstance(messages, list) and len(ids) > 1:
            probes.append(ProbeRow(ids=ids, prompt_tokens=len(ids), answer=list(range(1, len(ids))), messages=messages))
    return probes


def saved_logps(model_dir, rows: list[ProbeRow], adapter_dir=None) -> list[list[float]]:
    """The same from saved weights, in float32: the model folder, or the base with the adapter applied by peft."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    found = []
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row.ids])).logits[0].float()
            logps = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(row.ids[1:])[:, None])[:, 0]
            found.append([0.0, *logps.tolist()])
    return found


class ToolCase(BaseModel):
    """An agent's held-out first turn as training rolled it out, greedy: the prompt, the tools, the parsed calls."""

    messages: list[dict]
    tools: list[dict]
    calls: list[dict]  # {"name", "arguments" (an object)}
    max_tokens: int  # a turn's (training.rl.max_completion_tokens)


def check_tool_calls(
    url: str, model: str, cases: list[ToolCase], headers: dict | None = None, timeout_s: float = 120.0
) -> str | None:
    """None when the server's greedy answer to each case parses (by its own tool parser) to the calls training's
    rollout parsed; else where the first one differs. The server sees the same messages and tools, so a template or
    parser that differs from training's shows here."""
    import httpx

    with httpx.Client(timeout=timeout_s, headers=headers or {}) as http:
        for n, case in enumerate(cases):
            body = {
                "model": model,
                "messages": case.messages,
                "tools": case.tools,
                "temperature": 0,
                "max_tokens": case.max_tokens,
            }
            answer = http.post(f"{url}/v1/chat/completions", json=body)
            answer.raise_for_status()
            message = answer.json()["choices"][0]["message"]
            served = [
                {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
                for c in message.get("tool_calls") or []
            ]
            if served != case.calls:
                shown = served or f"no call, it answered {str(message.get('content'))[:120]!r}"
                return (
                    f"tool calls: held-out episode {n}: training's rollout called {case.calls}, the server {shown}; "
                    "check the chat template and the tool-call format"
                )
    return None


def check(
    url: str,
    model: str,
    rows: list[ProbeRow],
    reference: list[list[float]],
    how: str,
    tolerance: float,
    tokenizer,
    headers: dict | None = None,
    timeout_s: float = 120.0,
) -> Parity:
    """Compare the server at ``url`` (OpenAI ``model`` name ``model``) with ``reference``; see the module."""
    import httpx

    def text(token: int) -> str:
        return repr(tokenizer.decode([token]))

    diffs: list[float] = []
    worst = (0.0, "")
    with httpx.Client(timeout=timeout_s, headers=headers or {}) as http:
        for n, (row, ref) in enumerate(zip(rows, reference, strict=True)):
            messages = formats.openai_messages(row.messages)  # data rows may leave tool calls' ids out
            served = http.post(f"{url}/tokenize", json={"model": model, "messages": messages})
            served.raise_for_status()
            prompt = served.json()["tokens"]
            trained = row.ids[: row.prompt_tokens]
            if prompt != trained:
                at = next((i for i, (a, b) in enumerate(zip(prompt, trained, strict=False)) if a != b), None)
                if at is None:
                    at = min(len(prompt), len(trained))
                    said = f"the server's prompt has {len(prompt)} tokens, training's {len(trained)}"
                else:
                    said = f"token {at}: the server has {prompt[at]} {text(prompt[at])}, training {trained[at]} {text(trained[at])}"
                return Parity(
                    ok=False,
                    reference=how,
                    rows=len(rows),
                    tolerance=tolerance,
                    where=f"template: held-out conversation {n}: the server renders its prompt differently from "
                    f"training ({said}); check the chat template, the tokenizer and its special tokens",
                )
            body = {"model": model, "prompt": row.ids, "max_tokens": 1, "echo": True, "logprobs": 0, "temperature": 0}
            answer = http.post(f"{url}/v1/completions", json=body)
            answer.raise_for_status()
            scored = answer.json()["choices"][0]["logprobs"]["token_logprobs"][: len(row.ids)]
            for position in row.answer:
                gap = abs(scored[position] - ref[position])
                diffs.append(gap)
                if gap > worst[0]:
                    token = row.ids[position]
                    worst = (
                        gap,
                        f"held-out conversation {n}, answer token {position} {text(token)}: training "
                        f"{ref[position]:.6f}, the server {scored[position]:.6f}",
                    )
    largest = max(diffs) if diffs else 0.0
    ok = largest <= tolerance
    where = (
        None
        if ok
        else (
            f"weights: {worst[1]} (|difference| {largest:.3g} > {tolerance:g}); the served weights are not the trained "
            "ones (the merge, the adapter, its base, or the dtype)"
        )
    )
    return Parity(
        ok=ok,
        reference=how,
        rows=len(rows),
        answer_tokens=len(diffs),
        max_abs=largest,
        mean_abs=sum(diffs) / len(diffs) if diffs else 0.0,
        tolerance=tolerance,
        where=where,
    )
