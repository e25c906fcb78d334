"""A stand-in for DeepSpeed-MII's persistent deployment, for the hardware this machine lacks (MII has no CPU
path). It keeps the parts of ``mii`` 0.3.3 that ladle's backend meets, as MII behaves:

- ``serve`` starts a launcher process that starts the model server (as DeepSpeed's launcher starts
  ``mii.launch.multi_gpu_server``), waits until the server's port listens, and raises ``RuntimeError("server
  crashed for some reason, unable to proceed")`` when a process dies first (MII's ``_wait_until_server_is_live``);
  it then returns ``MIIClient(config)``, whose constructor calls ``asyncio.get_event_loop()``;
- ``MIIClient._request_async_response_stream`` yields one-element lists of ``Response`` over a real socket,
  the last with empty text, the finish reason and the generated length.

The model server answers with the prompt's words reversed, one word per message (``FAKE_MII_DELAY_S`` apart),
after ``FAKE_MII_LOAD_S`` seconds of "loading" before it listens.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .backend import MIIClient, Response  # noqa: F401 - mii's public names

SERVER = Path(__file__).with_name("model_server.py")

# The "deepspeed launcher": starts the model server and waits for it (exits when it does, as DeepSpeed's does).
LAUNCHER = """
import subprocess, sys
server = subprocess.Popen([sys.executable, sys.argv[1], sys.argv[2]])
sys.exit(server.wait())
"""


@dataclass
class MIIConfig:
    deployment_name: str
    model_path: str
    tensor_parallel: int
    replica_num: int
    port_number: int
    torch_dist_port: int
    zmq_port_number: int


def serve(model_name_or_path: str, deployment_name: str, tensor_parallel: int = 1, replica_num: int = 1, **ports):
    config = MIIConfig(deployment_name, model_name_or_path, tensor_parallel, replica_num, **ports)
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(SERVER), str(config.port_number)])
    while not listening(config.port_number):
        if launcher.poll() is not None:
            raise RuntimeError("server crashed for some reason, unable to proceed")
        time.sleep(0.2)
    return MIIClient(config)


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0
