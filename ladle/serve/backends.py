"""Serving backends behind one interface: load a model folder, generate text.

A backend is one class registered here: its name, what it needs from the host
(``requires_cuda``, its package), the options it accepts and how it starts. The
config's ``serve.backend`` type, the CLI's choices and the one host check (used
by the planner, the deploy stage and the server alike) come from this registry.
``transformers`` runs anywhere (CPU or GPU); ``mii`` (DeepSpeed-MII) needs CUDA,
and choosing it on a host without it is an error, never a silent fallback.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from ladle.errors import LadleError
from ladle.pluggable import Registry


class Backend(ABC):
    name: ClassVar[str]
    summary: ClassVar[str]
    title: ClassVar[str]
    """How messages call it (e.g. DeepSpeed-MII)."""
    requires_cuda: ClassVar[bool] = False
    package: ClassVar[str | None] = None
    """The module it imports, and the pip requirement that provides it."""
    requirement: ClassVar[str | None] = None
    options: ClassVar[dict[str, type]] = {}
    """Extra options its server accepts (``--option NAME=VALUE``), with their types."""
    supports_seed: ClassVar[bool] = True
    """It honours a request's ``seed`` (a seeded request to one that cannot is refused, not silently unseeded)."""
    supports_logprobs: ClassVar[bool] = True
    """It returns each generated token's log-probability (``logprobs``, ``top_logprobs``)."""
    adjusts_logits: ClassVar[bool] = True
    """It honours ``presence_penalty``, ``frequency_penalty``, ``repetition_penalty`` and ``logit_bias`` per
    request (a request that sets one to a backend that cannot is refused naming the field)."""
    constrains_output: ClassVar[bool] = False
    """It follows a request's ``response_format`` (JSON object or schema) by masking each token; such a backend
    has ``grammars()`` (``ladle.serve.structured.Grammars``)."""
    shards_model: ClassVar[bool] = False
    """It splits one replica over ``serve.tensor_parallel`` GPUs (the planner sizes it per device)."""

    @classmethod
    def host_problems(cls, has_cuda: bool, installed_here: bool = True) -> list[str]:
        """What stops this backend on a host with (or without) a CUDA GPU; empty when it can run.
        ``installed_here`` False: the host is a recorded one, whose packages are not this machine's."""
        if cls.requires_cuda and not has_cuda:
            other = next((b.name for b in REGISTRY.values() if not b.requires_cuda), None)
            fix = f"Use serve.backend={other} or deploy on a GPU host." if other else "Deploy on a GPU host."
            return [f"serve.backend = {cls.name}: {cls.title} has no CPU path and this host has no CUDA GPU. {fix}"]
        if installed_here and cls.package and importlib.util.find_spec(cls.package) is None:
            return [
                f"serve.backend = {cls.name}: the {cls.requirement} package is not installed. pip install {cls.requirement}."
            ]
        return []

    @classmethod
    def model_problems(cls, config: dict, dtype: str) -> list[str]:
        """What stops this backend serving a model with ``config`` (its ``config.json``) saved in ``dtype``;
        empty when it can. The planner asks before anything trains."""
        return []

    @classmethod
    def check_host(cls, has_cuda: bool | None = None) -> None:
        """Raise unless this host can run the backend (``has_cuda`` None: probe this machine).

        Raises:
            LadleError: the first problem, naming the field, the value and the fix.
        """
        if has_cuda is None:
            from ladle.machine.topology import probe

            has_cuda = probe().gpu_count > 0
        problems = cls.host_problems(has_cuda)
        if problems:
            raise LadleError(problems[0])

    @classmethod
    def parse_options(cls, items: list[str]) -> dict[str, Any]:
        """``NAME=VALUE`` strings as typed keyword arguments for ``start``.

        Raises:
            LadleError: an option this backend does not accept, or a value of the wrong type.
        """
        out: dict[str, Any] = {}
        accepted = ", ".join(cls.options) or "none"
        for item in items:
            key, _, text = item.partition("=")
            kind = cls.options.get(key.strip())
            if kind is None:
                raise LadleError(
                    f"--option {item!r}: backend {cls.name} accepts no option {key!r} (it accepts: {accepted})."
                )
            try:
                out[key.strip()] = kind(text)
            except ValueError:
                raise LadleError(f"--option {item!r}: {key} must be a {kind.__name__}.") from None
        return out

    @classmethod
    def start(cls, model_dir: str, **options) -> Backend:
        """Load ``model_dir`` and return the ready backend (the host was checked first)."""
        cls.check_host()
        return cls(model_dir, **options)

    context_length: int
    """Tokens the model attends over: a prompt plus its completion must fit."""
    vocab_size: int | None = None
    """Token ids the model scores (``logit_bias`` keys must be below it); None: not known."""
    max_batch: int = 1
    """Requests generated together."""
    kv_tokens: int | None = None
    """KV cache columns (rows x padded width) this server holds across its batch; a request whose prompt and
    ``max_tokens`` exceed it can never run and is refused. None: the backend's engine sizes its own cache."""

    @abstractmethod
    def encode(self, prompt: str) -> list[int]:
        """Token ids of raw ``prompt`` text."""

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (a prompt sent as ids, echoed back); the backend's tokenizer decodes them."""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    @abstractmethod
    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a conversation (and the tools it may call) through the model's chat template, ready for
        the assistant's turn."""

    @abstractmethod
    def submit(self, job) -> None:
        """Queue ``job`` (a ``ladle.serve.rows.Job``); its ``emit`` receives ``text``, then ``done`` or ``error``."""

    def ready(self) -> bool:
        """Whether requests are being served (the model is loaded and its generation loop alive)."""
        return self.live()

    def live(self) -> bool:
        """Whether the process is worth keeping: False once its engine fails every step, so it is replaced."""
        return True

    def queue_depth(self) -> int:
        """Requests waiting for a batch."""
        return 0

    def cancel(self, job) -> None:
        """The request's client went away: its generation stops at the next step."""
        job.cancelled.set()

    def report_batches(self, observe) -> None:  # noqa: B027 - optional: a backend without batches reports none
        """Call ``observe(size)`` with the size of each generation batch (the server's batch histogram)."""

    def close(self) -> None:  # noqa: B027 - optional: most backends start no process of their own
        """Stop what the backend started (its server processes); the server calls it on the way out."""


