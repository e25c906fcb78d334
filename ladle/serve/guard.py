"""ASGI middleware that looks at every HTTP request before an app parses it, for the model server and for ladle's
front alike: the API key (compared in constant time), then the body's size, refused with 413 as soon as it is over
``serve.limits.max_body_bytes`` (by its Content-Length, or while it arrives), so no oversized body is ever read
whole. A body within the bound is handed to the app as read; after it, ``receive`` is the connection's own, so a
client's hang-up still reaches the app. Refusals are OpenAI's error envelope."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass


def envelope(message: str, kind: str = "invalid_request_error", code: str | None = None, param: str | None = None):
    """OpenAI's error envelope, the one shape every error of the model server and the front takes (a response's
    body, or an event of a stream already begun)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


CONTROL_PREFIX = "/v1/adapters"
"""The adapter routes: ``GET`` lists what is served (the API key's, like the model list); every other method
changes what a served name answers with, and is a control route."""


def is_control(method: str, path: str) -> bool:
    """Whether ``method path`` changes what the server serves (registers, binds, syncs or removes an adapter): the
    routes that need the admin credential, and that ladle's public front never forwards."""
    path = "/" + path.lstrip("/")
    return method.upper() != "GET" and (path == CONTROL_PREFIX or path.startswith(CONTROL_PREFIX + "/"))


LOOPBACK = frozenset({"127.0.0.1", "::1", "localhost"})


@dataclass(frozen=True)
class Control:
    """Who may use the control routes: ``Authorization: Bearer <key>`` with the admin key (``key``; the API key
    does not open them), or, where the operator asked for it (``loopback``) and no key is set, any client on this
    machine. Neither set: the control routes are refused to everyone (a server is never open to changes by
    default)."""

    key: str | None = None
    loopback: bool = False

    def check(self, scope) -> None:
        sent = dict(scope["headers"]).get(b"authorization", b"")
        if self.key is not None:
            if not hmac.compare_digest(sent, f"Bearer {self.key}".encode()):
                raise Refused(
                    403,
                    "control routes (adding, binding, syncing or removing adapters) need the admin key: send "
                    "Authorization: Bearer <admin key> (the API key does not open them)",
                    "forbidden",
                    "permission_error",
                )
            return
        client = (scope.get("client") or ("", 0))[0]
        if self.loopback and client in LOOPBACK:
            return
        why = "from this machine only when started with --admin-loopback" if self.loopback else "off"
        raise Refused(
            403,
            f"control routes are {why}: start the server with --admin-key-file FILE (the admin key) to change "
            "its adapters over HTTP, or --admin-loopback to allow it from this machine without a key",
            "forbidden",
            "permission_error",
        )


class Refused(Exception):
    """A request refused before the app saw it."""

    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind

    def response(self):
        from starlette.responses import JSONResponse

        return JSONResponse(envelope(self.message, self.kind, self.code), status_code=self.status)


class Hungup(Exception):
    """The client left while its body was being read."""


class Guard:
    """``max_body_bytes``: the bound; ``api_key``: required as ``Authorization: Bearer`` on every path but
    ``open_paths`` (None: no key) and the control routes, which ``control`` decides alone (None: this app has none,
    and they are refused); ``refused(path, status)``: told of each refusal (the server counts them)."""

    def __init__(
        self,
        app,
        max_body_bytes: int,
        api_key: str | None = None,
        open_paths: frozenset[str] = frozenset(),
        refused: Callable[[str, int], None] = lambda path, status: None,
        control: Control | None = None,
    ):
        self.app, self.limit, self.open_paths, self.refused = app, max_body_bytes, open_paths, refused
        self.key = f"Bearer {api_key}".encode() if api_key else None
        self.control = control or Control()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self.authorise(scope)
            body = await self.read_body(scope, receive)
        except Refused as exc:
            self.refused(scope["path"], exc.status)
            await exc.response()(scope, receive, send)
            return
        except Hungup:
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    def authorise(self, scope) -> None:
        if is_control(scope.get("method", "GET"), scope["path"]):
            self.control.check(scope)
            return
        if self.key is None or scope["path"] in self.open_paths:
            return
        sent = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(sent, self.key):
            message = "missing or wrong API key: send Authorization: Bearer <key>"
            raise Refused(401, message, "invalid_api_key", "authentication_error")

    async def read_body(self, scope, receive) -> bytes:
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise Refused(400, f"Content-Length = {declared[:40]!r}: not a number of bytes.", "invalid_request")
            if int(declared) > self.limit:
                raise self.too_large(declared.decode())
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise Hungup
            body += message.get("body", b"")
            if len(body) > self.limit:
                raise self.too_large(f"more than {self.limit}")
            if not message.get("more_body"):
                return bytes(body)

    def too_large(self, size: str) -> Refused:
        return Refused(
            413,
            f"The request body has {size} bytes; this server takes at most {self.limit} "
            "(serve.limits.max_body_bytes). Send a shorter prompt or fewer messages.",
            "request_too_large",
        )
