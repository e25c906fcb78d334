"""The fast paths of a training step (``training.kernels``), as the plan decides them: ``decide`` from the config,
the strategy's traits and the device (no torch import), ``problems`` for settings that cannot run, and what the
memory model should expect. What each path is and how the worker applies it: ``ladle.train.kernels``."""

from __future__ import annotations

from ladle import strategies


def with_trait(trait: str) -> list[str]:
    """The registered strategies that have ``trait`` (``Strategy.compiles_blocks`` ...), in registry order."""
    return [s.name for s in strategies.REGISTRY.values() if getattr(s, trait)]


def decide(
    kernels,
    strategy: str,
    device: str,
    dtype: str,
    compile_asked: str | None = None,
    whole_forward: bool | None = None,
    rows: str = "packed",
) -> tuple[dict, list[str]]:
    """The plan's fast paths for ``strategy`` (its name) on ``device``: a dict the worker reads, and one reason
    each. ``rows``: ``packed`` rows of examples, or grpo's ``rollouts`` (a prompt and its completion per row, padded
    and masked, each sampled token scored by the trainer itself: no fused loss, no joining, no packed attention).
    ``compile_asked``: the strategy's own option that asks for compiled blocks (``Strategy.compile_asked``);
    ``whole_forward``: whether each rank runs the whole forward with the strategy's options (its trait when not
    given)."""
    cuda = device == "cuda"
    traits = strategies.get(strategy)
    whole = traits.whole_forward if whole_forward is None else whole_forward
    compile_on, why = compile_decision(kernels, strategy, cuda, traits.compiles_blocks, compile_asked)
    loss, loss_why = fused_loss_decision(kernels, strategy, cuda, whole)
    liger, liger_why = liger_decision(kernels, cuda, compile_on)
    joined, joined_why = padding_free_decision(kernels, strategy, whole)
    by_example, by_example_why = packed_attention_decision(kernels, strategy, whole)
    if rows == "rollouts":
        rollout_why = "off: grpo rows are a prompt and its completion, padded and masked"
        loss, loss_why = "off", "off: grpo scores each sampled token itself"
        by_example, by_example_why = "off", rollout_why
        if joined and kernels.padding_free == "auto":
            joined_why = (
                "each micro-batch's completions scored as one row of their real tokens, where the model's attention "
                "is plain causal attention and its prompts run apart from them (no activation checkpointing)"
            )
        if compile_on and not compile_asked:  # the engine decodes through the same blocks, one shape per step
            compile_on, why = False, "off: grpo's rollouts decode through the blocks with a cache that grows each token"
    lora_fused, lora_fused_why = lora_fused_decision(kernels, strategy, cuda, traits.fuses_lora)
    lora_compute = kernels.lora_compute
    sixteen = dtype != "float32"
    decided = {
        "compile": compile_on,
        "fused_loss": loss,
        "loss_chunk_mib": kernels.loss_chunk_mib,
        "liger": liger,
        "lora_compute": lora_compute if sixteen else "float32",
        "padding_free": joined,
        "packed_attention": by_example,
        "lora_fused": lora_fused,
    }
    reasons = [
        f"kernels: per-block compile {why}; fused loss {loss_why}; Liger RMSNorm/SwiGLU/RoPE {liger_why}; "
        + (
            f"LoRA adapters compute in {dtype} from float32 master weights"
            if sixteen and lora_compute == "run_dtype"
            else "LoRA adapters compute in float32"
        )
        + f"; padding-free micro-batches {joined_why}; attention example by example {by_example_why}"
        + f"; fused LoRA layers {lora_fused_why}"
    ]
    return decided, reasons


def compile_decision(kernels, strategy: str, cuda: bool, compiles: bool, asked: str | None) -> tuple[bool, str]:
    """Per-block ``torch.compile``: auto on CUDA for a strategy whose blocks compile; the strategy's own option
    asking for it wins."""
    if kernels.compile == "auto":
        on = cuda and compiles
        why = (
            "on: CUDA and a strategy whose blocks compile"
            if on
            else ("off: CPU, where compiling costs more than short runs gain" if not cuda else f"off: {strategy}")
        )
    else:
        on = bool(kernels.compile)
        why = "on (training.kernels.compile = true)" if on else "off (training.kernels.compile = false)"
    if asked and not on:
        on, why = True, f"on ({asked})"
    return on, why


def fused_loss_decision(kernels, strategy: str, cuda: bool, whole: bool) -> tuple[str, str]:
    """The fused (or chunked) head and cross-entropy: off where a strategy computes its loss in its own stages."""
    if kernels.fused_loss == "off" or not whole:
        why = (
            "off (training.kernels.fused_loss = off)"
            if kernels.fused_loss == "off"
            else f"off: {strategy} computes its loss in its own stages"
        )
        return "off", why
    if kernels.fused_loss == "auto":
        if cuda:
            return (
                "auto",
                "Liger's fused linear cross-entropy where liger-kernel is installed on the training host, else chunked",
            )
        return "chunked", "chunked (Liger needs CUDA)"
    return kernels.fused_loss, f"{kernels.fused_loss} (training.kernels.fused_loss)"


def liger_decision(kernels, cuda: bool, compile_on: bool) -> tuple[str, str]:
    """Liger's RMSNorm/SwiGLU/RoPE kernels: auto on CUDA unless the blocks are compiled (inductor fuses them)."""
    if kernels.liger != "auto":
        liger = "on" if kernels.liger else "off"
        return liger, f"{liger} (training.kernels.liger)"
    if cuda and not compile_on:
        return "auto", "where liger-kernel is installed on the training host"
    return "off", "off: the blocks are compiled (inductor fuses the same)" if cuda else "off: CPU"


