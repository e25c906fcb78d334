"""The transformers backend with its engine in this process, on its own thread: what a server's engine process
runs (``ladle.serve.engine_side``) and what tests drive directly. A server's backend is ``ladle.serve.client``'s
``EngineClient``, the same class's API side with the engine in a process of its own."""

from __future__ import annotations

from pathlib import Path

from ladle.errors import LadleError
from ladle.serve.base import Backend


class TransformersBackend(Backend):
    """Hugging Face ``generate`` on CPU or GPU, with concurrent requests batched (``ladle.serve.engine``)."""

    name = "transformers"
    title = "transformers"
    summary = "Hugging Face generate on CPU or GPU, concurrent requests batched"
    options = {"max_batch": int, "kv_tokens": int, "max_adapters": int, "adapters_mb": float}
    constrains_output = True
    serves_adapters = True

    def __init__(
        self, model_dir: str, max_batch: int = 32, kv_tokens: int = 0, max_adapters: int = 8, adapters_mb: float = 0.0
    ):
        """The engine in this process, on its own thread (what the engine process of a server runs, and what
        tests drive directly)."""
        from transformers import AutoConfig

        from ladle.machine.placement import load_placed
        from ladle.serve.adapters import Slots
        from ladle.serve.engine import Engine

        self.check_options(max_batch, kv_tokens, max_adapters, adapters_mb)
        self.model_dir = model_dir
        # transformers' own config: its attribute map reads every architecture's names (GPT-2's n_layer, ...).
        config = AutoConfig.from_pretrained(model_dir).get_text_config(decoder=True)
        self.sized(config, max_batch, kv_tokens)
        # One GPU, or the layers spread over every visible GPU when the weights and this KV cache do not fit one
        # (the planner's rule).
        model, self.tokenizer, device = load_placed(Path(model_dir), kv_cache_bytes(config, self.kv_tokens))
        self.slots = Slots(model, max_adapters, adapters_mb)
        self.engine = Engine(model, self.tokenizer, device, max_batch, kv_tokens=self.kv_tokens, adapters=self.slots)

    @staticmethod
    def check_options(max_batch: int, kv_tokens: int, max_adapters: int = 8, adapters_mb: float = 0.0) -> None:
        if not 1 <= max_batch <= 1024:
            raise LadleError(f"max_batch = {max_batch}: must be 1..1024 (serve.max_batch_size).")
        if kv_tokens < 0:
            raise LadleError(f"kv_tokens = {kv_tokens}: must be >= 0 (serve.kv_cache_tokens; 0: derived).")
        if not 1 <= max_adapters <= 1024:
            raise LadleError(f"max_adapters = {max_adapters}: must be 1..1024 (serve.adapters.max_loaded).")
        if adapters_mb < 0:
            raise LadleError(f"adapters_mb = {adapters_mb}: must be >= 0 (serve.adapters.max_mb; 0: no cap).")

    def add_adapter(self, key: str, path: str, size: int) -> None:
        """Register a LoRA adapter under the engine's ``key`` (loaded when a request first needs it)."""
        self.slots.register(key, path, size)

    def drop_adapter(self, key: str) -> None:
        """Forget ``key``: unloaded once no running row uses it."""
        self.slots.forget(key)

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
