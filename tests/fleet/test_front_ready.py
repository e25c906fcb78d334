"""The front's readiness is its upstream's: a probe reads the status code, so an upstream that is not ready makes
the front answer 503 with the upstream's reason (never a 200 carrying the error), and liveness stays 200."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from ladle.fleet import front as router
from tests.serve.running import Running


def upstream_app(ready: dict) -> FastAPI:
    app = FastAPI()

    @app.get("/ready")
    def answer():
        if ready["now"]:
            return {"status": "ready"}
        body = {
            "error": {"message": "the mii backend is not serving (its model server is down)", "type": "server_error"}
        }
        return JSONResponse(body, 503)

    return app


def test_the_front_answers_its_upstreams_readiness_with_its_status_code():
    ready = {"now": True}
    upstream = Running(upstream_app(ready))
    front = Running(router.create_app("m", "token", {"upstream": {"url": upstream.url, "version": "3"}}, None))
    try:
        assert httpx.get(f"{front.url}/ready").json() == {"status": "ready", "version": "3"}
        ready["now"] = False
        answer = httpx.get(f"{front.url}/ready")
        assert answer.status_code == 503
        assert answer.json()["error"]["message"] == "m v3: the mii backend is not serving (its model server is down)"
        assert httpx.get(f"{front.url}/health").status_code == 200  # liveness: the front itself is up
        upstream.stop()
        gone = httpx.get(f"{front.url}/ready")
        assert gone.status_code == 503 and gone.json()["error"]["message"].startswith("m v3: Connect")
    finally:
        front.stop()
        upstream.stop()


def test_a_front_shutting_down_is_not_swallowed_while_it_drops_a_gone_clients_request():
    """The client hung up: the front cancels the upstream request and waits for it to let go. If the front
    itself is cancelled meanwhile (it is stopping), that cancellation goes on up; it used to be swallowed."""
    import asyncio

    import pytest

    from ladle.fleet.front import ClientGone, until_gone

    class Gone:
        async def receive(self):
            return {"type": "http.disconnect"}

    async def upstream(slow_release: bool):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            if slow_release:
                await asyncio.sleep(0.5)  # closing its connection takes a moment
            raise

    async def scenario():
        with pytest.raises(ClientGone):
            await until_gone(Gone(), upstream(False))
        handler = asyncio.ensure_future(until_gone(Gone(), upstream(True)))
        await asyncio.sleep(0.1)  # the disconnect seen, the upstream request letting go
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler

    asyncio.run(scenario())


def test_the_fronts_connections_send_without_waiting_for_acks(tmp_path):
    """The front listens on a socket it binds itself (``front.bind``); asyncio turns Nagle's algorithm off on each
    accepted connection only when that socket says TCP. With it on, an answer written as headers then body waited
    for the client's delayed ACK, 44 ms a request."""
    import asyncio
    import socket

    from ladle.fleet.front import bind
    from ladle.platform.processes import free_port

    async def nodelay_of_accepted() -> int:
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        port = free_port()
        server = await asyncio.get_running_loop().create_server(Probe, sock=bind("127.0.0.1", port))
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            flag = await asyncio.wait_for(seen, 10)
            writer.close()
        return flag

    assert asyncio.run(nodelay_of_accepted()) != 0
