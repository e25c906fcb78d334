"""What the split server costs and saves: server start times, and the API-engine pipe.

    .venv/bin/python bench/serve_split.py [--compare /tmp/before] [--starts 3]

- Start to ``/ready`` of ``python -m ladle.serve`` on the demo's tiny model: started cold (a new interpreter, as
  before the pool), forked from a warm pool (``ladle.serve.pool``), and, with ``--compare``, cold from an earlier
  ladle's source tree (one process, no engine split). Medians of ``--starts``, run alternately.
- The front's proxying: the same short requests (one token) one at a time, straight to the server and through
  the front; the latency the front adds (median, p99) and its CPU per request.
- The pipe between the API and engine processes (``ladle.serve.wire``): round trips of a ``Submit`` of a
  200-token prompt and a ``Report`` of 32 rows' events (one decode step of a full batch), one process each side.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import save  # noqa: E402


def ready_after(start, url: str) -> float:
    began = time.monotonic()
    proc = start()
    try:
        while time.monotonic() - began < 180:
            try:
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    return time.monotonic() - began
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"{url} not ready in 180 s")
    finally:
        from ladle.platform.processes import stop_process

        stop_process(proc, 10, group=True)


def starts(args) -> dict:
    from ladle.assets import tiny_model_dir
    from ladle.platform.processes import free_port
    from ladle.serve import pool

    model = tiny_model_dir()
    home = Path(tempfile.mkdtemp())
    sock = home / "pool.sock"
    env = {**os.environ, "LADLE_HOME": str(home), "TOKENIZERS_PARALLELISM": "false"}
    env.pop(pool.ENV, None)
    pooled = subprocess.Popen([sys.executable, "-m", "ladle.serve.pool", "--socket", str(sock)], env=env)
    while not sock.exists():
        time.sleep(0.05)
    kinds = {"cold": dict(env), "warm (pool)": {**env, pool.ENV: str(sock)}}
    if args.compare:
        kinds["before (cold, one process)"] = {**env, "PYTHONPATH": str(args.compare)}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    try:
        for _ in range(args.starts):
            for kind, kind_env in kinds.items():
                port = free_port()
                argv = [sys.executable, "-m", "ladle.serve", "--model", str(model), "--name", "m", "--port", str(port)]
                log = home / f"{port}.log"
                times[kind].append(
                    ready_after(lambda a=argv, e=kind_env, lg=log: pool.launch(a, lg, e), f"http://127.0.0.1:{port}")
                )
                print(kind, round(times[kind][-1], 2), flush=True)
    finally:
        pooled.terminate()
        pooled.wait(10)
    return {
        k: {"median_s": round(statistics.median(v), 2), "all_s": [round(x, 2) for x in v]} for k, v in times.items()
    }


def echo(conn) -> None:
    while True:
        try:
            conn.send(conn.recv())
        except EOFError:
            return


def pipe(rounds: int = 5000) -> dict:
    import multiprocessing as mp

    from ladle.serve import wire

    ours, theirs = mp.Pipe()
    child = mp.get_context("fork").Process(target=echo, args=(theirs,), daemon=True)
    child.start()
    submit = wire.Submit(1, 1, {"ids": list(range(200)), "max_new_tokens": 64, "temperature": 0.0, "stop": []})
    events = [(i, "text", {"text": " word", "ids": [1234]}) for i in range(32)]
    report = wire.Report(events, 3, 10, True, [32])
    out = {}
    for name, message in (("submit_200_tokens", submit), ("report_32_rows", report)):
        for _ in range(200):
            ours.send(message)
            ours.recv()
        began = time.perf_counter()
        for _ in range(rounds):
            ours.send(message)
            ours.recv()
        out[f"{name}_round_trip_us"] = round(1e6 * (time.perf_counter() - began) / rounds, 1)
    ours.close()
    child.join(5)
    return out


def proxy(rounds: int = 300) -> dict:
    import psutil
    from common import FrontOverServer

    served = FrontOverServer().start()
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "temperature": 0}
    out = {}
    try:
        with httpx.Client(timeout=30) as http:
            for name, url in (("direct", served.url), ("through_front", served.front_url)):
                for _ in range(20):
                    http.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
                front = psutil.Process(served.front.pid)
                cpu = sum(front.cpu_times()[:2])
                times = []
                for _ in range(rounds):
                    began = time.perf_counter()
                    http.post(f"{url}/v1/chat/completions", json=body).raise_for_status()
                    times.append(time.perf_counter() - began)
                times.sort()
                out[name] = {
                    "median_ms": round(1000 * statistics.median(times), 2),
                    "p99_ms": round(1000 * times[int(0.99 * len(times))], 2),
                    "front_cpu_ms_per_request": round(1000 * (sum(front.cpu_times()[:2]) - cpu) / rounds, 2),
                }
    finally:
        served.stop()
    out["front_adds_median_ms"] = round(out["through_front"]["median_ms"] - out["direct"]["median_ms"], 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", type=Path, default=None)
    parser.add_argument("--starts", type=int, default=3)
    args = parser.parse_args()
    result = {"pipe": pipe()}
    print(result["pipe"], flush=True)
    result["proxy"] = proxy()
    print(result["proxy"], flush=True)
    result["start_to_ready"] = starts(args)
    print(result)
    print(f"saved {save('serve_split', result)}")


if __name__ == "__main__":
    main()
