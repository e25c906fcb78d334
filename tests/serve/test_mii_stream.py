"""ladle's MII server (ladle.serve.mii_server) on DeepSpeed-MII's real classes: streamed text joins to the
answer's whole text where MII's own loses it, and MII's launch runs ladle's module. MII has no CPU engine, so
the pipeline is fed what its engine thread queues per token (``RaggedBatchBase._generate_output``)."""

from __future__ import annotations

import queue
import random
import subprocess
import sys
import threading

import pytest
from transformers import AutoTokenizer

from ladle.serve import mii_server
from ladle.serve.mii_server import StreamText
from tests.helpers import ROOT


@pytest.fixture(scope="module")
def tokenizers(tiny_model):
    from ladle.assets import resolve_base

    return {
        "tiny": AutoTokenizer.from_pretrained(tiny_model),
        "smollm2": AutoTokenizer.from_pretrained(resolve_base("ladle://smollm2-135m-instruct", "float32")),
    }


def answers(tokenizer, n: int, seed: int) -> list[list[int]]:
    """Token sequences as a sampling model makes them: words, and lone bytes (incomplete UTF-8) among them."""
    rng = random.Random(seed)
    lone = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd"]
    words = tokenizer("The sea is calm; a haiku — 雨が降る. Add 2 and 3: 5 ✓", add_special_tokens=False).input_ids
    return [[rng.choice(lone if rng.random() < 0.3 else words) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_streamed_pieces_join_to_the_whole_decode(tokenizers, name):
    tokenizer = tokenizers[name]
    for ids in answers(tokenizer, 60, seed=1):
        stream = StreamText(tokenizer.decode)
        pieces = [stream.push([i]) for i in ids] + [stream.finish()]
        assert "".join(pieces) == tokenizer.decode(ids), ids
        assert all(not p.endswith("\ufffd") for p in pieces[:-1] if p), "an incomplete character was sent"


def pipeline_on(tokenizer):
    """MII's ``MIIAsyncPipeline`` without its engine: the parts ``put_request`` and ``get_response`` use."""
    from mii.batching import ragged_batching
    from mii.modeling.tokenizers import HFTokenizer

    pipe = object.__new__(ragged_batching.MIIAsyncPipeline)
    pipe.local_rank, pipe.stop_thread, pipe.lock = 0, False, threading.Lock()
    pipe.uids, pipe.UID_RANGE_LB, pipe.UID_RANGE_UB = set(), 1, 10000
    pipe.tokenizer, pipe.result_queues, pipe.request_queue = HFTokenizer(tokenizer), {}, queue.Queue()
    pipe.make_request = lambda tid, uid, tokens, kwargs: (tid, uid)
    pipe.readable_stream = ragged_batching.ReadableStream(pipe.tokenizer)  # as MIIAsyncPipeline.__init__ builds it
    return pipe


def streamed(pipe, ids: list[int], end: bool = True) -> str:
    """One streamed request on this thread, as MII's gRPC handler runs it: put, then a response per token and a
    last one with no token and the finish reason."""
    from mii.constants import GenerationFinishReason

    uid = pipe.put_request("prompt", {})
    tid = threading.get_ident()
    for n, token in enumerate(ids, 1):
        pipe.result_queues[tid].put((uid, [token], 3, n, GenerationFinishReason.NONE, True))
    if end:
        pipe.result_queues[tid].put((uid, [], 3, len(ids), GenerationFinishReason.LENGTH, True))
    texts = [pipe.get_response()[1].generated_text for _ in range(len(ids) + end)]
    return "".join(texts)


def test_mii_loses_the_answer_after_a_lone_byte_and_ladles_server_keeps_it(tokenizers):
    tokenizer = tokenizers["tiny"]
    lone = next(i for i in range(len(tokenizer)) if tokenizer.decode([i]) == "\ufffd")
    word = tokenizer(" the", add_special_tokens=False).input_ids
    ids = [*word, *word, lone, *word, *word, lone]  # " the the\ufffd the the\ufffd", as the H200 run answered
    whole = tokenizer.decode(ids)

    mii_server.install()
    pipe = pipeline_on(tokenizer)
    pipe.readable_stream = mii_server.ReadableStream.replaces(pipe.tokenizer)  # MII's own
    assert streamed(pipe, ids) == tokenizer.decode(word * 2) != whole  # everything after the lone byte is lost

    pipe = pipeline_on(tokenizer)
    assert isinstance(pipe.readable_stream, mii_server.ReadableStream)
    assert streamed(pipe, ids) == whole  # every token, the held last byte included
    # A stream the client abandoned (no final response) leaves nothing for the thread's next request.
    assert streamed(pipe, [*word, lone], end=False) == tokenizer.decode(word)
    assert streamed(pipe, word * 3) == tokenizer.decode(word * 3)
    mii_server.install()  # twice: still one wrapper
    assert streamed(pipeline_on(tokenizer), ids) == whole


def test_mii_launches_ladles_server_module_with_its_own_arguments(monkeypatch):
    from mii.backend import server

    seen = []
    monkeypatch.setattr(subprocess, "Popen", lambda cmd, *a, **k: seen.append(cmd))
    monkeypatch.setattr(server, "subprocess", server.subprocess)  # restored after the test
    monkeypatch.setattr(server, "config_to_b64_str", lambda config: "CONFIG")
    mii_server.route_server_processes()
    server.MIIServer._launch_server_process(object(), None, "server", "deepspeed -i localhost:0 --no_python", ["--x 1"])
    assert seen == [
        ["deepspeed", "-i", "localhost:0", "--no_python", sys.executable, "-m", "ladle.serve.mii_server"]
        + ["--x", "1", "--model-config", "CONFIG"]
    ]
    with pytest.raises(RuntimeError, match="not -m mii.launch.multi_gpu_server.*deepspeed-mii==0.3.3"):
        mii_server.server_command(["python", "-m", "other.module"])


def test_the_module_runs_miis_server_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "ladle.serve.mii_server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "--load-balancer-port" in done.stdout and "--model-config" in done.stdout  # MII's own arguments


@pytest.mark.parametrize("name", ["tiny", "smollm2"])
def test_the_engines_detokenizer_streams_pieces_that_join_to_the_whole_decode(tokenizers, name):
    """The engine's streamed text (tokenizers' DecodeStream), token by token, lone bytes among the words: no
    piece ends in half a character, and the pieces join to the whole decode; ``read_at`` counts the tokens
    whose text is out (their log-probabilities go with it)."""
    from ladle.serve.rows import Job, decode_next

    tokenizer = tokenizers[name]
    for ids in answers(tokenizer, 60, seed=2):
        job, pieces = Job(ids=[1], max_new_tokens=64), []
        for token in ids:
            job.tokens.append(token)
            pieces.append(decode_next(tokenizer, job))
            assert not pieces[-1].endswith("\ufffd"), ids
            assert job.read_at <= len(job.tokens)
        pieces.append(decode_next(tokenizer, job, final=True))
        assert job.read_at == len(ids)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True), ids
