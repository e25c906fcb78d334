"""Structured outputs (``response_format``): a row's tokens constrained to a JSON schema, by llguidance.

A request with ``response_format`` ``json_object`` or ``json_schema`` gets a grammar, compiled once for the
request (``Grammars.constraint``), and a matcher that follows its tokens (``Constraint``). Before a constrained row
picks a token its logits are masked to the tokens the grammar allows next; after it picks one, the matcher takes
it and the next mask is computed on a worker thread while the batch's next forward runs (llguidance releases
the GIL while it computes, and so does torch), so the mask waits for nothing on the engine's critical path but the
rare slow one. Only the asking row is masked: constrained and free rows share a batch. The answer ends when the
grammar is complete (the model's end-of-sequence token, the only one allowed then, or a stopped matcher), so
every answer that ends with ``finish_reason: stop`` parses and validates.

Why llguidance (``bench/structured_outputs.py`` has the figures): against xgrammar 0.2.8 on SmolLM2's 49,152-token
vocabulary it compiled a 4-property schema in 0.34 ms against 1.0 (a server compiles per request), its masks took
9.7 µs median against xgrammar's 2.1 (both far below a decode step's tens of milliseconds; its slowest, 1.3 ms,
is computed while the forward runs), and it is one wheel without dependencies, where xgrammar brings triton and
TVM's FFI into a CPU serving image. outlines-core compiles schemas to a regular expression, so recursive schemas
are out of its reach.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

MASK_TIMEOUT_S = 30.0
"""The longest a row waits for its token mask (llguidance's p100 is milliseconds; past this the row fails)."""
MAX_SCHEMA_CHARS = 100_000
"""A schema's JSON text at most (a request's grammar is compiled on the server)."""

POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ladle-grammar")


class GrammarError(ValueError):
    """A ``response_format`` the grammar library cannot compile; ``param`` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def grammar_of(response_format: dict) -> str | None:
    """llguidance's grammar for an OpenAI ``response_format`` (None: ``text``, no constraint).

    Raises:
        GrammarError: the schema does not compile (the message names the part), or it is too large.
    """
    import llguidance

    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema, param = {"type": "object"}, "response_format"
    else:
        spec = response_format.get("json_schema") or {}
        schema, param = spec.get("schema") or {"type": "object"}, "response_format.json_schema.schema"
        if len(json.dumps(schema)) > MAX_SCHEMA_CHARS:
            raise GrammarError(f"the schema is longer than {MAX_SCHEMA_CHARS} characters of JSON", param)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"the schema cannot be enforced: {'; '.join(messages) or 'it does not compile'}", param)
    return grammar


def lark_grammar(text: str, param: str) -> str:
    """llguidance's grammar from a Lark grammar (JSON schemas inside as ``%json {...}``), checked.

    Raises:
        GrammarError: it does not compile (the message says where).
    """
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(text)
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"it cannot be enforced: {'; '.join(messages) or 'it does not compile'}", param)
    return grammar


class Grammars:
    """The server's grammar side: llguidance's view of the tokenizer, built once on first use (a fraction of a
    second for a 50k vocabulary), and a matcher per constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos = tokenizer, vocab_size, sorted(eos)
        self._lltokenizer = None
        self._lock = threading.Lock()

    def lltokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                eos = self.eos if len(self.eos) > 1 else self.eos[0]
                self._lltokenizer = llguidance.hf.from_tokenizer(self.tokenizer, self.vocab_size, eos_token=eos)
            return self._lltokenizer

    def constraint(self, grammar: str) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.lltokenizer(), grammar)
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be enforced: {matcher.get_error()}", "response_format")
        return Constraint(matcher, self.vocab_size)


class Constraint:
    """One row's matcher and its next token mask (computed ahead on ``POOL``)."""

    def __init__(self, matcher, vocab_size: int) -> None:
        import llguidance.torch

        self.matcher = matcher
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)
        self.pending: Future = POOL.submit(self._fill)

    def _fill(self) -> None:
        import llguidance.torch

        llguidance.torch.fill_next_token_bitmask(self.matcher, self.bitmask, 0)

    def masked(self, scores: torch.Tensor) -> torch.Tensor:
        """A copy of a row's ``scores`` with every token the grammar does not allow next at -inf."""
        import llguidance.torch

        self.pending.result(timeout=MASK_TIMEOUT_S)
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar failed: {self.matcher.get_error()}")
        row = scores.float().clone().unsqueeze(0)
        llguidance.torch.apply_token_bitmask_inplace(row, self.bitmask.to(row.device))
        return row.squeeze(0)

    def accept(self, token: int) -> bool:
        """Take the chosen token; whether the grammar is complete (the answer ends). The next mask starts now."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        if self.matcher.is_stopped():
            return True
        self.pending = POOL.submit(self._fill)
        return False
