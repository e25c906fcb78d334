"""ladle's front: one stable address per served model, in front of whichever server holds its champion.

``python -m ladle.fleet.front --name NAME --port PORT`` proxies every OpenAI route (streaming included,
byte for byte) to the current upstream server and adds ``x-ladle-model-version`` to each answer. A swap
(``PUT /ladle/upstream``, from this machine, with the admin token in the router's run record) points new
requests at the new server at once, then waits until the old one has no request in flight, so the old
server can be drained and stopped without failing anyone. A request whose upstream refuses the connection
because it was swapped out meanwhile is sent to the current one instead (it never reached the old one).

The run record (``$LADLE_HOME/served/routers/NAME.json``, mode 0600) holds the pid, URL, admin token and
current upstream: ``ladle model serve`` and the serving flow find the router there.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import logging
import os
import secrets
import sys
import time
from pathlib import Path

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import Counter, generate_latest

from ladle.assets import ladle_home
from ladle.fleet.canary import Canary, challenger_alive
from ladle.fleet.front_canary import add_canary_routes
from ladle.fleet.supervisor import Supervisor
from ladle.platform.files import write_atomic
from ladle.serve.adapters import PINNED_HEADER
from ladle.serve.guard import Guard, Refused, envelope
from ladle.serve.limits import ServeLimits

ADMIN_HEADER = "x-ladle-admin-token"
VERSION_HEADER = "x-ladle-model-version"
HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}


def records_dir() -> Path:
    return ladle_home() / "served" / "routers"


def record_path(name: str) -> Path:
    return records_dir() / f"{name}.json"


def write_record(path: Path, record: dict) -> None:
    write_atomic(path, json.dumps(record), mode=0o600)  # it holds the admin token


def read_record(name: str) -> dict | None:
    """The live router of ``name``, or None. A dead router's record is left for the next front to adopt what it
    served (``adopted``)."""
    from ladle.serve import records

    try:
        record = json.loads(record_path(name).read_text())
    except (OSError, ValueError):
        return None
    return record if records.alive(record, marker="ladle.fleet.front") else None


def error(status: int, message: str, kind: str, code: str) -> JSONResponse:
    return JSONResponse(envelope(message, kind, code), status)


FRONT_TIMEOUT = httpx.Timeout(connect=5.0, read=900.0, write=60.0, pool=10.0)
"""The front's requests to its servers. read: the longest silence between two pieces of an answer (a request
that waits up to serve.limits.queue_timeout_s, then generates up to serve.limits.max_tokens on a slow CPU); pool:
how long a request waits for a connection when a thousand are open."""


DEFAULT_BODY_BYTES = ServeLimits.model_fields["max_body_bytes"].default


class NotAdmin(Exception):
    """An admin route asked without the router's token (or not from this machine)."""


class ClientGone(Exception):
    """The client hung up while the front waited for the server's answer."""


