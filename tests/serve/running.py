"""A real uvicorn server in a thread of the test process, shared by the serving, fleet and pipeline tests."""

from __future__ import annotations

import threading
import time

import uvicorn

from ladle.platform.processes import free_port


class Running:
    """A uvicorn server in a thread of this process (real sockets, real HTTP)."""

    def __init__(self, app):
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)
