"""``mii.backend``: the client, as MII 0.3.3 shapes it (a loop taken at construction, async streaming)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass


@dataclass
class Response:
    generated_text: str
    prompt_length: int
    generated_length: int
    finish_reason: str


class MIIClient:
    def __init__(self, mii_config, host: str = "localhost") -> None:
        self.mii_config = mii_config
        self.port = mii_config.port_number
        self.asyncio_loop = asyncio.get_event_loop()  # as MII: raises in a thread without a loop

    async def _request_async_response_stream(self, prompts, **query_kwargs):
        assert asyncio.get_running_loop() is self.asyncio_loop, "the client was used from another loop than its own"
        assert query_kwargs.get("stream") is True
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write((json.dumps({"prompt": prompts[0], **query_kwargs}) + "\n").encode())
            await writer.drain()
            while line := await reader.readline():
                yield [Response(**json.loads(line))]
        finally:
            writer.close()
