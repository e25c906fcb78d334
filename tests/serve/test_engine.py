"""The transformers backend's batching engine, driven directly: sliding-window and hybrid models whose requests
join a running batch, greedy / seeded / unseeded sampling mixed in one batch, each request's generator on its
logits' device, and the KV budget (never exceeded; what can never fit is refused by the server)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
)

from ladle.errors import LadleError
from ladle.serve import engine as engine_module
from ladle.serve.engine import Engine, check_cache_layers
from ladle.serve.rows import Job

PROMPTS = [
    "the quick brown fox jumps over the lazy dog and runs away into the forest",
    "x",
    "a b c d e f g h i j k l m n o p q r s t",
    "count to ten",
]


class Answer:
    """One job's events, and a way to wait for its end."""

    def __init__(self):
        self.texts, self.end, self.done = [], None, threading.Event()

    def emit(self, kind: str, data: dict) -> None:
        if kind == "text":
            self.texts.append(data["text"])
        else:
            self.end = (kind, data)
            self.done.set()


def small(kind: str, vocab: int):
    """A random-init decoder of ``kind`` small enough to run in milliseconds, with a window of 8 tokens."""
    torch.manual_seed(0)
    common = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
    }
    if kind == "mistral":  # every layer a sliding window
        model = MistralForCausalLM(MistralConfig(sliding_window=8, **common))
    elif kind == "gemma2":  # hybrid: sliding and full layers alternate
        layers = ["sliding_attention", "full_attention"]
        model = Gemma2ForCausalLM(Gemma2Config(sliding_window=8, head_dim=16, layer_types=layers, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.generation_config.eos_token_id = None  # every answer runs to max_new_tokens: the window is crossed
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return AutoTokenizer.from_pretrained(tiny_model)


def submit(engine: Engine, tokenizer, prompt: str, n: int = 30, **sampling) -> tuple[Job, Answer]:
    answer = Answer()
    job = Job(ids=tokenizer(prompt).input_ids, max_new_tokens=n, emit=answer.emit, **sampling)
    engine.submit(job)
    return job, answer


def wait_for_tokens(job: Job, n: int, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while len(job.tokens) < n:
        assert time.monotonic() < deadline, f"job has {len(job.tokens)} tokens, not {n}"
        time.sleep(0.001)


def finished(job: Job, answer: Answer) -> list[int]:
    assert answer.done.wait(60), "the job did not end"
    assert answer.end[0] == "done", answer.end
    return list(job.tokens)


@pytest.mark.parametrize("kind", ["mistral", "gemma2"])
def test_requests_that_join_a_running_batch_past_the_window_answer_as_alone(kind, tokenizer):
    """Each request joins while the others are mid-answer (after their 5th token), the prompts and answers
    longer than the 8-token window; every answer equals the one it gets alone."""
    engine = Engine(small(kind, len(tokenizer)), tokenizer, "cpu", max_batch=8)
    alone = [finished(*submit(engine, tokenizer, p)) for p in PROMPTS]
    running = []
    for prompt in PROMPTS:
        running.append(submit(engine, tokenizer, prompt))
        wait_for_tokens(running[-1][0], 5)
    assert [finished(*r) for r in running] == alone


def test_greedy_seeded_and_unseeded_requests_share_a_batch(tokenizer):
    engine = Engine(small("llama", len(tokenizer)), tokenizer, "cpu", max_batch=8)
    prompt = PROMPTS[0]
    greedy_alone = finished(*submit(engine, tokenizer, prompt))
    seeded_alone = finished(*submit(engine, tokenizer, prompt, temperature=1.3, top_p=0.9, seed=11))
    batches = []
    engine.on_batch = batches.append
    together = [
        submit(engine, tokenizer, prompt),
        submit(engine, tokenizer, prompt, temperature=1.3, top_p=0.9, seed=11),
        submit(engine, tokenizer, prompt, temperature=1.3),
        submit(engine, tokenizer, prompt, temperature=1.3),
    ]
    greedy, seeded, free1, free2 = (finished(*t) for t in together)
    assert max(batches) >= 3, batches  # they really ran together
    assert greedy == greedy_alone
    assert seeded == seeded_alone  # a seed's draws do not depend on its neighbours
    assert free1 != free2  # unseeded requests each draw from their own generator
    assert seeded != greedy  # and sampling does sample


def test_each_request_draws_from_a_generator_on_its_logits_device():
    job = Job(ids=[1], max_new_tokens=1, temperature=1.0, seed=5)
    first = job.generator_on(torch.device("cpu"))
    assert first.device == torch.device("cpu") and job.generator_on(torch.device("cpu")) is first
    draws = torch.rand(3, generator=first)
    again = Job(ids=[1], max_new_tokens=1, temperature=1.0, seed=5).generator_on(torch.device("cpu"))
    assert torch.equal(torch.rand(3, generator=again), draws)
    logits = torch.randn(50)
    assert 0 <= engine_module.sample(job, logits) < 50
    assert job.generator.device == logits.device


def test_a_draw_follows_the_distribution_never_takes_a_cut_token_and_refuses_nan():
    """The inverse-distribution draw (one uniform a token, not one exponential per vocabulary entry as
    ``torch.multinomial``): 40,000 draws land on each token in its share within 4 standard errors, a token cut to
    zero (top-k, top-p) is never drawn, not even at the first or last index, and NaN logits are an error."""
    from ladle.serve.rows import draw

    generator = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.1, 0.0, 0.25, 0.6, 0.05, 0.0])
    n = 40_000
    counts = torch.bincount(torch.tensor([draw(probs, generator) for _ in range(n)]), minlength=len(probs))
    share = counts.double() / n
    spread = (probs.double() * (1 - probs.double()) / n).sqrt()
    assert ((share - probs.double()).abs() <= 4 * spread + 1e-12).all(), share
    assert counts[[0, 2, 6]].sum() == 0
    assert draw(torch.tensor([0.0, 0.0, 3.0]), generator) == 2  # unnormalised weights: the only one with any
    with pytest.raises(RuntimeError, match="sum to nan"):
        draw(torch.softmax(torch.tensor([0.0, float("nan")]), dim=-1), generator)


def test_a_sampling_failure_ends_its_own_request_only(tokenizer, monkeypatch):
    engine = Engine(small("llama", len(tokenizer)), tokenizer, "cpu", max_batch=8)
    real = engine_module.sample

    def fails_for_seed_13(job, logits):
        if job.seed == 13:
            raise RuntimeError("Expected a 'cuda' device type for generator")
        return real(job, logits)

    monkeypatch.setattr(engine_module, "sample", fails_for_seed_13)
    greedy = submit(engine, tokenizer, PROMPTS[0])
    broken = submit(engine, tokenizer, PROMPTS[1], temperature=1.0, seed=13)
    sampled = submit(engine, tokenizer, PROMPTS[2], temperature=1.0, seed=3)
    assert broken[1].done.wait(60) and broken[1].end[0] == "error"
    assert "sampling failed: RuntimeError" in broken[1].end[1]["message"]
    assert len(finished(*greedy)) == 30 and len(finished(*sampled)) == 30


def test_the_kv_budget_holds_and_requests_wait_for_room(tokenizer, monkeypatch):
    """Budget 120 columns; each request needs ~20 prompt + 30 new tokens: at most two run at once, the rest wait
    their turn in order, and every one completes."""
    peak = []
    step = engine_module.Batch.step

    def measured(self):
        peak.append(len(self.jobs) * (self.mask.shape[1] + 1))  # the columns this step's cache will hold
        step(self)

    monkeypatch.setattr(engine_module.Batch, "step", measured)
    engine = Engine(small("llama", len(tokenizer)), tokenizer, "cpu", max_batch=8, kv_tokens=120)
    jobs = [submit(engine, tokenizer, PROMPTS[2]) for _ in range(5)]
    answers = [finished(*j) for j in jobs]
    assert len(set(map(tuple, answers))) == 1  # greedy: the same answer whoever it shared the cache with
    assert max(peak) <= 120, max(peak)
    assert max(peak) > 60  # two rows did share it


def test_a_request_larger_than_the_budget_gets_a_400_naming_it(tiny_model):
    from ladle.serve.backends import TransformersBackend
    from ladle.serve.jobs import make_job
    from ladle.serve.schema import ApiError, CompletionRequest
    from ladle.serve.server import Settings

    backend = TransformersBackend(str(tiny_model), max_batch=2, kv_tokens=64)
    ids = backend.encode("hello there")
    req = CompletionRequest(prompt="hello there", max_tokens=64 - len(ids) + 1)
    with pytest.raises(ApiError) as caught:
        make_job(req, ids, backend, Settings("tiny"))
    assert caught.value.status == 400 and caught.value.param == "prompt"
    assert "KV cache holds 64 tokens" in caught.value.message and "serve.kv_cache_tokens" in caught.value.message
    make_job(CompletionRequest(prompt="x", max_tokens=64 - len(ids)), ids, backend, Settings("tiny"))  # fits


def test_models_whose_cache_is_not_keys_and_values_are_refused():
    config = LlamaConfig(num_hidden_layers=2)
    config.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(LadleError, match=r"layers of type linear_attention.*cannot join or split"):
        check_cache_layers(config)
    config.layer_types = ["sliding_attention", "full_attention"]
    check_cache_layers(config)


def test_arrivals_with_one_prompt_are_prefilled_once_and_answer_as_alone(tokenizer):
    """A GRPO group (one prompt, several seeded completions) beside other prompts: the prefill runs each distinct
    prompt once, and every completion, with the log-probabilities of its sampled tokens, equals the one it gets
    alone."""
    engine = Engine(small("llama", len(tokenizer)), tokenizer, "cpu", max_batch=16, thread=False)

    def jobs(text: bool = False) -> list[Job]:
        prompts = [PROMPTS[0]] * 4 + [PROMPTS[2], PROMPTS[3]]
        return [
            Job(ids=tokenizer(p).input_ids, max_new_tokens=8, temperature=1.0, seed=i, sampled=[], writes_text=text)
            for i, p in enumerate(prompts)
        ]

    alone = []
    for job, written in zip(jobs(), jobs(text=True), strict=True):
        engine.run([job])
        engine.run([written])  # a rollout makes no text as it goes; its tokens and ending are the same
        assert (job.chosen, job.tokens, job.finish) == (written.chosen, written.tokens, written.finish)
        assert job.text == "" and written.text == tokenizer.decode(written.tokens, skip_special_tokens=True)
        alone.append((job.chosen, job.sampled))
    prefills = []
    forward = engine.forward

    def spy(jobs, **inputs):
        if inputs["input_ids"].shape[1] > 1:  # a prefill: the prompts' width, not one new token
            prefills.append(inputs["input_ids"].shape[0])
        return forward(jobs, **inputs)

    engine.forward = spy
    together = jobs()
    engine.run(together)
    assert prefills == [3]  # 6 completions, 3 distinct prompts
    for job, (tokens, logps) in zip(together, alone, strict=True):
        assert job.chosen == tokens
        torch.testing.assert_close(torch.tensor(job.sampled), torch.tensor(logps), rtol=0, atol=1e-5)
    assert len({tuple(job.chosen) for job in together[:4]}) > 1  # the group's seeds drew different completions
