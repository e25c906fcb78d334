"""The artifact store: every stage output goes through fsspec URLs.

A folder artifact (dataset, checkpoint, adapter, merged model) is complete only
when its ``_COMPLETE`` marker exists; the marker is written last, so a crash
mid-write never leaves something that looks complete, on local disk or on S3.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
from fsspec.core import url_to_fs

from ladle.platform.files import building, write_atomic

COMPLETE_MARKER = "_COMPLETE"


DEADLINES_ENV = "LADLE_STORAGE_DEADLINES"
"""``storage.*`` as JSON, for the processes started from here (read when this module is imported)."""


def apply_deadlines(cfg) -> None:
    """``storage.*`` deadlines for every S3 filesystem created from now on, here and in the processes started
    from here (``DEADLINES_ENV``)."""
    settings = {
        "connect_timeout": cfg.storage.connect_timeout_s,
        "read_timeout": cfg.storage.read_timeout_s,
        "retries": {"max_attempts": cfg.storage.retries + 1, "mode": "standard"},
    }
    os.environ[DEADLINES_ENV] = json.dumps(settings)
    install_deadlines(settings)


def install_deadlines(settings: dict) -> None:
    """botocore's client config for S3 filesystems (fsspec's config), and s3fs's own retry loop set to one
    try: botocore's standard-mode retries (with backoff; throttling retried too) are the only ones, so a store
    that never answers is reported after about ``max_attempts x read_timeout`` (s3fs's defaults held one
    request for minutes)."""
    import fsspec.config

    for proto in ("s3", "s3a"):
        fsspec.config.conf.setdefault(proto, {})["config_kwargs"] = dict(settings)
    try:
        import s3fs
    except ImportError:  # no S3 support installed: nothing to bound
        return
    s3fs.S3FileSystem.retries = 1


if DEADLINES_ENV in os.environ:
    install_deadlines(json.loads(os.environ[DEADLINES_ENV]))


def join(url: str, *parts: str) -> str:
    """Join URL path parts with ``/`` (works for local paths and URLs)."""
    out = url.rstrip("/")
    for part in parts:
        out = f"{out}/{part.strip('/')}"
    return out


def is_local(url: str) -> bool:
    """True for plain paths and ``file://`` URLs."""
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> Path:
    """The filesystem path of a local URL (plain path or ``file://``)."""
    return Path(url.removeprefix("file://"))


def cached_copy(url: str, target: Path, sha256: str | None = None) -> Path:
    """A local copy of the folder artifact at ``url`` in ``target``, downloaded once.

    The download lands in a folder of this process's own beside ``target`` and is renamed into place, so a
    ``target`` that exists is always complete, and two processes making the first copy at once never write into
    one folder (the second to finish finds the first's copy and drops its own). With ``sha256`` (the weights'
    digest ladle recorded when it wrote them: ``weights_hash``) the download's weights are hashed before the
    rename, and a copy whose weights differ (a tampered, half-written or replaced store object) is dropped with
    an error: a cached copy was always verified when it was made.

    Raises:
        ValueError: the downloaded weights' digest is not ``sha256`` (both named).
    """
    if target.is_dir() and any(target.iterdir()):  # ``building`` renames only whole copies into place
        return target
    with building(target) as tmp:
        download_dir(url, tmp)
        if sha256 is not None:
            found = weights_hash(tmp)
            if found != sha256:
                raise ValueError(
                    f"{url}: its weights' SHA-256 is {found[:16]}..., not the {sha256[:16]}... recorded when they "
                    "were written (ladle.model_sha256): the store's copy was changed or is incomplete, and is not "
                    "served. Restore the folder from the run that wrote it, or register a new version."
                )
    return target


def source_fingerprint(url: str) -> str:
    """A digest of what the folder at ``url`` holds now, from its listing alone (each file's name, size and the
    store's change marker: ETag, mtime or LastModified): what changes when a file there is replaced."""
    import hashlib

    fs, root = filesystem(url)
    listed = fs.find(root, detail=True)
    marks = []
    for path, info in sorted(listed.items()):
        change = next(
            (info[k] for k in ("ETag", "etag", "mtime", "LastModified", "last_modified", "created") if k in info), ""
        )
        marks.append(f"{path.removeprefix(root)}|{info.get('size')}|{change}")
    return hashlib.sha256("\n".join(marks).encode()).hexdigest()