class TransformersBackend(Backend):
    """Hugging Face ``generate`` on CPU or GPU, with concurrent requests batched (``ladle.serve.engine``)."""

    name = "transformers"
    title = "transformers"
    summary = "Hugging Face generate on CPU or GPU, concurrent requests batched"
    options = {"max_batch": int, "kv_tokens": int}
    constrains_output = True

    def __init__(self, model_dir: str, max_batch: int = 32, kv_tokens: int = 0):
        """The engine in this process, on its own thread (what the engine process of a server runs, and what
        tests drive directly); ``start`` gives a server's split backend (``ladle.serve.client``)."""
        from transformers import AutoConfig

        from ladle.machine.placement import load_placed
        from ladle.serve.engine import Engine

        self.check_options(max_batch, kv_tokens)
        # transformers' own config: its attribute map reads every architecture's names (GPT-2's n_layer, ...).
        config = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)
        self.sized(config, max_batch, kv_tokens)
        # One GPU, or the layers spread over every visible GPU when the weights and this KV cache do not fit one
        # (the planner's rule).
        model, self.tokenizer, device = load_placed(Path(model_dir), kv_cache_bytes(config, self.kv_tokens))
        self.engine = Engine(model, self.tokenizer, device, max_batch, kv_tokens=self.kv_tokens)

    @classmethod
    def start(cls, model_dir: str, **options) -> Backend:
        """A server's backend: the API here, the engine in a process of its own (``ladle.serve.client``)."""
        from ladle.serve.client import EngineClient

        cls.check_host()
        return EngineClient(model_dir, **options)

    @staticmethod
    def check_options(max_batch: int, kv_tokens: int) -> None:
        if not 1 <= max_batch <= 1024:
            raise LadleError(f"max_batch = {max_batch}: must be 1..1024 (serve.max_batch_size).")
        if kv_tokens < 0:
            raise LadleError(f"kv_tokens = {kv_tokens}: must be >= 0 (serve.kv_cache_tokens; 0: derived).")

    def sized(self, config, max_batch: int, kv_tokens: int) -> None:
        """The server's bounds from the model's config: its context, vocabulary, batch and KV budget."""
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 2048)
        self.vocab_size = int(config.vocab_size)
        self.max_batch = max_batch
        # 0: every row may reach the model's context (the bound a standalone server has without a plan).
        self.kv_tokens = kv_tokens or max_batch * self.context_length

    def report_batches(self, observe) -> None:
        self.engine.on_batch = observe

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False).input_ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def grammars(self):
        """The grammar side of structured outputs (``ladle.serve.structured``), made on first use."""
        if getattr(self, "_grammars", None) is None:
            from ladle.serve.structured import Grammars

            self._grammars = Grammars(self.tokenizer, self.vocab_size, self.engine.eos)
        return self._grammars

    def submit(self, job) -> None:
        self.engine.submit(job)

    def live(self) -> bool:
        return self.engine.alive() and self.engine.healthy()

    def queue_depth(self) -> int:
        return self.engine.depth()


