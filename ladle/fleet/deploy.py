"""Deploy stage: start the server as a subprocess, wait for health, send a smoke request."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from pydantic import BaseModel, Field

from ladle.assets import ladle_home
from ladle.config import ServeConfig
from ladle.data import formats
from ladle.data.capture_files import INTERNAL_HEADER
from ladle.errors import LadleError
from ladle.lifecycle.merge import MergedModel
from ladle.lifecycle.parity import Parity
from ladle.platform.processes import free_port, stop_process
from ladle.serve import backends, pool


class Endpoint(BaseModel):
    url: str = Field(description="Base URL of the OpenAI-compatible API.")
    model: str
    backend: str
    pid: int | None = Field(description="Server process id while it runs; null once stopped.")
    prompt: str = Field(description="The smoke request's last user message.")
    answer: str = Field(description="The smoke request's reply.")
    expected: str | None = Field(None, description="The held-out reference answer (null for a fixed smoke prompt).")
    answer_correct: bool | None = Field(None, description="answer == expected (surrounding whitespace aside).")
    running: bool
    log: str = Field(description="Server log file.")
    parity: Parity | None = Field(None, description="Whether the server computes what training did (null: off).")
    unmerged: bool = Field(False, description="The adapter was served unmerged on its base (promote.merge: false).")
    shadow: dict | None = Field(
        None, description="The shadow replay's result (``ladle.lifecycle.shadow.ShadowResult``); null: not run."
    )


class DeployFailed(RuntimeError):
    """The server did not become healthy or did not answer."""


class SwapFailed(LadleError):
    """A new version of a served model did not start or answer; the old one keeps serving."""


def local_model_dir(merged: MergedModel, verify: bool = True) -> Path:
    """The merged model on local disk (copied once from a remote store, keyed by its hash, its weights checked
    against that hash when ``verify``: ``storage.cached_copy``)."""
    from ladle.lifecycle.copies import local_copy

    return local_copy(merged.url, merged.sha256, verify)


def backend_options(cfg: ServeConfig) -> dict:
    """The ``serve.*`` settings a backend may accept as options, by the option's name."""
    return {
        "max_batch": cfg.max_batch_size,
        "kv_tokens": cfg.kv_cache_tokens,
        "tensor_parallel": cfg.tensor_parallel,
        "replica_num": cfg.replica_num,
        "start_timeout_s": cfg.start_timeout_s,
        "max_adapters": cfg.adapters.max_loaded,
        "adapters_mb": cfg.adapters.max_mb,
    }


def server_argv(model_dir: Path, name: str, cfg: ServeConfig, port: int, extra: list[str] | None = None) -> list[str]:
    argv = [
        sys.executable,
        "-m",
        "ladle.serve",
        "--model",
        str(model_dir),
        "--name",
        name,
        "--backend",
        cfg.backend,
        "--host",
        cfg.host,
        "--port",
        str(port),
        "--max-new-tokens",
        str(cfg.max_new_tokens),
        "--drain-timeout",
        str(cfg.drain_timeout_s),
        "--limits",
        cfg.limits.model_dump_json(),
    ]
    accepted = backends.get(cfg.backend).options
    for option, value in backend_options(cfg).items():
        if option in accepted:
            argv += ["--option", f"{option}={value}"]
    if cfg.api_key_env:
        argv += ["--api-key-env", cfg.api_key_env]
    if cfg.capture.enabled:
        argv += ["--capture", cfg.capture.model_dump_json()]
    return argv + list(extra or [])


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            out = log_path.read_text(errors="replace")
            raise DeployFailed(f"server exited with code {proc.returncode} before it was healthy:\n{out[-3000:]}")
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:  # loaded, generation loop running
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise DeployFailed(f"server at {url} not healthy within serve.health_timeout_s={timeout}")


DEFAULT_SMOKE = "Hello!"


def smoke_conversation(cfg: ServeConfig, held_out: list[list[dict]]) -> tuple[list[dict], str | None]:
    """The smoke request's messages and the answer expected, if known.

    ``serve.smoke_prompt`` wins; otherwise the first held-out conversation
    (never trained on) asks its prompt and expects its reference turn.
    """
    if cfg.smoke_prompt is not None or not held_out:
        return [{"role": "user", "content": cfg.smoke_prompt or DEFAULT_SMOKE}], None
    return formats.openai_messages(held_out[0][:-1]), held_out[0][-1]["content"]


