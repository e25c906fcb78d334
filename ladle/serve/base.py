"""What every serving backend is (``Backend``) and the registry that names them (``REGISTRY``); the backends
themselves are registered in ``ladle.serve.backends``."""

from __future__ import annotations

import importlib.util
from abc import ABC, abstractmethod
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
    serves_adapters: ClassVar[bool] = False
    """It serves LoRA adapters unmerged beside its base, requests for different ones in one batch
    (``ladle.serve.adapters``); such a backend has ``model_dir``, ``add_adapter`` and ``drop_adapter``."""

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


REGISTRY: Registry[type[Backend]] = Registry("serving backend", "serve.backend")
register = REGISTRY.register
get = REGISTRY.get
