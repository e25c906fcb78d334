"""Every wait on the artifact store has a deadline (``storage.*``): a store that accepts connections and never
answers, and one that refuses them, each end a command within seconds with one error naming the field, never
a traceback and never a misleading "no such file". Real sockets on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time

from ladle.platform.processes import free_port
from tests.helpers import assert_clean_error, run_cli

S3 = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "AWS_DEFAULT_REGION": "us-east-1"}


def silent_store() -> tuple[socket.socket, int]:
    """A server that accepts every connection and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []

    def accept():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def inspect(endpoint: str, *sets: str):
    started = time.monotonic()
    done = run_cli(
        "data", "inspect", "recipes/tiny-cpu.yaml", "--set", "data.path=s3://bucket/train.jsonl",
        *[arg for value in sets for arg in ("--set", value)],
        env={**S3, "AWS_ENDPOINT_URL": endpoint}, timeout=120,
    )  # fmt: skip
    return done, time.monotonic() - started


def test_a_store_that_never_answers_is_reported_by_its_deadline():
    server, port = silent_store()
    try:
        done, took = inspect(f"http://127.0.0.1:{port}", "storage.read_timeout_s=1", "storage.retries=1")
    finally:
        server.close()
    assert done.returncode == 1
    assert_clean_error(
        done,
        "storage.read_timeout_s = 1.0: the object store accepted the connection but did not answer in time",
        "(2 tries; Read timeout",
        "raise storage.read_timeout_s / storage.retries",
    )
    # Without the deadlines the same command waited more than 6 minutes; with them, 2 tries of 1 s plus start-up.
    assert took < 60, took


def test_a_store_that_refuses_connections_is_named_not_a_missing_file():
    done, took = inspect(f"http://127.0.0.1:{free_port()}", "storage.retries=0")
    assert done.returncode == 1
    line = assert_clean_error(done, "storage.connect_timeout_s = 10.0: the object store could not be reached")
    assert "(1 try;" in line and "no such file" not in line
