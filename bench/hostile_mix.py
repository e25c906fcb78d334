"""Ordinary clients beside hostile ones: does anything a client sends hurt everyone else?

Real processes on 127.0.0.1: ``python -m ladle.serve`` on the demo's tiny model (default ``serve.limits``) behind
ladle's front. Two phases of the same length, side by side on the same server: 16 ordinary clients alone, then the
same 16 beside hostile clients, each repeating one attack:

- oversized bodies (8 MB, over ``max_body_bytes``), sent whole;
- ``max_tokens`` far past the cap (1,000,000);
- four one-megabyte stop strings;
- a 3 MB prompt (over ``max_prompt_chars``);
- streams hung up after their first chunk, and whole answers abandoned after 0.2 s (each asking 1,500 tokens);
- requests to random paths.

    .venv/bin/python bench/hostile_mix.py [--seconds 20] [--clients 16] [--pause 0.1]

The probes and the attackers run in processes of their own, beside the 16 clients' threads.

Reported: ordinary requests failed (goal 0), their p50/p99 latency in each phase and the ratio (goal p99 within
1.5x), ``/health`` p99 of the server and the front during the hostile phase (goal < 100 ms), what the hostile
requests got, and the number of ``ladle_requests_total`` series before and after (goal: bounded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FrontOverServer, save  # noqa: E402

CHAT = "/v1/chat/completions"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def ordinary(url: str, i: int, stop: threading.Event, out: list) -> None:
    body = {"messages": [{"role": "user", "content": f"Count to {i % 7 + 2}."}], "max_tokens": 16, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            began = time.monotonic()
            try:
                status = http.post(f"{url}{CHAT}", json=body).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            out.append((status, time.monotonic() - began))


def attacks(url: str) -> dict:
    """One callable per attack: each sends one hostile request and returns what it got. Payloads are built once,
    as an attacker's would be (serialising megabytes per request would spend this machine's cores on the client)."""
    headers = {"content-type": "application/json"}
    oversized = b'{"messages": "' + b"x" * 8_000_000 + b'"}'
    stops = json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": ["x" * 1_000_000] * 4}).encode()
    prompt = json.dumps({"messages": [{"role": "user", "content": "word " * 600_000}]}).encode()
    past_cap = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}).encode()
    long_answer = {"messages": [{"role": "user", "content": "Count"}], "max_tokens": 1500}

    def post(content: bytes, timeout=60.0):
        return httpx.post(f"{url}{CHAT}", content=content, headers=headers, timeout=timeout).status_code

    def hang_up_stream():
        with httpx.stream("POST", f"{url}{CHAT}", json={**long_answer, "stream": True}, timeout=60) as answer:
            next(answer.iter_lines())
            return f"{answer.status_code} then hung up"

    def abandon():
        try:
            return httpx.post(f"{url}{CHAT}", json=long_answer, timeout=0.2).status_code
        except httpx.ReadTimeout:
            return "abandoned"

    return {
        "oversized body": lambda: post(oversized),
        "max_tokens past the cap": lambda: post(past_cap),
        "megabyte stop strings": lambda: post(stops),
        "3 MB prompt": lambda: post(prompt),
        "stream hung up": hang_up_stream,
        "whole answer abandoned": abandon,
        "random path": lambda: httpx.get(f"{url}/{uuid.uuid4().hex}", timeout=30).status_code,
    }


def hostile(attack, stop: threading.Event, got: dict, name: str, pause_s: float) -> None:
    while not stop.is_set():
        try:
            outcome = str(attack())
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        got.setdefault(name, {}).setdefault(outcome, 0)
        got[name][outcome] += 1
        stop.wait(pause_s)


def run_for(threads: list[threading.Thread], stop: threading.Event, seconds: float) -> None:
    """Start ``threads``, let them run ``seconds``, then stop them and wait for them."""
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=180)


def probe(url: str, stop: threading.Event, out: list) -> None:
    """``/health`` every 50 ms on one kept-alive connection, as a load balancer's checker holds one: what is timed is
    the server's answer, not a new client's set-up (``httpx.get`` builds a client, and its TLS context, each call:
    milliseconds of this process's CPU on a busy machine)."""
    with httpx.Client(timeout=5) as http:
        while not stop.is_set():
            began = time.monotonic()
            try:
                ok = http.get(f"{url}/health").status_code == 200
            except httpx.HTTPError:
                ok = False
            out.append((ok, time.monotonic() - began))
            time.sleep(0.05)


def side(role: str, url: str, seconds: float, pause_s: float) -> None:
    """A process of its own for the probes (so the 16 clients' threads do not delay them) or the attackers (so
    their work is not the clients'): runs for ``seconds`` and prints what it saw as JSON."""
    stop, got = threading.Event(), {}
    if role == "probe":
        server, front = url.split(",")
        looks: dict[str, list] = {"server": [], "front": []}
        threads = [
            threading.Thread(target=probe, args=(u, stop, looks[k])) for k, u in (("server", server), ("front", front))
        ]
    else:
        threads = [
            threading.Thread(target=hostile, args=(attack, stop, got, name, pause_s))
            for name, attack in attacks(url).items()
        ]
    run_for(threads, stop, seconds)
    if role == "probe":
        got = {f"health_{k}_p99_ms": round(1000 * pct([t for _, t in v], 0.99), 1) for k, v in looks.items()} | {
            "health_failures": sum(1 for v in looks.values() for ok, _ in v if not ok)
        }
    print(json.dumps(got))


def spawn(role: str, url: str, seconds: float, pause_s: float) -> subprocess.Popen:
    argv = [sys.executable, __file__, "--side", role, "--url", url, "--seconds", str(seconds), "--pause", str(pause_s)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)


def series(server_url: str) -> int:
    text = httpx.get(f"{server_url}/metrics", timeout=10).text
    return sum(1 for line in text.splitlines() if line.startswith("ladle_requests_total{"))


def cpu_seconds(pid: int, children: bool = True) -> float:
    """CPU seconds of the process and (``children``) of its live children (a split server's engine process)."""
    import psutil

    try:
        proc = psutil.Process(pid)
        total = 0.0
        for one in [proc, *(proc.children(recursive=True) if children else [])]:
            times = one.cpu_times()
            total += times.user + times.system + (times.children_user + times.children_system if one is proc else 0)
        return total
    except psutil.Error:
        return 0.0


def phase(
    front: str, server: str, seconds: float, clients: int, hostile_pause: float | None, pids: dict[str, int]
) -> dict:
    """One phase: the clients, the probes and (with ``hostile_pause``) the attackers; the CPU seconds each process
    spent (on a 2-core machine the attackers' own work is taken from the server's cores too)."""
    stop, results = threading.Event(), []
    before = {name: cpu_seconds(pid, name != "clients") for name, pid in pids.items()}
    threads = [threading.Thread(target=ordinary, args=(front, i, stop, results)) for i in range(clients)]
    sides = [spawn("probe", f"{server},{front}", seconds, 0.0)]
    if hostile_pause is not None:
        sides.append(spawn("hostile", front, seconds, hostile_pause))
    run_for(threads, stop, seconds)
    spent = {name: round(cpu_seconds(pid, name != "clients") - before[name], 1) for name, pid in pids.items()}
    attacker_cpu = 0.0
    if len(sides) > 1:
        import psutil

        with contextlib.suppress(psutil.Error):
            attacker_cpu = sum(psutil.Process(sides[1].pid).cpu_times()[:2])
    seen = [json.loads(proc.communicate(timeout=300)[0].strip().splitlines()[-1]) for proc in sides]
    spent["attackers"] = round(attacker_cpu, 1)
    latencies = [t for status, t in results if status == 200]
    return {
        "requests": len(results),
        "failed": [s for s, _ in results if s != 200][:20],
        "failed_count": sum(1 for s, _ in results if s != 200),
        "p50_s": round(statistics.median(latencies), 4) if latencies else None,
        "p99_s": round(pct(latencies, 0.99), 4),
        **seen[0],
        "hostile": seen[1] if len(seen) > 1 else {},
        "cpu_s": spent,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument(
        "--pause",
        type=float,
        default=0.1,
        help="seconds each attacker waits between its requests (0: flat out, as fast as this machine sends)",
    )
    parser.add_argument(
        "--compare",
        type=Path,
        default=None,
        help="an earlier ladle's source tree (git worktree add /tmp/before COMMIT): the same bench on it first",
    )
    parser.add_argument("--side", choices=["probe", "hostile"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        side(args.side, args.url, args.seconds, args.pause)
        return
    results = {}
    for label, tree in ([("before", args.compare)] if args.compare else []) + [("now", None)]:
        results[label] = run_once(args, tree)
        print(json.dumps({label: results[label]}, indent=1), flush=True)
    if args.compare:
        b, n = results["before"]["with_hostile"], results["now"]["with_hostile"]
        results["now_vs_before"] = {
            "hostile_p99": round(n["p99_s"] / b["p99_s"], 3),
            "server_health_p99": round(n["health_server_p99_ms"] / b["health_server_p99_ms"], 3),
            "front_health_p99": round(n["health_front_p99_ms"] / b["health_front_p99_ms"], 3),
        }
        print(json.dumps(results["now_vs_before"]))
    print(f"saved {save('hostile_mix', results)}")


def run_once(args, tree: Path | None) -> dict:
    served = FrontOverServer(tree)
    server, url, front_url = served.server, served.url, served.front_url
    try:
        served.start()
        before = series(url)
        pids = {"server": server.pid, "front": served.front.pid, "clients": os.getpid()}
        calm = phase(front_url, url, args.seconds, args.clients, None, pids)
        stormy = phase(front_url, url, args.seconds, args.clients, args.pause, pids)
        after = series(url)
        return {
            "tree": str(tree or "this one"),
            "attacker_pause_s": args.pause,
            "clients": args.clients,
            "seconds": args.seconds,
            "alone": calm,
            "with_hostile": stormy,
            "p99_ratio": round(stormy["p99_s"] / calm["p99_s"], 3),
            "p50_ratio": round(stormy["p50_s"] / calm["p50_s"], 3),
            "metric_series": {"before": before, "after": after},
        }
    finally:
        served.stop()


if __name__ == "__main__":
    main()