def kv_cache_bytes(config, tokens: int) -> int:
    """Keys and values of ``tokens`` cache columns over every layer of a transformers text config, in 16-bit (a
    GPU's serving dtype)."""
    from ladle.sizing import kv_bytes, kv_dim_of

    heads = config.num_attention_heads
    shape = {
        "num_attention_heads": heads,
        "num_key_value_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None),
        "hidden_size": config.hidden_size,
    }
    return kv_bytes(config.num_hidden_layers, kv_dim_of(shape), tokens, 2)


class MiiBackend(Backend):
    """A persistent DeepSpeed-MII deployment (GPU only): ``mii.serve`` starts MII's own server processes
    (tensor-parallel ranks x replicas, under DeepSpeed's launcher) and its load balancer, on ports of their own;
    requests go to it through MII's asynchronous client, whose FastGen engine batches them continuously.

    Every request is a coroutine on one event loop, in one thread of this backend's (``ladle-mii``): MII's
    client binds its gRPC channel to the loop it is made on, and its synchronous ``generate`` runs that loop
    itself, so neither a client shared across threads (``This event loop is already running``) nor a loop per
    thread (one channel each) holds concurrent traffic. Keeping the requests off uvicorn's own loop leaves
    ``/health`` answering under load, as with the transformers engine's thread. ``ready`` is the deployment's
    truth: the loop runs and every process MII started is alive. ``close`` (and any failed start) stops every
    process the deployment spawned."""

    name = "mii"
    shards_model = True
    title = "DeepSpeed-MII"
    summary = "a persistent DeepSpeed-MII (FastGen) deployment, tensor parallel (needs CUDA GPUs)"
    requires_cuda = True
    supports_seed = False
    adjusts_logits = False  # FastGen's sampling takes temperature, top-p and top-k only
    supports_logprobs = False  # MII returns text, not per-token log-probabilities
    constrains_output = False  # FastGen samples without per-request token masks
    package = "mii"
    requirement = "deepspeed-mii"
    options = {"tensor_parallel": int, "replica_num": int, "start_timeout_s": float, "max_batch": int}

    @classmethod
    def model_problems(cls, config: dict, dtype: str) -> list[str]:
        from ladle.serve.fastgen import fastgen_problems

        return fastgen_problems(config, dtype)

    def __init__(
        self,
        model_dir: str,
        tensor_parallel: int = 0,
        replica_num: int = 1,
        start_timeout_s: float = 600.0,
        max_batch: int = 32,
    ):
        import time

        import torch
        from transformers import AutoTokenizer

        from ladle.serve import fastgen

        fastgen.check_architecture(model_dir)
        tp = tensor_parallel or torch.cuda.device_count()  # 0: every GPU this server was given
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        config = json.loads(Path(model_dir, "config.json").read_text(encoding="utf-8"))
        self.context_length = int(config.get("max_position_embeddings") or 2048)
        self.max_batch, self.processes, self.loop, self.in_flight = max_batch, [], None, set()
        began = time.monotonic()
        if torch.cuda.is_available():
            built = fastgen.prebuild_ops(start_timeout_s)
            print(f"DeepSpeed FastGen ops ready in {built:.1f} s (built on a first start, then loaded)", flush=True)
        ports = fastgen.Ports.pick(tp, replica_num)
        what = f"the DeepSpeed-MII deployment (tensor_parallel={tp}, replica_num={replica_num}, ports {ports})"
        deployment, self.processes = fastgen.start_within(
            lambda: serve_deployment(model_dir, tp, replica_num, ports), start_timeout_s, what
        )
        try:
            self.start_loop(deployment)
        except BaseException:
            self.close()
            raise
        print(f"{what} serving after {time.monotonic() - began:.1f} s, {len(self.processes)} process(es)", flush=True)

    def start_loop(self, deployment) -> None:
        """The backend's event loop thread, and MII's client made on it."""
        import asyncio
        import threading

        from mii.backend import MIIClient

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="ladle-mii", daemon=True)
        self.thread.start()

        async def client():
            return MIIClient(deployment)  # its get_event_loop() is this running loop: the channel binds here

        self.client = asyncio.run_coroutine_threadsafe(client(), self.loop).result(timeout=60)

    def encode(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt, add_special_tokens=False).input_ids

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        return self.encode(text)

    def submit(self, job) -> None:
        import asyncio

        # The loop keeps only a weak reference to a task: without this one, a request waiting on MII's stream
        # can be garbage collected mid-answer ("Task was destroyed but it is pending") and never end.
        future = asyncio.run_coroutine_threadsafe(self.generate(job), self.loop)
        self.in_flight.add(future)
        future.add_done_callback(self.in_flight.discard)

    def queue_depth(self) -> int:
        return len(self.in_flight)

    async def generate(self, job) -> None:
        """One request through the deployment, its text streamed as MII produces it. The stream's last
        response carries the finish reason and the token count; a client gone away closes the stream."""
        import asyncio
        import time

        kwargs: dict[str, Any] = {
            "stream": True,
            "max_new_tokens": job.max_new_tokens,
            "do_sample": job.temperature > 0,
        }
        if job.temperature > 0:
            kwargs.update(temperature=job.temperature, top_p=job.top_p)
        if job.stop:
            kwargs["stop"] = job.stop
        stream = self.client._request_async_response_stream([self.tokenizer.decode(job.ids)], **kwargs)
        last = None
        try:
            # FastGen's queue is MII's own: the request's wait (serve.limits.queue_timeout_s) runs to its first
            # message, and a request that gets none in time is ended and answered 503, as the engine's are.
            left = None if job.deadline is None else max(0.0, job.deadline - time.monotonic())
            try:
                first = await asyncio.wait_for(anext(stream, None), timeout=left)  # None: it ended at once
            except TimeoutError:
                job.emit(
                    "error",
                    {
                        "message": f"the request had no answer from the MII deployment within {left:.1f} s "
                        "(serve.limits.queue_timeout_s); retry later",
                        "status": 503,
                        "code": "queue_timeout",
                    },
                )
                return
            responses = prepend(first, stream) if first is not None else stream
            async for (response,) in responses:  # one prompt: one response per message
                if job.cancelled.is_set():
                    return
                if response.generated_text:
                    job.emit("text", {"text": response.generated_text})
                last = response
        except Exception as exc:
            job.emit("error", {"message": f"the MII deployment failed: {type(exc).__name__}: {exc}"})
            return
        finally:
            with contextlib.suppress(Exception):  # a stream already broken has nothing left to close
                await stream.aclose()
        if last is None:
            job.emit("error", {"message": "the MII deployment ended the stream without a response"})
            return
        job.emit(
            "done",
            {
                "finish_reason": "length" if str(last.finish_reason).endswith("length") else "stop",
                "prompt_tokens": len(job.ids),
                "completion_tokens": last.generated_length,
            },
        )

    def ready(self) -> bool:
        from ladle.platform.processes import running

        return self.loop is not None and self.thread.is_alive() and all(running(p) for p in self.processes)

    def close(self) -> None:
        from ladle.platform.processes import stop_all

        stop_all(self.processes)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)


