"""Serving backends behind one interface: load a model folder, generate text.

A backend is one class registered here: its name, what it needs from the host
(``requires_cuda``, its package), the options it accepts and how it starts. The
config's ``serve.backend`` type, the CLI's choices and the one host check (used
by the planner, the deploy stage and the server alike) come from this registry.
``transformers`` runs anywhere (CPU or GPU); ``mii`` (DeepSpeed-MII) needs CUDA,
and choosing it on a host without it is an error, never a silent fallback.
"""

from __future__ import annotations

import importlib.util
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from ladle.errors import LadleError


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


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

    @classmethod
    def host_problems(cls, has_cuda: bool) -> list[str]:
        """What stops this backend on a host with (or without) a CUDA GPU; empty when it can run."""
        if cls.requires_cuda and not has_cuda:
            other = next((b.name for b in REGISTRY.values() if not b.requires_cuda), None)
            fix = f"Use serve.backend={other} or deploy on a GPU host." if other else "Deploy on a GPU host."
            return [f"serve.backend = {cls.name}: {cls.title} has no CPU path and this host has no CUDA GPU. {fix}"]
        if cls.package and importlib.util.find_spec(cls.package) is None:
            return [
                f"serve.backend = {cls.name}: the {cls.requirement} package is not installed. pip install {cls.requirement}."
            ]
        return []

    @classmethod
    def check_host(cls, has_cuda: bool | None = None) -> None:
        """Raise unless this host can run the backend (``has_cuda`` None: probe this machine).

        Raises:
            LadleError: the first problem, naming the field, the value and the fix.
        """
        if has_cuda is None:
            from ladle.topology import probe

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

    @abstractmethod
    def complete(self, prompt: str, max_tokens: int, temperature: float) -> Generation:
        """Continue raw ``prompt`` text."""

    @abstractmethod
    def chat(self, messages: list[dict], max_tokens: int, temperature: float) -> Generation:
        """Answer a conversation through the model's chat template."""


class TransformersBackend(Backend):
    """Hugging Face ``generate``; greedy when temperature is 0. One request at a time per model."""

    name = "transformers"
    title = "transformers"
    summary = "Hugging Face generate, on CPU or GPU"

    def __init__(self, model_dir: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.bfloat16 if self.device == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(self.device).eval()
        self.lock = threading.Lock()

    def _generate(self, text: str, max_tokens: int, temperature: float) -> Generation:
        ids = self.tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids.to(self.device)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with self.lock, self.torch.no_grad():
            out = self.model.generate(
                ids,
                attention_mask=self.torch.ones_like(ids),
                max_new_tokens=max_tokens,
                pad_token_id=self.tokenizer.pad_token_id,
                eos_token_id=self.tokenizer.eos_token_id,
                **sampling,
            )
        new = out[0, ids.shape[1] :].tolist()
        finished = bool(new) and new[-1] == self.tokenizer.eos_token_id
        text_out = self.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(text_out, ids.shape[1], len(new), "stop" if finished else "length")

    def complete(self, prompt, max_tokens, temperature):
        return self._generate(prompt, max_tokens, temperature)

    def chat(self, messages, max_tokens, temperature):
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self._generate(text, max_tokens, temperature)


class MiiBackend(Backend):
    """DeepSpeed-MII pipeline (GPU only)."""

    name = "mii"
    title = "DeepSpeed-MII"
    summary = "DeepSpeed-MII (needs CUDA GPUs)"
    requires_cuda = True
    package = "mii"
    requirement = "deepspeed-mii"
    options = {"tensor_parallel": int}

    def __init__(self, model_dir: str, tensor_parallel: int = 1):
        import mii
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pipe = mii.pipeline(model_dir, tensor_parallel=tensor_parallel)
        self.lock = threading.Lock()

    def complete(self, prompt, max_tokens, temperature):
        kwargs = {"max_new_tokens": max_tokens, "do_sample": temperature > 0}
        if temperature > 0:
            kwargs["temperature"] = temperature
        with self.lock:
            response = self.pipe([prompt], **kwargs)[0]
        return Generation(
            response.generated_text, response.prompt_length, response.generated_length, response.finish_reason
        )

    def chat(self, messages, max_tokens, temperature):
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.complete(text, max_tokens, temperature)


REGISTRY: dict[str, type[Backend]] = {}


def register(backend: type[Backend]) -> type[Backend]:
    """Add ``backend`` under its name.

    Raises:
        ValueError: the name is taken.
    """
    if backend.name in REGISTRY:
        raise ValueError(f"serving backend {backend.name!r} is already registered")
    REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> type[Backend]:
    """The backend called ``name``.

    Raises:
        LadleError: no such backend, with the choices.
    """
    if name not in REGISTRY:
        raise LadleError(f"backend = {name!r}: unknown serving backend. Use one of: {', '.join(REGISTRY)}.")
    return REGISTRY[name]


register(TransformersBackend)
register(MiiBackend)
