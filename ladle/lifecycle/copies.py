"""A registered version's files on local disk, and the signature of a base model's folder.

Below the registry's users (the fleet, the planner, the serving core's registry sync): it imports only the platform
layer, so any of them can use it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ladle.errors import LadleError

SAMPLE = 1 << 16


def base_signature(base_dir: Path) -> str:
    """The base's ``config.json`` and, per weight file, its name, its size and three 64 KiB samples (the start,
    which holds a safetensors file's header of names, dtypes and shapes; the middle; the end). Reading whole
    weights would take minutes for a 70B base; any retrained or re-quantized checkpoint differs in these."""
    digest = hashlib.sha256((Path(base_dir) / "config.json").read_bytes())
    for file in sorted([*Path(base_dir).glob("*.safetensors"), *Path(base_dir).glob("*.bin")]):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            for offset in sorted({0, max(size // 2 - SAMPLE // 2, 0), max(size - SAMPLE, 0)}):
                handle.seek(offset)
                digest.update(handle.read(SAMPLE))
    return digest.hexdigest()


def local_copy(url: str, sha256: str, verify: bool = True) -> Path:
    """The folder at ``url`` on local disk (copied once from a remote store into ladle's home, keyed by
    ``sha256``, its weights checked against it when ``verify``: ``storage.cached_copy``)."""
    from ladle.platform import storage
    from ladle.platform.home import ladle_home

    if storage.is_local(url):
        return storage.local_path(url)
    key = storage.cache_key(sha256, "ladle.model_sha256")
    verified = sha256 if verify and storage.FULL_DIGEST.fullmatch(sha256) else None
    return storage.cached_copy(url, ladle_home() / "served" / key, verified)


def model_dir_of(version) -> Path:
    """A registered version's folder on local disk (copied once from a remote store).

    Raises:
        LadleError: a tag that is not a hash, a key that would land outside the copy.
    """
    made = f"{version.source}@v{version.version}-{version.created_ms}"  # a version registered without the tag
    tagged = version.tags.get("ladle.model_sha256")
    sha = tagged or hashlib.sha256(made.encode()).hexdigest()
    try:  # the weights are checked against the tag; a version registered without one is keyed, not checked
        return local_copy(version.source, sha, verify=bool(tagged))
    except ValueError as exc:
        raise LadleError(f"v{version.version}: {exc}") from None


def full_model_dir_of(version) -> Path:
    """A full model of the version on local disk: its folder, or for an adapter (``promote.merge: false``) the
    merged copy its run scored (``ladle.merged_url``), for scoring it or training from it."""
    if version.tags.get("ladle.kind") != "adapter":
        return model_dir_of(version)
    url, sha = version.tags.get("ladle.merged_url"), version.tags.get("ladle.merged_sha256")
    if not url or not sha:
        raise LadleError(
            f"{version.name} v{version.version} is an adapter registered without its merged copy (tags "
            "ladle.merged_url, ladle.merged_sha256); register it again from its run."
        )
    try:
        return local_copy(url, sha)
    except ValueError as exc:
        raise LadleError(f"v{version.version}: {exc}") from None