def current_copy(url: str, root: Path, keep: int = 2) -> Path:
    """A local copy of the folder at ``url``, a mutable location (an adapter a user points a server at): made
    again when what is there changed since the last copy (``source_fingerprint``), each copy in a folder of its
    own under ``root`` (one still being read is never replaced), and only the ``keep`` newest copies of ``url``
    kept.

    Raises:
        FileNotFoundError: nothing is at ``url``.
    """
    import hashlib

    prefix = hashlib.sha256(url.encode()).hexdigest()[:16]
    fingerprint = source_fingerprint(url)
    if fingerprint == hashlib.sha256(b"").hexdigest():
        raise FileNotFoundError(f"{url}: no files there")
    target = cached_copy(url, root / f"{prefix}-{fingerprint[:16]}")
    os.utime(target)  # the newest in use, whether made now or before
    copies = sorted(root.glob(f"{prefix}-*"), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in copies[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def weights_hash(folder: Path) -> str:
    """SHA-256 over a model folder's ``*.safetensors`` files in name order, streamed (a merged 70B is 140 GB)."""
    import hashlib

    digest = hashlib.sha256()
    for file in sorted(Path(folder).glob("*.safetensors")):
        with file.open("rb") as f:
            while chunk := f.read(2**23):
                digest.update(chunk)
    return digest.hexdigest()


FULL_DIGEST = re.compile(r"[0-9a-f]{64}")


CACHE_KEY = re.compile(r"[0-9a-f]{16,128}")


def cache_key(sha256: str, what: str) -> str:
    """The folder name a content hash keys a local copy with (its first 16 hex digits).

    Raises:
        ValueError: ``sha256`` is not a hex digest (a registry tag or flag that names a path, say), naming
            ``what``.
    """
    if not CACHE_KEY.fullmatch(sha256):
        raise ValueError(
            f"{what} = {sha256[:80]!r}: not a hex content hash, so it cannot name a local copy. Fix the tag or "
            "flag (ladle writes the merged weights' SHA-256)."
        )
    return sha256[:16]


def normalise(url: str) -> str:
    """Make local paths absolute (subprocesses may run elsewhere); leave URLs alone."""
    if "://" not in url:
        return str(Path(url).expanduser().resolve())
    return url


def filesystem(url: str):
    """Return ``(fs, path)`` for a URL.

    Listings are not trusted across calls: another process (a training rank)
    may have written since, so the listing cache is dropped first.
    """
    fs, path = url_to_fs(url)
    fs.invalidate_cache()
    return fs, path


def exists(url: str) -> bool:
    fs, path = filesystem(url)
    return fs.exists(path)


def read_bytes(url: str) -> bytes:
    with fsspec.open(url, "rb") as fh:
        return fh.read()


def write_bytes(url: str, data: bytes) -> None:
    """Write a file; local writes go through a temp file and an atomic rename."""
    if is_local(url):
        write_atomic(local_path(url), data)
        return
    fs, path = filesystem(url)
    fs.pipe_file(path, data)


def write_json(url: str, obj: Any) -> None:
    write_bytes(url, json.dumps(obj, indent=2, default=str).encode())


def read_json(url: str) -> Any:
    return json.loads(read_bytes(url))


def upload_dir(local: str | Path, url: str, complete: bool = True) -> None:
    """Copy a local folder's files to ``url`` and then (unless ``complete`` is false) mark it complete."""
    local = Path(local)
    fs, root = filesystem(url)
    for file in sorted(p for p in local.rglob("*") if p.is_file()):
        rel = file.relative_to(local).as_posix()
        target = f"{root.rstrip('/')}/{rel}"
        if is_local(url):
            Path(target).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(file, target)
        else:
            fs.put_file(str(file), target)
    if complete:
        mark_complete(url)


def download_dir(url: str, local: str | Path) -> Path:
    """Copy a complete folder artifact at ``url`` into ``local``."""
    local = Path(local)
    fs, root = filesystem(url)
    root = root.rstrip("/")
    inside = local.resolve()
    for path in fs.find(root):
        rel = path[len(root) :].lstrip("/")
        if rel == COMPLETE_MARKER:
            continue
        dest = local / rel
        if not dest.resolve().is_relative_to(inside):
            raise ValueError(
                f"{url}: its key {rel!r} would be written outside {local}; a folder artifact's keys must stay "
                "inside it. Remove that key from the store."
            )
        dest.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(path, str(dest))
    return local


@contextmanager
def local_dir(url: str) -> Iterator[Path]:
    """The folder at ``url`` as a local path while the context lasts: the folder itself when it is local,
    otherwise a temporary download of it, removed afterwards."""
    if is_local(url):
        yield local_path(url)
        return
    with tempfile.TemporaryDirectory(prefix="ladle-download-") as tmp:
        yield download_dir(url, tmp)


def mark_complete(url: str) -> None:
    write_bytes(join(url, COMPLETE_MARKER), b"ok\n")


def is_complete(url: str) -> bool:
    return exists(join(url, COMPLETE_MARKER))


def remove(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def list_dirs(url: str) -> list[str]:
    """Names of the immediate sub-folders of ``url`` (empty if it does not exist)."""
    fs, path = filesystem(url)
    if not fs.exists(path):
        return []
    return sorted(Path(p.rstrip("/")).name for p in fs.ls(path, detail=False) if fs.isdir(p))
