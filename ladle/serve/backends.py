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
import json
from pathlib import Path
from typing import Any

from ladle.serve.base import REGISTRY, Backend, get, register
from ladle.serve.client import EngineClient
from ladle.serve.transformers_backend import TransformersBackend, kv_cache_bytes

__all__ = [
    "REGISTRY",
    "Backend",
    "EngineClient",
    "MiiBackend",
    "TransformersBackend",
    "get",
    "kv_cache_bytes",
    "register",
]


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


register(EngineClient)  # "transformers": a server's API here, its engine in a process of its own
register(MiiBackend)
