"""Presence, frequency and repetition penalties and logit_bias, per request: each greedy answer equals transformers'
``generate`` with the same rule as a logits processor (the repetition penalty as transformers' own), rows with
different settings share a batch and still answer as they do alone, bad values are a 400 naming the field, and a
backend that cannot honour them refuses them by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from ladle.serve.jobs import make_job
from ladle.serve.schema import ApiError, ChatRequest
from ladle.serve.server import Settings

MESSAGES = [{"role": "user", "content": "Count to five please, slowly."}]


class OpenAIPenalties:
    """The OpenAI rule as a transformers logits processor: each generated token's logit lowered by its count x
    frequency_penalty + presence_penalty, then the bias added."""

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]):
        self.prompt_len, self.presence, self.frequency, self.bias = prompt_len, presence, frequency, bias

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            generated = input_ids[row, self.prompt_len :]
            if len(generated):
                ids, counts = generated.unique(return_counts=True)
                scores[row, ids] -= counts.to(scores.dtype) * self.frequency + self.presence
            for token, value in self.bias.items():
                scores[row, token] += value
        return scores


def reference(model_dir, max_new_tokens: int, presence=0.0, frequency=0.0, repetition=1.0, bias=None) -> str:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    processors = LogitsProcessorList([OpenAIPenalties(ids.shape[1], presence, frequency, bias or {})])
    with torch.no_grad():
        out = model.generate(
            ids,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            repetition_penalty=repetition,
            logits_processor=processors,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
        )
    return tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


CASES = {
    "plain": {},
    "frequency": {"frequency_penalty": 2.0},
    "presence": {"presence_penalty": 1.5},
    "both, negative": {"frequency_penalty": -0.7, "presence_penalty": -1.0},
    "repetition": {"repetition_penalty": 1.8},
    "bias": {"logit_bias": {"5": 9.0, "17": -100.0}},
    "all": {"frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.3, "logit_bias": {"9": 4.0}},
}


def ask(client, settings: dict, stream: bool = False) -> str:
    if stream:
        chunks = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, stream=True, extra_body=settings
        )
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reply = client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=16, temperature=0, extra_body=settings
    )
    return reply.choices[0].message.content


def test_each_rule_answers_as_transformers_generate_does(client, tiny_model):
    answers = {name: ask(client, settings) for name, settings in CASES.items()}
    for name, settings in CASES.items():
        expected = reference(
            tiny_model,
            16,
            presence=settings.get("presence_penalty", 0.0),
            frequency=settings.get("frequency_penalty", 0.0),
            repetition=settings.get("repetition_penalty", 1.0),
            bias={int(k): v for k, v in settings.get("logit_bias", {}).items()},
        )
        assert answers[name] == expected, name
    assert len(set(answers.values())) > 3  # the rules change the answer: the comparison is not of one text
    assert ask(client, CASES["all"], stream=True) == answers["all"]


def test_a_bias_of_100_forces_the_token(client, backend):
    token = backend.encode(" blue")[0]
    reply = client.completions.create(
        model="tiny", prompt="Name", max_tokens=6, temperature=1.2, seed=3, logit_bias={str(token): 100}
    )
    assert backend.tokenizer(reply.choices[0].text, add_special_tokens=False).input_ids == [token] * 6


def test_rows_with_different_settings_share_a_batch_and_answer_as_alone(client):
    alone = {name: ask(client, settings) for name, settings in CASES.items()}
    names = list(CASES) * 2
    with ThreadPoolExecutor(len(names)) as pool:
        together = list(pool.map(lambda name: ask(client, CASES[name]), names))
    assert together == [alone[name] for name in names]


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        ("presence_penalty", 2.5, "presence_penalty"),
        ("frequency_penalty", -3, "frequency_penalty"),
        ("repetition_penalty", 0, "repetition_penalty"),
        ("repetition_penalty", 5e-324, "repetition_penalty"),
        ("logit_bias", {"blue": 1}, "token ids"),
        ("logit_bias", {"\u00b2": 1}, "token ids"),
        ("logit_bias", {"9" * 5000: 1}, "token ids"),
        ("logit_bias", {"3": 101}, "-100..100"),
        ("logit_bias", {str(10**9): 1}, "outside this model's vocabulary"),
    ],
)
def test_bad_values_are_a_400_naming_the_field(client, field, value, said):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body={field: value})
    body = err.value.response.json()["error"]
    assert body["param"] == field and said in body["message"]


def test_a_backend_that_cannot_adjust_logits_refuses_each_field_by_name():
    class Fixed:
        name, adjusts_logits, supports_seed = "mii", False, False
        context_length, kv_tokens, vocab_size = 2048, None, None

    for field, value in (
        ("presence_penalty", 0.5),
        ("frequency_penalty", 0.5),
        ("repetition_penalty", 1.2),
        ("logit_bias", {"3": 1}),
    ):
        req = ChatRequest(messages=MESSAGES, **{field: value})
        with pytest.raises(ApiError) as err:
            make_job(req, [1, 2, 3], Fixed(), Settings("tiny"))
        assert err.value.status == 400 and err.value.param == field
        assert "serve.backend=mii" in str(err.value) and "serve.backend=transformers" in str(err.value)
    assert make_job(ChatRequest(messages=MESSAGES, presence_penalty=0.0), [1, 2], Fixed(), Settings("tiny")).ids == [
        1,
        2,
    ]
