"""A served model's server killed under traffic: how long until the front has it answering again, and which
requests fail. Real processes on 127.0.0.1: the front (``python -m ladle.fleet.front``) with its default
supervision, and ``python -m ladle.serve`` on the demo's tiny model, killed with SIGKILL.

    .venv/bin/python bench/front_recovery.py [--clients 16] [--kill-at 4] [--after 30]

Half the clients stream, half do not; each sends greedy chat requests back to back. Reported: seconds from the
kill to the first answer to a request sent after it, the failed requests, and how many of them were in flight
on the killed server (sent before the kill). The goal: recovered within 30 s, no failure but those in flight.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import FrontOverServer, save  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--kill-at", type=float, default=4.0)
    parser.add_argument("--after", type=float, default=30.0, help="seconds of traffic after the kill")
    args = parser.parse_args()
    served = FrontOverServer()
    server, front_url = served.server, served.front_url
    try:
        served.start()
        results, stop = [], threading.Event()

        def client(i: int) -> None:
            ask = {"messages": [{"role": "user", "content": f"Add {i} and 3."}], "max_tokens": 16, "temperature": 0}
            with httpx.Client(timeout=120) as http:
                while not stop.is_set():
                    sent = time.monotonic()
                    info = ""
                    try:
                        if i % 2:
                            with http.stream(
                                "POST", f"{front_url}/v1/chat/completions", json={**ask, "stream": True}
                            ) as r:
                                text = "".join(r.iter_text())
                                ok = (
                                    r.status_code == 200
                                    and text.rstrip().endswith("data: [DONE]")
                                    and '"error"' not in text
                                )
                                info = f"stream {r.status_code} {text[-160:]!r}"
                        else:
                            answer = http.post(f"{front_url}/v1/chat/completions", json=ask)
                            ok, info = answer.status_code == 200, f"{answer.status_code} {answer.text[:160]!r}"
                    except httpx.HTTPError as exc:
                        ok, info = False, f"{type(exc).__name__}: {exc}"
                    results.append((sent, time.monotonic(), ok, info))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
        for t in threads:
            t.start()
        time.sleep(args.kill_at)
        killed = time.monotonic()
        os.killpg(server.pid, signal.SIGKILL)
        time.sleep(args.after)
        stop.set()
        for t in threads:
            t.join(timeout=150)
        after = [r for r in results if r[0] >= killed and r[2]]
        failed = [r for r in results if not r[2]]
        result = {
            "clients": args.clients,
            "requests": len(results),
            "recovered_s": round(min(r[1] for r in after) - killed, 2) if after else None,
            "failed": len(failed),
            "failed_in_flight_at_kill": sum(1 for r in failed if r[0] < killed),
            "failed_sent_after_kill": sum(1 for r in failed if r[0] >= killed),
            "failures_after_kill": sorted({r[3][:200] for r in failed if r[0] >= killed})[:5],
            "restarts": [
                line
                for line in httpx.get(f"{front_url}/ladle/metrics").text.splitlines()
                if line.startswith("ladle_front_restarts_total")
            ],
        }
        print(result)
        save("front_recovery", result)
    finally:
        served.stop()


if __name__ == "__main__":
    main()
