"""A recipe's own chat template (``chat_template``) laid over its base: a folder of links to the base's files with
the template replaced, which preparation, training, the saved model and the server all read, so a model is
trained on the very template it is served with.

``ladle://templates/NAME`` names a shipped template (``recipes/templates/NAME.jinja``: ``chatml-tools`` is ChatML
with Hermes tool calls, for ChatML models such as SmolLM2 whose own template renders no tools); anything else is
a Jinja file, local or behind an fsspec URL. The overlay lives under ``$LADLE_HOME/models/templated-<digest>``,
named by the base folder and the template's text, so the data fingerprint (which reads the tokenizer's files)
changes with the template.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from ladle.errors import LadleError
from ladle.platform import storage
from ladle.platform.files import one_builder
from ladle.platform.home import ladle_home

SCHEME = "ladle://templates/"
TEMPLATE_FILE = "chat_template.jinja"


def shipped_templates() -> dict[str, Path]:
    from ladle.assets import recipes_dir

    return {p.stem: p for p in sorted((recipes_dir() / "templates").glob("*.jinja"))}


def template_text(ref: str) -> str:
    """The template ``ref`` names, as text.

    Raises:
        LadleError: no such shipped template, or the file cannot be read or is empty.
    """
    if ref.startswith(SCHEME):
        name = ref.removeprefix(SCHEME)
        shipped = shipped_templates()
        if name not in shipped:
            known = ", ".join(SCHEME + k for k in shipped)
            raise LadleError(f"chat_template = {ref!r}: no such shipped template. Use one of {known}, or a file.")
        return shipped[name].read_text()
    url = storage.normalise(ref)
    try:
        text = storage.read_bytes(url).decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise LadleError(
            f"chat_template = {ref!r}: cannot read it ({type(exc).__name__}: {exc}). Point it at a Jinja file."
        ) from None
    if not text.strip():
        raise LadleError(f"chat_template = {ref!r}: the file is empty. Point it at a Jinja chat template.")
    return text


def with_template(base: Path, ref: str | None) -> Path:
    """``base`` itself without ``ref``; else the overlay folder of ``base`` with ``ref``'s template (made once)."""
    if not ref:
        return base
    text = template_text(ref)
    digest = hashlib.sha256(f"{base.resolve()}\0{text}".encode()).hexdigest()[:16]
    target = ladle_home() / "models" / f"templated-{digest}"
    if (target / TEMPLATE_FILE).is_file():
        return target
    with one_builder(target, deadline_s=60.0):
        if not (target / TEMPLATE_FILE).is_file():
            build(base, text, target)
    return target


def build(base: Path, text: str, target: Path) -> None:
    """Links to every file of ``base`` but its template, the tokenizer config without its embedded template, and
    ``text`` as ``chat_template.jinja`` (written last: its presence marks the folder whole)."""
    target.mkdir(parents=True, exist_ok=True)
    for item in base.iterdir():
        if item.name in (TEMPLATE_FILE, "tokenizer_config.json") or item.name.startswith("."):
            continue
        link = target / item.name
        if not link.exists():
            os.symlink(item.resolve(), link)
    config = base / "tokenizer_config.json"
    if config.is_file():
        data = json.loads(config.read_text())
        data.pop("chat_template", None)  # the file below is the template (it wins only when the key is absent)
        (target / "tokenizer_config.json").write_text(json.dumps(data, indent=2))
    (target / (TEMPLATE_FILE + ".tmp")).write_text(text)
    os.replace(target / (TEMPLATE_FILE + ".tmp"), target / TEMPLATE_FILE)
