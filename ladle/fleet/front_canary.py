"""The front's canary routes (``/ladle/canary``): an admin starts, reads, rolls back and forgets a canary, of the
served model (a second server) or of one adapter's version on a base's front. The verdict itself is
``ladle.fleet.canary``; the front (``ladle.fleet.front``) routes each request to an arm."""

from __future__ import annotations

from fastapi import FastAPI, Request
from pydantic import ValidationError

from ladle.config import CanaryConfig
from ladle.fleet.canary import Canary
from ladle.serve.adapters import MAX_VERSIONS
from ladle.serve.guard import Refused

MAX_ADAPTER_CANARIES = MAX_VERSIONS // 2
"""Adapter canaries one front runs at once: as many as its server follows registered models (each serving two
versions), so the front's state stays bounded whatever admin requests arrive."""


def add_canary_routes(app: FastAPI, front) -> None:
    """``front``: the ``ladle.fleet.front.Front`` whose state the routes change.

    Admin: start, read, roll back and forget a canary: the served model's (a second server), or with
    ``?adapter=NAME`` (``adapter`` in a PUT's body) one adapter's on a base's front (two versions one server holds)."""

    @app.get("/ladle/canary", dependencies=[front.admin_only])
    def get_canary(adapter: str | None = None):
        """Admin: the canary's state: status, reason, limits and each arm's requests, errors and p95 (``adapter``:
        that adapter's). Without ``adapter``, ``adapters`` lists the adapters' canaries."""
        if adapter is not None:
            return {"canary": front.adapter_summary(adapter)}
        canary = front.state.get("canary")
        return {"canary": canary.summary() if canary else None, "adapters": sorted(front.adapter_canaries)}

    @app.put("/ladle/canary", dependencies=[front.admin_only])
    async def put_canary(request: Request):
        """Admin: start a canary of the server in the body (as for a swap, plus ``limits``: promote.canary's
        fields) against the current one, or, with ``adapter``, of that adapter's ``version`` against its
        ``champion_version`` (both served by the server behind the front); the same version again answers its
        state, another while one is not finished 409; past ``MAX_ADAPTER_CANARIES`` at once, 409."""
        body = await request.json()
        adapter = body.get("adapter")
        canary = front.state.get("canary") if adapter is None else front.adapter_canaries.get(adapter)
        if canary is not None:
            if canary.version == str(body.get("version")):
                return {"canary": canary.summary() if adapter is None else front.adapter_summary(adapter)}
            what = f"{adapter} " if adapter else ""
            return Refused(
                409, f"{front.name}: the canary of {what}v{canary.version} is not finished", "busy"
            ).response()
        upstream = front.state["upstream"]
        if upstream is None:
            return Refused(409, f"{front.name}: no champion is served to compare with", "not_ready").response()
        if adapter is not None and len(front.adapter_canaries) >= MAX_ADAPTER_CANARIES:
            return Refused(
                409,
                f"{front.name}: {len(front.adapter_canaries)} adapter canaries already (MAX_ADAPTER_CANARIES); "
                "finish or delete one first (DELETE /ladle/canary?adapter=NAME)",
                "busy",
            ).response()
        try:
            limits = CanaryConfig.model_validate(body.get("limits") or {})
            if adapter is not None:
                if not isinstance(adapter, str) or not adapter or "@" in adapter:
                    raise KeyError("adapter")
                where = {"url": upstream["url"], "pid": upstream.get("pid"), "adapter": adapter}
                challenger = {**where, "version": str(body["version"])}
                measured = {**where, "version": str(body["champion_version"])}
            else:
                challenger = {k: body[k] for k in ("url", "version", "pid", "model_dir")}
                challenger.update({k: body[k] for k in ("argv", "log") if k in body})
                measured = dict(upstream)
        except (ValidationError, KeyError) as exc:
            return Refused(422, f"bad canary: {exc}", "invalid").response()
        if adapter is not None:
            front.adapter_canaries[adapter] = Canary(challenger, measured, limits)
            front.persist()
            return {"canary": front.adapter_summary(adapter)}
        front.state["canary"] = Canary(challenger, measured, limits)
        front.persist()
        return {"canary": front.state["canary"].summary()}

    @app.patch("/ladle/canary", dependencies=[front.admin_only])
    def end_canary(reason: str = "stopped by the operator", adapter: str | None = None):
        """Admin: roll back a running canary with ``?reason=`` and keep its verdict for whoever follows it (an
        operator's rollback); its state."""
        canary = front.state.get("canary") if adapter is None else front.adapter_canaries.get(adapter)
        if canary is not None and canary.status == "running":
            canary.end("rolled_back", reason)
            front.persist()
        if adapter is not None:
            return {"canary": front.adapter_summary(adapter)}
        return {"canary": canary.summary() if canary else None}

    @app.delete("/ladle/canary", dependencies=[front.admin_only])
    def delete_canary(reason: str = "stopped by the operator", adapter: str | None = None):
        """Admin: end the canary (one still running is rolled back with ``?reason=``) and forget it; its final
        state."""
        summary = front.adapter_summary(adapter) if adapter is not None else None
        canary = front.state.pop("canary", None) if adapter is None else front.adapter_canaries.pop(adapter, None)
        if canary is not None and canary.status == "running":
            canary.end("rolled_back", reason)
            summary = {**(summary or {}), "status": canary.status, "reason": canary.reason}
        front.persist()
        if adapter is not None:
            return {"canary": summary}
        return {"canary": canary.summary() if canary else None}
