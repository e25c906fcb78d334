"""The fake MII model server, ``python model_server.py PORT``: the prompt's words reversed, one a message."""

import asyncio
import json
import os
import sys


def line(text: str, generated: int = 0, reason: str = "none") -> bytes:
    body = {"generated_text": text, "prompt_length": 0, "generated_length": generated, "finish_reason": reason}
    return (json.dumps(body) + "\n").encode()


async def answer(reader, writer):
    first = await reader.readline()
    if not first:  # a probe of the port (MII's start checks that it listens)
        writer.close()
        return
    request = json.loads(first)
    words = request["prompt"].split()[::-1][: request["max_new_tokens"]]
    for word in words:
        await asyncio.sleep(float(os.environ.get("FAKE_MII_DELAY_S", "0.01")))
        writer.write(line(word + " "))
        await writer.drain()
    writer.write(line("", len(words), "length" if len(words) == request["max_new_tokens"] else "stop"))
    await writer.drain()
    writer.close()


async def main(port: int):
    await asyncio.sleep(float(os.environ.get("FAKE_MII_LOAD_S", "0")))  # "loading the model"
    server = await asyncio.start_server(answer, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


asyncio.run(main(int(sys.argv[1])))
