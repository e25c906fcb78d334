"""Log-probabilities (``logprobs``, ``top_logprobs``) on chat and completions, whole and streamed, read with the
OpenAI SDK: each generated token's value and its alternatives equal a direct forward pass of the same model
(float32 on CPU, 1e-4), streamed equals whole, rows asking for them share a batch with rows that do not, and
the requests this server cannot answer are a 400 naming the field."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from ladle.serve.jobs import make_job
from ladle.serve.schema import ApiError, ChatRequest, CompletionRequest
from ladle.serve.server import Settings
from tests.serve.running import Running

MESSAGES = [{"role": "user", "content": "Name a colour."}]


def forward_logprobs(model_dir, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """The greedy tokens ``generate`` gives and the log-softmax of one forward pass over prompt + answer at each
    answer position (no cache, no batching: the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
        answer = out[0, ids.shape[1] :].tolist()
        answer = [t for t in answer if t != tok.eos_token_id]
        logits = model(torch.tensor([prompt_ids + answer])).logits[0].float()
    positions = torch.arange(len(prompt_ids) - 1, len(prompt_ids) - 1 + len(answer))
    return answer, torch.log_softmax(logits[positions], dim=-1)


def test_chat_logprobs_equal_a_forward_pass_and_stream_the_same(client, backend, tiny_model):
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    answer, reference = forward_logprobs(tiny_model, backend.encode_chat(MESSAGES), 12)
    assert len(content) == len(answer) == reply.usage.completion_tokens
    for entry, token, row in zip(content, answer, reference, strict=True):
        assert entry.token == backend.tokenizer.decode([token])
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        top = torch.topk(row, 3)
        assert [alt.token for alt in entry.top_logprobs] == [
            backend.tokenizer.decode([t]) for t in top.indices.tolist()
        ]
        assert [alt.logprob for alt in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # greedy: the chosen token is the likeliest
    # Each token's own bytes: joined, they are the answer (a character split over tokens is whole again).
    joined = bytes(b for e in content for b in e.bytes).decode("utf-8", errors="replace")
    assert joined == reply.choices[0].message.content == backend.tokenizer.decode(answer)

    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content


def test_completions_logprobs_are_the_legacy_parallel_lists(client, backend, tiny_model):
    reply = client.completions.create(model="tiny", prompt="blue red", max_tokens=8, temperature=0, logprobs=2)
    lp = reply.choices[0].logprobs
    answer, reference = forward_logprobs(tiny_model, backend.encode("blue red"), 8)
    assert lp.tokens == [backend.tokenizer.decode([t]) for t in answer]
    assert lp.token_logprobs == pytest.approx(
        [float(row[t]) for t, row in zip(answer, reference, strict=True)], abs=1e-4
    )
    assert all(len(alts) == 2 for alts in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = client.completions.create(
        model="tiny", prompt="blue red", max_tokens=8, temperature=0, logprobs=2, stream=True
    )
    tokens, offsets = [], []
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.tokens
            offsets += chunk.choices[0].logprobs.text_offset
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_sampled_rows_report_the_model_distribution_and_share_a_batch(client):
    """Sampled, the value is still the model's own log-probability of the token drawn (temperature does not
    change it); rows with and without logprobs in one batch answer as they do alone."""

    def ask(kind):
        extra = {"logprobs": True, "top_logprobs": 2} if kind == "lp" else {}
        reply = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, extra_body=extra
        )
        lp = reply.choices[0].logprobs
        return reply.choices[0].message.content, [e.logprob for e in lp.content] if lp else None

    alone = {kind: ask(kind) for kind in ("lp", "plain")}
    assert alone["lp"][0] == alone["plain"][0] and alone["plain"][1] is None
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, ["lp", "plain"] * 4))
    for kind, (text, values) in zip(["lp", "plain"] * 4, together, strict=True):
        assert text == alone[kind][0]
        if values is not None:
            assert values == pytest.approx(alone[kind][1], abs=1e-5)
    sampled = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, temperature=1.5, seed=5, logprobs=True, top_logprobs=20
    )
    for entry in sampled.choices[0].logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 20
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": "many"}, "logprobs"),
    ],
)
def test_bad_logprobs_requests_are_a_400_naming_the_field(client, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=body)
    assert err.value.response.json()["error"]["param"] == param