async def until_gone(request: Request, sending):
    """Await ``sending`` (the upstream request, up to its answer's headers) unless the client hangs up first; then
    the upstream request is cancelled, which closes its connection, and the server cancels the generation (a whole
    answer's headers come only when it is done, so without this an abandoned request would generate to its end).

    Raises:
        ClientGone: the client left first.
    """
    send = asyncio.ensure_future(sending)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        done, _ = await asyncio.wait({send, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        send.cancel()
        raise
    finally:
        watch.cancel()
    if send in done:
        return send.result()
    send.cancel()
    try:
        await send  # let the send finish cancelling (its connection released)
    except asyncio.CancelledError:
        if (task := asyncio.current_task()) is not None and task.cancelling():
            raise  # this handler itself is being cancelled (the front shutting down): never swallowed
    except Exception:  # noqa: BLE001 - the send's own failure: the client is gone either way
        pass
    raise ClientGone


class Relayed(StreamingResponse):
    """A proxied answer whose ``release`` runs however the response ends: sent whole, broken by the server, or
    abandoned by a client that left before its first byte (the body's generator then never starts, so a
    ``finally`` inside it would never run and the server would keep a request counted in flight for ever)."""

    def __init__(self, content, release, **kwargs):
        super().__init__(content, **kwargs)
        self.release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.release()


class Front:
    """One front's live state and what its routes and loops share: the server behind it (``state``), the
    requests in flight per server, its supervisor, the canary and the run record it keeps current."""

    def __init__(
        self,
        name: str,
        token: str,
        record: dict,
        record_file: Path | None,
        supervision: dict | None = None,
    ) -> None:
        self.name, self.token, self.record, self.record_file = name, token, record, record_file
        self.client = httpx.AsyncClient(timeout=FRONT_TIMEOUT, limits=httpx.Limits(max_connections=1000))
        self.state: dict = {"upstream": record.get("upstream"), "broken": None}
        self.in_flight: collections.Counter[str] = collections.Counter()
        # Adapter canaries, by adapter name: on a base's front, each splits the requests for its adapter's bare name
        # between two versions the same server holds.
        self.adapter_canaries: dict[str, Canary] = {
            adapter: Canary.restore(snapshot) for adapter, snapshot in (record.get("adapter_canaries") or {}).items()
        }
        self.supervisor = Supervisor(name, self.state, lambda up: self.persist(), **(supervision or {}))
        if record.get("canary"):
            self.state["canary"] = Canary.restore(record["canary"])
        self.canary_requests = Counter(
            "ladle_front_canary_requests",
            "Requests during a canary, by arm (champion, challenger) and outcome (ok, error).",
            ["arm", "outcome"],
            registry=self.supervisor.registry,
        )

    def release(self, url: str) -> None:
        """One request to ``url`` ended; a server with none left is forgotten (a front that swaps for months must
        not keep a key per server it ever had)."""
        self.in_flight[url] -= 1
        if self.in_flight[url] <= 0:
            del self.in_flight[url]

    def persist(self) -> None:
        """The run record says what is served and what canary runs, so a front started after this one died
        adopts both."""
        if self.record_file is not None:
            canary = self.state.get("canary")
            snapshot = canary.snapshot() if canary is not None else None
            adapters = {adapter: c.snapshot() for adapter, c in self.adapter_canaries.items()}
            write_record(
                self.record_file,
                {**self.record, "upstream": self.state["upstream"], "canary": snapshot, "adapter_canaries": adapters},
            )

    def switch(self, new: dict) -> None:
        """Point new requests at ``new``. A running canary measured against another server is over: whatever
        switched the front (a swap, a rollback) was decided after it and wins."""
        self.state["upstream"] = new
        self.supervisor.watch(new)
        canary = self.state.get("canary")
        if canary is not None and canary.status == "running" and canary.challenger["url"] != new["url"]:
            canary.end("rolled_back", f"superseded: the front was switched to v{new['version']} during the canary")
        self.persist()

    async def judge_canary(self) -> None:
        """The canary's clock: a verdict is reached here even when nobody asks for one. A canary passes only
        while the front still serves the champion it was measured against."""
        while True:
            await asyncio.sleep(0.25)
            # An adapter canary's arms are two versions on one server: no process of its own to die, and a swap of
            # the server behind the front (every server reads the same aliases) does not end it.
            decided = [c.judge() for c in list(self.adapter_canaries.values()) if c.status == "running"]  # all of them
            if any(verdict is not None for verdict in decided):
                self.persist()
            canary = self.state.get("canary")
            if canary is None or canary.status != "running":
                continue
            upstream = self.state["upstream"] or {}
            if upstream.get("url") != canary.champion["url"]:
                canary.end("rolled_back", f"superseded: the front serves v{upstream.get('version')} now")
                self.persist()
            elif canary.judge(challenger_alive(canary)) == "passed":
                self.switch(canary.challenger)  # all new requests to the challenger's warm server; the old one drains
            elif canary.status != "running":
                self.persist()

    async def guarded(self, task: str, loop) -> None:
        """A background loop that dies says so: logged, and the front's readiness and liveness turn red with the
        reason (a front that no longer supervises or judges must be replaced, not trusted)."""
        try:
            await loop()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any crash of the loop is the front's to report
            self.state["broken"] = (
                f"{self.name}: the front's {task} loop crashed ({type(exc).__name__}: {exc}); restart the front"
            )
            logging.getLogger("ladle.front").exception(self.state["broken"])

    @property
    def admin_only(self):
        """The admin routes' one check, as a FastAPI dependency: the router's token from this machine, else 403
        in OpenAI's envelope."""

        def check(request: Request) -> None:
            if not self.admin(request):
                raise NotAdmin("admin routes need the router's token")

        return Depends(check)

    @staticmethod
    def pinned_arm(canary: Canary) -> tuple[str, str | None]:
        """An adapter canary's arm for one request for the adapter's bare name, and the version it is pinned to:
        while it runs, the challenger for ``weight`` of them and the champion it is measured against for the rest;
        once passed, the challenger (until the registry says so and the canary is forgotten); once rolled back,
        whatever the server answers the name with (no pin)."""
        if canary.status == "running":
            if canary.pick():
                return "challenger", str(canary.challenger["version"])
            return "champion", str(canary.champion["version"])
        if canary.status == "passed":
            return "challenger", str(canary.challenger["version"])
        return "champion", None

    def adapter_summary(self, adapter: str) -> dict | None:
        canary = self.adapter_canaries.get(adapter)
        return None if canary is None else {**canary.summary(), "adapter": adapter}

    def admin(self, request: Request) -> bool:
        host = request.client.host if request.client else ""
        return host in ("127.0.0.1", "::1") and secrets.compare_digest(
            request.headers.get(ADMIN_HEADER, ""), self.token
        )


class NotForwarded:
    """The front's answer to a control route (``ladle.serve.guard.is_control``): refused, never forwarded. The
    front is the public address; changing what its server serves is for the server's admin key, asked of the server
    itself."""

    def __init__(self, name: str):
        self.name = name

    def check(self, scope) -> None:
        raise Refused(
            403,
            f"{self.name}: the front does not forward control routes ({scope.get('method')} {scope['path']}); ask "
            "the server behind it, with its admin key (ladle model serve does)",
            "forbidden",
            "permission_error",
        )


def create_app(
    name: str,
    token: str,
    record: dict,
    record_file: Path | None,
    supervision: dict | None = None,
    max_body_bytes: int = DEFAULT_BODY_BYTES,
) -> FastAPI:
    """The front's app. ``record``: its run record (``upstream`` and ``canary`` adopted from a front that died);
    ``supervision``: ``Supervisor`` settings (tests shorten its clocks); ``max_body_bytes``: the largest body it
    reads to proxy (``serve.limits.max_body_bytes``: the server's own bound, so the front never holds more)."""
    front = Front(name, token, record, record_file, supervision)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        tasks = [
            asyncio.create_task(front.guarded("supervision", front.supervisor.run)),
            asyncio.create_task(front.guarded("canary", front.judge_canary)),
        ]
        yield
        for task in tasks:
            task.cancel()
        await front.client.aclose()

    app = FastAPI(title=f"ladle front: {name}", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.add_exception_handler(NotAdmin, lambda request, exc: error(403, str(exc), "permission_error", "forbidden"))
    # The front never holds an oversized body either, and never forwards a control route (``NotForwarded``).
    app.add_middleware(Guard, max_body_bytes=max_body_bytes, control=NotForwarded(name))
    app.state.supervisor = front.supervisor
    app.state.front = front.state
    add_probe_routes(app, front)
    add_upstream_routes(app, front)
    add_canary_routes(app, front)
    add_proxy_route(app, front)
    return app


def add_probe_routes(app: FastAPI, front: Front) -> None:
    """``/health``, ``/ready`` and the front's own metrics."""

    @app.get("/health")
    async def health():
        """Liveness of the front itself, and the version behind it; 503 when one of its loops crashed."""
        if front.state["broken"]:
            return error(503, front.state["broken"], "server_error", "front_broken")
        return {"status": "ok", "model": front.name, "version": (front.state["upstream"] or {}).get("version")}

    @app.get("/ladle/metrics")
    def front_metrics() -> Response:
        """The front's Prometheus metrics (restarts, canary counts); the server's own are at ``/metrics``."""
        return Response(generate_latest(front.supervisor.registry), media_type="text/plain; version=0.0.4")

    @app.get("/ready")
    async def ready():
        """The server's readiness, with its status code: 503 with the reason when it is not ready, when nothing is
        served yet, when the front gave up restarting it, or when a loop of the front crashed."""
        if front.state["broken"]:
            return error(503, front.state["broken"], "server_error", "front_broken")
        if front.supervisor.failed:
            return error(503, front.supervisor.failed, "server_error", "upstream_failed")
        upstream = front.state["upstream"]
        if upstream is None:
            return error(503, f"{front.name}: no version is being served yet", "server_error", "not_ready")
        try:
            answer = await front.client.get(upstream["url"] + "/ready", timeout=2.0)
        except httpx.HTTPError as exc:
            return error(
                503, f"{front.name} v{upstream['version']}: {exc.__class__.__name__}", "server_error", "not_ready"
            )
        if answer.status_code == 200:
            return {"status": "ready", "version": upstream["version"]}
        # The upstream's own status, not a 200 carrying its error: a probe reads the code, not the body.
        reason = (
            (answer.json().get("error") or {}).get("message")
            if "json" in answer.headers.get("content-type", "")
            else None
        )
        detail = reason or f"its /ready answered HTTP {answer.status_code}"
        return error(503, f"{front.name} v{upstream['version']}: {detail}", "server_error", "not_ready")


def add_upstream_routes(app: FastAPI, front: Front) -> None:
    """Admin: which server is behind the front, and swapping it."""

    @app.get("/ladle/upstream", dependencies=[front.admin_only])
    def get_upstream():
        """Admin: the server behind the front and the requests in flight per server."""
        return {"upstream": front.state["upstream"], "in_flight": dict(front.in_flight)}

    @app.put("/ladle/upstream", dependencies=[front.admin_only])
    async def put_upstream(request: Request):
        """Admin: swap to another server (``url``, ``version``, ``pid``, ``model_dir``; ``argv`` and ``log`` to
        restart it); answers once the old one has no request in flight or ``drain_timeout_s`` passed. With
        ``expect_url``, compare-and-set: 409 (and no swap) unless the front still serves that URL. A running
        canary ends, superseded."""
        body = await request.json()
        old = front.state["upstream"]
        if "expect_url" in body and (old or {}).get("url") != body["expect_url"]:
            return error(
                409,
                f"{front.name}: the front serves {(old or {}).get('url')} (v{(old or {}).get('version')}), not "
                f"{body['expect_url']}: another swap came first",
                "invalid_request_error",
                "conflict",
            )
        new = {k: body[k] for k in ("url", "version", "pid", "model_dir")}
        new.update({k: body[k] for k in ("argv", "log") if k in body})
        front.switch(new)
        deadline = time.monotonic() + float(body.get("drain_timeout_s", 30.0))
        while old and old["url"] != new["url"] and front.in_flight[old["url"]] > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        left = front.in_flight[old["url"]] if old and old["url"] != new["url"] else 0
        return {"previous": old, "current": new, "drained": left == 0, "in_flight": left}


def add_proxy_route(app: FastAPI, front: Front) -> None:
    """Everything else: proxied to the server (or, during a canary, its share to the challenger)."""

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request):
        """Everything else (the OpenAI routes): proxied byte for byte to the server (during a canary, ``weight``
        of them to the challenger; during an adapter's canary, ``weight`` of that adapter's bare-name requests
        pinned to its challenger version), with ``x-ladle-model-version``."""
        body = await request.body()  # within serve.limits.max_body_bytes: the Guard refused anything larger
        drop = HOP_BY_HOP | {ADMIN_HEADER, PINNED_HEADER}  # the pin is the front's to set
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        adapter = asked_adapter(body) if front.adapter_canaries and request.method == "POST" else None
        adapter_canary = front.adapter_canaries.get(adapter) if adapter is not None else None
        skip_canary = False
        for _ in range(3):
            upstream = front.state["upstream"]
            canary = front.state.get("canary")
            pin = None
            if adapter_canary is not None:
                canary = adapter_canary
                arm, pin = front.pinned_arm(canary)
            else:
                arm = "challenger" if canary is not None and not skip_canary and canary.pick() else "champion"
            if arm == "challenger" and adapter_canary is None:
                upstream = canary.challenger
            elif front.supervisor.failed:
                return error(503, front.supervisor.failed, "server_error", "upstream_failed")
            if upstream is None:
                return error(503, f"{front.name}: no version is being served yet", "server_error", "not_ready")
            front.in_flight[upstream["url"]] += 1
            outgoing = front.client.build_request(
                request.method,
                f"{upstream['url']}/{path}",
                params=request.query_params,
                content=body,
                headers={**headers, PINNED_HEADER: pin} if pin is not None else headers,
            )
            sent = time.monotonic()
            try:
                answer = await until_gone(request, front.client.send(outgoing, stream=True))
            except ClientGone:  # the client hung up before the server answered: its upstream request was closed
                front.release(upstream["url"])
                return Response(status_code=499)
            except httpx.TransportError as exc:
                front.release(upstream["url"])
                if arm == "challenger" and adapter_canary is None:
                    # Counted against it; no answer came back (refused, or dropped before its headers), so the
                    # champion takes the request: a completion has no side effect to repeat.
                    canary.record(arm, False, None)
                    front.canary_requests.labels(arm, "error").inc()
                    skip_canary = True
                    continue
                if not isinstance(exc, httpx.ConnectError):
                    raise
                if front.state["upstream"] is not upstream:
                    continue  # swapped out before it was reached: the current server takes it
                if await front.supervisor.recovered(upstream):
                    continue  # it died and was restarted meanwhile: the restarted one takes it
                if front.supervisor.failed:
                    return error(503, front.supervisor.failed, "server_error", "upstream_failed")
                return error(
                    502, f"{front.name} v{upstream['version']} refused the connection", "server_error", "bad_gateway"
                )
            except BaseException:
                front.release(upstream["url"])
                raise
            # ok: None until the answer was relayed whole (a client that left is no evidence either way).
            outcome: dict = {"ok": None, "released": False}

            async def relay(answer=answer, outcome=outcome):
                try:
                    async for chunk in answer.aiter_raw():
                        yield chunk
                    outcome["ok"] = answer.status_code < 500
                except httpx.HTTPError:
                    outcome["ok"] = False  # the server broke the stream
                    raise
                except BaseException:
                    outcome["ok"] = None  # the client left: no evidence either way
                    raise

            async def release(answer=answer, url=upstream["url"], arm=arm, canary=canary, sent=sent, outcome=outcome):
                if outcome["released"]:
                    return
                outcome["released"] = True
                front.release(url)
                await answer.aclose()  # a client that left closes the upstream request: it cancels there too
                if outcome["ok"] is not None and canary is not None:
                    canary.record(arm, outcome["ok"], time.monotonic() - sent)
                    front.canary_requests.labels(arm, "ok" if outcome["ok"] else "error").inc()

            out_headers = {k: v for k, v in answer.headers.items() if k.lower() not in HOP_BY_HOP | {"date", "server"}}
            out_headers[VERSION_HEADER] = str(upstream["version"])
            if pin is not None:
                out_headers[PINNED_HEADER] = pin
            return Relayed(relay(), release, status_code=answer.status_code, headers=out_headers)
        return error(503, f"{front.name}: upstream changed repeatedly; retry", "server_error", "not_ready")


def asked_adapter(body: bytes) -> str | None:
    """The bare model name a request body asks for (``model`` without ``@``), or None: what an adapter canary
    splits. A body that is not a JSON object is the server's to refuse."""
    try:
        model = json.loads(body).get("model") if body else None
    except (ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and "@" not in model else None


def adopted(name: str) -> dict:
    """What a front that died left behind and a new one takes over: its upstream when that server still runs
    (supervision goes on with its argv), and its canary while its challenger runs too. A canary whose challenger
    is gone is dropped (the next reconcile finishes it in the registry)."""
    from ladle.serve import records

    try:
        old = json.loads(record_path(name).read_text())
    except (OSError, ValueError):
        return {}
    upstream = old.get("upstream")
    if not records.alive(upstream):
        return {}
    kept = {"upstream": upstream}
    canary = old.get("canary")
    if canary and records.alive(canary.get("challenger")):
        kept["canary"] = canary
    if old.get("adapter_canaries"):  # two versions on the server kept above: they go on with it
        kept["adapter_canaries"] = old["adapter_canaries"]
    return kept


def bind(host: str, port: int):
    """The front's listening socket, bound before the run record is written: a second front on a live front's
    port fails here, and never touches the live one's record."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets whose proto says
    # TCP, and each accepted connection takes the listener's. With 0, a response written as headers then body
    # waited for the client's delayed ACK: 44 ms added to every answer (bench/serve_split.py).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise SystemExit(
            f"error: --port {port}: cannot listen on {host}:{port} ({exc.strerror}). Free it, or start "
            "the front on another port (serve.front_port)."
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def hold_name(name: str):
    """An exclusive lock on ``NAME.lock`` for this process's life: at most one front per name on this machine
    (a second one, on any port, exits at once naming the first)."""
    import fcntl

    path = records_dir() / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        live = read_record(name) or {}
        raise SystemExit(
            f"error: --name {name}: a front for it already runs (pid {live.get('pid')}, {live.get('url')}). Use that "
            "one (`ladle model serve`), or stop it first (`ladle model stop`)."
        ) from None
    return handle


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ladle.fleet.front", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="The served (registered) model's name.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(
        "--max-body-bytes", type=int, default=DEFAULT_BODY_BYTES, help="Largest request body proxied (413 above)."
    )
    args = parser.parse_args(argv)
    import uvicorn

    from ladle.serve.__main__ import draining_server_class

    lock = hold_name(args.name)  # noqa: F841 - held until this process exits
    sock = bind(args.host, args.port)
    token = secrets.token_urlsafe(24)
    url = f"http://{args.host}:{args.port}"
    record = {"pid": os.getpid(), "pgid": os.getpgid(0), "name": args.name, "url": url, "token": token}
    record["started_at"] = time.time()
    path = record_path(args.name)
    kept = adopted(args.name)
    if kept:
        print(
            f"ladle front {args.name}: adopting v{kept['upstream'].get('version')} at {kept['upstream']['url']}"
            + (" and its canary" if "canary" in kept else ""),
            flush=True,
        )
    app = create_app(args.name, token, {**record, **kept}, path, max_body_bytes=args.max_body_bytes)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=30)
    write_record(path, {**record, "upstream": None, **kept})  # read only once /health answers
    try:
        draining_server_class()(config).run(sockets=[sock])
    finally:
        if (read_record(args.name) or {}).get("pid") == os.getpid():
            path.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
