"""Serving under concurrent load: ladle's server (batched) vs the same server with batching off (batch 1)
vs ``transformers serve --continuous-batching`` (the peer a user would pick), side by side in one run.

    .venv/bin/python bench/serve_load.py [--model DIR] [--seconds 8] [--levels 1,8,32,64]
    .venv/bin/python bench/serve_load.py --levels 32 --only "ladle (batched, 32);ladle (batched, 32, capture on)"

Each server serves the same model folder (default: the newest demo merged model under runs/) on CPU in
float32; clients send greedy streaming chat requests (max_tokens 32) for a fixed time at each concurrency.
Reported per server and concurrency: output tokens/s, p50/p99 request latency, p50 time to first token.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402

from ladle.platform.processes import free_port, stop_process  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = [
    f"Translate the colours to numbers.\n{' '.join(c)}"
    for c in (("blue", "red", "blue"), ("red", "red"), ("green", "blue", "red", "red"), ("blue",))
]


CAPTURE = json.dumps({"enabled": True, "url": str(Path(tempfile.gettempdir()) / "ladle-bench-capture")})


def servers(model: Path, port: int) -> dict[str, list[str]]:
    bin_dir = Path(sys.executable).parent
    ladle = [sys.executable, "-m", "ladle.serve", "--model", str(model), "--name", "m", "--port", str(port)]
    return {
        "ladle (batched, 32)": [*ladle, "--option", "max_batch=32"],
        # serve.capture on: every answer recorded (redacted, batched into files by a thread of its own)
        "ladle (batched, 32, capture on)": [*ladle, "--option", "max_batch=32", "--capture", CAPTURE],
        "ladle (batch 1)": [*ladle, "--option", "max_batch=1"],
        "transformers serve --continuous-batching": [
            str(bin_dir / "transformers"),
            "serve",
            str(model),
            "--continuous-batching",
            "--device",
            "cpu",
            "--dtype",
            "float32",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
    }


def wait_up(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{log.read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("server did not start")


def start_ladle(model: Path, max_batch: int = 32) -> tuple[subprocess.Popen, str]:
    """``python -m ladle.serve`` on ``model`` (transformers backend, ``max_batch``), answering: its process and
    URL (its log in a temporary file)."""
    port = free_port()
    argv = [sys.executable, "-m", "ladle.serve", "--model", str(model), "--name", "m", "--port", str(port)]
    with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
        proc = subprocess.Popen([*argv, "--option", f"max_batch={max_batch}"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_up(url, proc, Path(log.name))
    except BaseException:
        stop_process(proc, grace_s=5)
        raise
    return proc, url


def one_request(
    http: httpx.Client, url: str, model: str, prompt: str, extra: dict | None = None
) -> tuple[float, float, str]:
    """Latency, time to first token, and the text of one streaming greedy chat request (``extra``: more body
    fields)."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 32,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(extra or {}),
    }
    began, first, pieces = time.monotonic(), None, []
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("choices") and data["choices"][0].get("delta", {}).get("content"):
                first = first or time.monotonic()
                pieces.append(data["choices"][0]["delta"]["content"])
    end = time.monotonic()
    return end - began, (first or end) - began, "".join(pieces)


def load(url: str, model: str, clients: int, seconds: float, count, extra: dict | None = None) -> dict:
    """``clients`` threads sending requests for ``seconds``; output tokens counted by ``count(text)``, the same
    tokenizer for every server (servers count their usage differently, e.g. with or without EOS)."""
    results, errors, lock = [], [], threading.Lock()

    def client(i: int) -> None:
        with httpx.Client(timeout=300) as http:
            until, n = time.monotonic() + seconds, 0
            while time.monotonic() < until:
                try:
                    got = one_request(http, url, model, PROMPTS[(i + n) % len(PROMPTS)], extra)
                except Exception as exc:
                    with lock:
                        errors.append(repr(exc))
                    continue
                with lock:
                    results.append(got)
                n += 1

    began = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - began
    latencies = sorted(r[0] for r in results)
    return {
        "clients": clients,
        "requests": len(results),
        "errors": len(errors),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(results) / wall, 1),
        "tokens_per_s": round(sum(count(r[2]) for r in results) / wall, 1),
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else None,
        "p99_latency_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)
        if latencies
        else None,
        "p50_ttft_s": round(statistics.median(r[1] for r in results), 3) if results else None,
    }


def newest_merged() -> Path:
    found = sorted((ROOT / "runs").glob("*/runs/*/merged/config.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise SystemExit("no merged demo model under runs/: run `make demo` first, or pass --model DIR")
    return found[-1].parent


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--levels", default="1,8,32,64")
    parser.add_argument("--name", default="serve_load", help="Results file name under bench/out.")
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="an earlier ladle's source tree (git worktree add /tmp/before COMMIT): its batched server as a row too",
    )
    parser.add_argument("--only", default=None, help="Row names to run, separated by semicolons (default: all).")
    args = parser.parse_args()
    model = args.model or newest_merged()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    levels = [int(x) for x in args.levels.split(",")]
    rows = []
    rows_to_run = servers(model, 0)
    if args.compare:
        rows_to_run = {"ladle before (batched, 32)": rows_to_run["ladle (batched, 32)"], **rows_to_run}
    if args.only:
        rows_to_run = {k: v for k, v in rows_to_run.items() if k in args.only.split(";")}
    for name, argv in rows_to_run.items():
        port = free_port()
        argv = [a if a != "0" else str(port) for a in argv]
        env = {**os.environ, "PYTHONPATH": str(args.compare)} if name.startswith("ladle before") else None
        with tempfile.NamedTemporaryFile("w", suffix=".log", delete=False) as log:
            proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_up(url, proc, Path(log.name))
            model_id = "m" if name.startswith("ladle") else str(model)
            load(url, model_id, 2, 2.0, count)  # warm up
            for clients in levels:
                row = {"server": name, **load(url, model_id, clients, args.seconds, count)}
                rows.append(row)
                print(json.dumps(row), flush=True)
        except Exception as exc:
            rows.append({"server": name, "failed": repr(exc)[:500]})
            print(f"{name}: failed: {exc!r}"[:600], flush=True)
        finally:
            stop_process(proc, grace_s=10)
    print(f"results: {save(args.name, {'model': str(model), 'rows': rows})}")


if __name__ == "__main__":
    main()
