"""Serving backends behind one interface: load a model folder, generate text.

``transformers`` runs anywhere (CPU or GPU). ``mii`` (DeepSpeed-MII) needs CUDA;
on a host without it, choosing it is an error, never a silent fallback.
"""

from __future__ import annotations

import shutil
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ladle.errors import LadleError


@dataclass
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


class Backend(ABC):
    name: str

    @abstractmethod
    def complete(self, prompt: str, max_tokens: int, temperature: float) -> Generation:
        """Continue raw ``prompt`` text."""

    @abstractmethod
    def chat(self, messages: list[dict], max_tokens: int, temperature: float) -> Generation:
        """Answer a conversation through the model's chat template."""


class TransformersBackend(Backend):
    """Hugging Face ``generate``; greedy when temperature is 0. One request at a time per model."""

    name = "transformers"

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


def check_mii_host() -> None:
    """Raise unless this host can run DeepSpeed-MII (CUDA GPU and the mii package)."""
    import importlib.util

    if shutil.which("nvidia-smi") is None:
        raise LadleError(
            "serve.backend = mii: DeepSpeed-MII has no CPU path and this host has no CUDA GPU. "
            "Use serve.backend=transformers or deploy on a GPU host."
        )
    if importlib.util.find_spec("mii") is None:
        raise LadleError("serve.backend = mii: the deepspeed-mii package is not installed. pip install deepspeed-mii.")


class MiiBackend(Backend):
    """DeepSpeed-MII pipeline (GPU only)."""

    name = "mii"

    def __init__(self, model_dir: str, tensor_parallel: int = 1):
        check_mii_host()
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


BACKENDS: dict[str, type[Backend]] = {"transformers": TransformersBackend, "mii": MiiBackend}