def padding_free_decision(kernels, strategy: str, whole: bool) -> tuple[bool, str]:
    """A micro-batch's rows joined into one row of their real tokens, where the strategy allows other shapes."""
    if kernels.padding_free != "auto":
        joined = bool(kernels.padding_free)
        return joined, f"{'on' if joined else 'off'} (training.kernels.padding_free)"
    if whole:
        return True, "per micro-batch, where one row of its real tokens computes less than its padded rows"
    return False, f"off: {strategy} keeps fixed row shapes"


def packed_attention_decision(kernels, strategy: str, whole: bool) -> tuple[str, str]:
    """Attention example by example inside a packed row."""
    if kernels.packed_attention != "auto":
        by_example = "on" if kernels.packed_attention else "off"
        return by_example, f"{by_example} (training.kernels.packed_attention)"
    # On CUDA since 2026-11-28: the 8B LoRA row on one H200 ran 1.26x faster (14,511 vs 11,488 tokens/s, the same
    # losses) and 1.5 GiB lower, its compiled blocks calling SDPA's flash kernel per example.
    if whole:
        return "auto", "on where the model's attention is plain causal attention"
    return "off", f"off: {strategy} keeps its own attention masks"


def lora_fused_decision(kernels, strategy: str, cuda: bool, fuses: bool) -> tuple[bool, str]:
    """Fused LoRA layers (``ladle.train.lora_fused``): auto on CPU for strategies that call whole modules."""
    if kernels.lora_fused != "auto":
        on = bool(kernels.lora_fused)
        return on, f"{'on' if on else 'off'} (training.kernels.lora_fused)"
    if fuses and not cuda:
        return True, "one autograd function per adapted layer (merged where a call's tokens outnumber its widths)"
    return False, "off: not yet run on a GPU" if cuda else f"off: {strategy} gathers each module's weights as called"


def problems(kernels, strategy: str, device: str, whole_forward: bool | None = None) -> list[str]:
    """Settings that cannot run: named field, value, why, and the fix."""
    traits = strategies.get(strategy)
    compiling = ", ".join(with_trait("compiles_blocks"))
    whole = ", ".join(with_trait("whole_forward"))
    found = []
    if kernels.compile is True and not traits.compiles_blocks:
        found.append(
            f"training.kernels.compile = true with parallelism.strategy = {strategy}: per-block compile runs "
            f"with {compiling} only. Set training.kernels.compile=auto or false."
        )
    if kernels.compile is True and device == "cpu":
        import shutil

        if not (shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")):
            found.append(
                "training.kernels.compile = true on a CPU: inductor compiles C++ and this host has no C++ "
                "compiler (g++, c++ or clang++ on PATH). Install one or set training.kernels.compile=false."
            )
    if kernels.liger is True and device != "cuda":
        found.append(
            "training.kernels.liger = true: Liger's kernels are Triton kernels for CUDA and this run is on the CPU. "
            "Set training.kernels.liger=auto or false."
        )
    runs_whole = traits.whole_forward if whole_forward is None else whole_forward  # nd with sp runs whole forwards
    if kernels.padding_free is True and not runs_whole:
        found.append(
            f"training.kernels.padding_free = true with parallelism.strategy = {strategy}: {strategy}'s stages "
            f"need rows of one fixed shape; padding-free micro-batches run with {whole}. "
            "Set training.kernels.padding_free=auto or false."
        )
    if kernels.packed_attention is True and not runs_whole:
        found.append(
            f"training.kernels.packed_attention = true with parallelism.strategy = {strategy}: {strategy}'s stages "
            f"build their own attention masks; attention example by example runs with "
            f"{whole}. Set training.kernels.packed_attention=auto or false."
        )
    if kernels.lora_fused is True and not traits.fuses_lora:
        fusing = ", ".join(with_trait("fuses_lora"))
        found.append(
            f"training.kernels.lora_fused = true with parallelism.strategy = {strategy}: the fused LoRA layer "
            f"reads its weights itself and runs with {fusing} only. Set training.kernels.lora_fused=auto or false."
        )
    if kernels.fused_loss == "liger" and not traits.plain_head:
        found.append(
            f"training.kernels.fused_loss = liger with parallelism.strategy = {strategy}: Liger's kernel needs the "
            f"head as a plain linear layer, which {strategy} does not keep. Set training.kernels.fused_loss=chunked "
            "or auto."
        )
    if kernels.fused_loss == "liger" and device != "cuda":
        found.append(
            "training.kernels.fused_loss = liger: Liger's fused linear cross-entropy needs CUDA and this run is on "
            "the CPU. Set training.kernels.fused_loss=chunked (the same loss on any device) or auto."
        )
    return found


def liger_loss_expected(kernels, device: str) -> bool:
    """Whether the memory model should expect Liger's fused loss: asked for, or auto with liger-kernel installed
    where the plan is made (the training host for local runs)."""
    if device != "cuda" or kernels.fused_loss in ("off", "chunked"):
        return False
    return kernels.fused_loss == "liger" or liger_importable()


def compile_expected(kernels, device: str) -> bool:
    """Whether blocks are compiled where the strategy compiles them (the memory model's activation factor)."""
    return device == "cuda" and (kernels.compile is True or kernels.compile == "auto")


def mask_expected(kernels, device: str, unsupported: str | None) -> bool:
    """Whether packed rows reach a CUDA run's attention as a block-diagonal mask (the memory model counts it):
    attention example by example is off, or the model's attention is not one ladle's can replace."""
    return device == "cuda" and (kernels.packed_attention is False or unsupported is not None)


def liger_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("liger_kernel") is not None