def test_a_backend_without_logprobs_refuses_them_by_name():
    class TextOnly:
        name, supports_logprobs, adjusts_logits, supports_seed = "mii", False, False, False
        context_length, kv_tokens, vocab_size = 2048, None, None

    for req in (ChatRequest(messages=MESSAGES, logprobs=True), CompletionRequest(prompt="x", logprobs=0)):
        with pytest.raises(ApiError) as err:
            make_job(req, [1, 2, 3], TextOnly(), Settings("tiny"))
        assert err.value.status == 400 and err.value.param == "logprobs"
        assert "serve.backend=mii" in str(err.value) and "serve.backend=transformers" in str(err.value)


def test_echo_returns_the_prompt_and_its_tokens_logprobs(client, backend, tiny_model):
    """lm-evaluation-harness's ``local-completions`` scores a continuation this way: ``echo`` with ``logprobs``
    and the prompt's tokens' values, each given the tokens before it (the first has none)."""
    from transformers import AutoModelForCausalLM

    prompt = "blue red green"
    ids = backend.encode(prompt)
    reply = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text.startswith(prompt)
    assert lp.tokens[: len(ids)] == [backend.tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = [float(reference[i - 1, ids[i]]) for i in range(1, len(ids))]
    assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
    assert len(lp.tokens) == len(ids) + reply.usage.completion_tokens

    chunks = list(
        client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3, temperature=0, logprobs=1, echo=True, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text == reply.choices[0].text and plain.choices[0].logprobs is None


def test_echo_of_a_prompt_whose_logits_would_not_fit_is_refused_naming_it():
    class HugeVocab:
        name, supports_logprobs, adjusts_logits, supports_seed = "transformers", True, True, True
        context_length, kv_tokens, vocab_size = 10**6, None, 10**6

    req = CompletionRequest(prompt="x", logprobs=1, echo=True, max_tokens=1)
    with pytest.raises(ApiError) as err:
        make_job(req, list(range(200)), HugeVocab(), Settings("tiny"))
    assert err.value.param == "echo" and "763 MiB of logits" in str(err.value)
    assert make_job(req.model_copy(update={"logprobs": None}), list(range(200)), HugeVocab(), Settings("tiny")).echo


def test_the_front_relays_logprobs_and_penalties_unchanged(server, client):
    """What clients reach is the front: the same answers and values through it, whole and streamed."""
    from ladle.fleet import front as fronts

    upstream = {"url": server.url, "version": "1", "pid": None, "model_dir": "x"}
    front = Running(fronts.create_app("tiny", "t", {"upstream": upstream}, None))
    try:
        via = openai.OpenAI(base_url=f"{front.url}/v1", api_key="unused", max_retries=0)
        ask = {"model": "tiny", "messages": MESSAGES, "max_tokens": 8, "temperature": 0, "logprobs": True}
        extra = {"frequency_penalty": 1.0, "logit_bias": {"9": 3.0}}
        direct = client.chat.completions.create(**ask, top_logprobs=2, extra_body=extra)
        relayed = via.chat.completions.create(**ask, top_logprobs=2, extra_body=extra)
        assert relayed.choices[0].message.content == direct.choices[0].message.content
        assert [e.logprob for e in relayed.choices[0].logprobs.content] == [
            e.logprob for e in direct.choices[0].logprobs.content
        ]
        chunks = list(via.chat.completions.create(**ask, stream=True, extra_body=extra))
        streamed = [
            e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
        ]
        assert streamed == [e.logprob for e in direct.choices[0].logprobs.content]
    finally:
        front.stop()