def start_server(
    model_dir: Path,
    name: str,
    cfg: ServeConfig,
    port: int,
    log_path: Path | None = None,
    extra: list[str] | None = None,
) -> tuple[subprocess.Popen, str, Path]:
    """Start ``python -m ladle.serve`` (with ``extra`` arguments) in its own session; returns ``(process, URL, log
    file)`` at once."""
    url = f"http://{cfg.host}:{port}"
    # A server that outlives this process must not write into a pipe nobody reads.
    log_path = log_path or ladle_home() / "served" / f"{name}-{port}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Forked from a warm pool when LADLE_SERVE_POOL names one (ladle.serve.pool); its own session either way, so
    # whatever it spawns (its engine, MII's servers) stops with its process group.
    proc = pool.launch(
        server_argv(model_dir, name, cfg, port, extra), log_path, {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    )
    return proc, url, log_path


def deploy(
    merged: MergedModel,
    cfg: ServeConfig,
    name: str,
    held_out: list[list[dict]] | None = None,
    base_dir: Path | None = None,
    parity_of: Callable[[str, str, dict], Parity] | None = None,
    shadow_of: Callable[[str, str, dict], dict | None] | None = None,
) -> Endpoint:
    """Serve ``merged``, check it answers (and, with ``parity_of``, that it computes what training did), and stop it
    unless ``cfg.keep_running``. With ``base_dir``, the adapter is served unmerged on that base, as model ``name``.

    Args:
        held_out: eval conversations; the first is the smoke request when ``serve.smoke_prompt`` is null.
        parity_of: ``(url, model name, headers) -> Parity`` (``ladle.lifecycle.parity``).
        shadow_of: ``(url, model name, headers) -> the shadow replay's result`` (``ladle.lifecycle.shadow``).

    Raises:
        LadleError: the backend cannot run on this host.
        DeployFailed: the server did not become healthy or the smoke request failed.
    """
    backends.get(cfg.backend).check_host()
    port = cfg.port or free_port()
    if cfg.capture.enabled and not cfg.keep_running:
        # A server that answers only this stage's own requests (the smoke request, parity, the shadow replay) hears
        # no user: nothing of it is traffic to learn from. One left running serves users, and captures.
        cfg = cfg.model_copy(update={"capture": cfg.capture.model_copy(update={"enabled": False})})
    if base_dir is not None:
        adapter = local_model_dir(MergedModel(url=merged.adapter_url, sha256=merged.adapter_sha256, parameters=0))
        served = ["--adapter", f"{name}={adapter}"]
        proc, url, log_path = start_server(Path(base_dir), "base", cfg, port, extra=served)
    else:
        proc, url, log_path = start_server(local_model_dir(merged), name, cfg, port)
    messages, expected = smoke_conversation(cfg, held_out or [])
    try:
        wait_healthy(proc, url, cfg.health_timeout_s, log_path)
        answer = smoke(url, name, cfg, messages)
        parity = parity_of(url, name, auth_headers(cfg)) if parity_of is not None else None
        shadow = shadow_of(url, name, auth_headers(cfg)) if shadow_of is not None else None
    except BaseException:
        stop_process(proc, grace_s=20, group=True)
        raise
    if not cfg.keep_running:
        stop_process(proc, grace_s=cfg.drain_timeout_s + 10, group=True)
    correct = None if expected is None else answer.strip() == expected.strip()
    return Endpoint(
        url=url,
        model=name,
        backend=cfg.backend,
        pid=proc.pid if cfg.keep_running else None,
        prompt=messages[-1]["content"],
        answer=answer,
        expected=expected,
        answer_correct=correct,
        running=cfg.keep_running,
        log=str(log_path),
        parity=parity,
        unmerged=base_dir is not None,
        shadow=shadow,
    )


def auth_headers(cfg: ServeConfig) -> dict:
    return {"Authorization": f"Bearer {os.environ[cfg.api_key_env]}"} if cfg.api_key_env else {}


def smoke(url: str, name: str, cfg: ServeConfig, messages: list[dict]) -> str:
    """One greedy chat completion; returns the reply text."""
    body = {"model": name, "messages": messages, "max_tokens": cfg.max_new_tokens, "temperature": 0}
    headers = {**auth_headers(cfg), INTERNAL_HEADER: "1"}  # ladle's own request: not traffic to learn from
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    if response.status_code != 200:
        raise DeployFailed(f"smoke request got HTTP {response.status_code}: {response.text[:500]}")
    return response.json()["choices"][0]["message"]["content"]