async def prepend(first, rest):
    """``first``, then what ``rest`` yields."""
    yield first
    async for item in rest:
        yield item


def serve_deployment(model_dir: str, tensor_parallel: int, replica_num: int, ports):
    """``mii.serve`` on its own ports with an arch list DeepSpeed can parse; returns the deployment's MII config.
    Runs in the start thread: MII makes a (discarded) client there, which needs a current event loop."""
    import asyncio
    import os
    import uuid

    import mii

    from ladle.machine import cuda_arch
    from ladle.serve import mii_server

    os.environ.update(cuda_arch.fixed_env()[0])  # MII's server processes inherit it
    mii_server.route_server_processes()  # they run MII's server with exact streamed text (ladle.serve.mii_server)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        client = mii.serve(
            model_dir,
            deployment_name=f"ladle-{os.getpid()}-{uuid.uuid4().hex[:8]}",
            tensor_parallel=tensor_parallel,
            replica_num=replica_num,
            port_number=ports.port_number,
            torch_dist_port=ports.torch_dist_port,
            zmq_port_number=ports.zmq_port_number,
        )
        return client.mii_config
    finally:
        asyncio.set_event_loop(None)
        loop.close()


REGISTRY: Registry[type[Backend]] = Registry("serving backend", "serve.backend")
register = REGISTRY.register
get = REGISTRY.get


register(TransformersBackend)
register(MiiBackend)
