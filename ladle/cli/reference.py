"""The HTTP API, events and metrics reference (``docs/http.md``), generated from the apps, the request models,
the Prometheus registries and ``ladle.lifecycle.events.EVENTS`` themselves, so it cannot drift.

``python -m ladle.cli.reference > docs/http.md``; ``tests/cli/test_cli_reference.py`` checks it is current.
"""

from __future__ import annotations

import inspect
import json
import sys
from types import SimpleNamespace

from fastapi.routing import APIRoute


def routes(app) -> list[str]:
    rows = ["| method | path | what it does |", "| --- | --- | --- |"]
    for route in app.routes:
        if not isinstance(route, APIRoute):
            continue
        doc = " ".join((inspect.getdoc(route.endpoint) or "").split())
        methods = ", ".join(sorted(route.methods))
        rows.append(f"| {methods} | `{route.path}` | {doc.replace('``', '`')} |")
    return rows


def fields(model) -> list[str]:
    schema = model.model_json_schema()
    rows = ["| field | type | default | limits |", "| --- | --- | --- | --- |"]
    for name, spec in schema["properties"].items():
        kinds = [s.get("type") or s.get("$ref", "").rsplit("/", 1)[-1] for s in spec.get("anyOf", [spec])]
        kind = spec.get("type") or " or ".join(k for k in kinds if k)
        if kind == "array" and "items" in spec:
            item = spec["items"].get("type") or spec["items"].get("$ref", "").rsplit("/", 1)[-1]
            kind = f"array of {item}"
        bounds = {k: v for part in [spec, *spec.get("anyOf", [])] for k, v in part.items()}
        limits = ", ".join(
            f"{word} {bounds[key]}"
            for key, word in (
                ("minimum", ">="),
                ("exclusiveMinimum", ">"),
                ("maximum", "<="),
                ("minItems", "items >="),
            )
            if key in bounds
        )
        required = name in schema.get("required", [])
        default = "required" if required else f"`{json.dumps(spec.get('default'))}`"
        rows.append(f"| `{name}` | {kind} | {default} | {limits} |")
    return rows


def metrics(registry) -> list[str]:
    """One row per metric of ``registry``. Read from its collectors (prometheus_client's ``_name``, ``_type``,
    ``_labelnames``, ``_documentation``), because a labelled metric has no sample to read until it is used."""
    rows = ["| metric | type | labels | what it counts |", "| --- | --- | --- | --- |"]
    for collector in registry._collector_to_names:
        name, kind = collector._name, collector._type
        if kind == "counter":
            name += "_total"
        labels = ", ".join(f"`{label}`" for label in collector._labelnames)
        rows.append(f"| `{name}` | {kind} | {labels} | {collector._documentation} |")
    return rows


def render() -> str:
    from ladle.fleet import front as router
    from ladle.lifecycle.events import EVENTS
    from ladle.serve import server
    from ladle.serve.metrics import Metrics
    from ladle.serve.schema import Sampling

    # Routes are listed, never served.
    backend = SimpleNamespace(queue_depth=lambda: 0, name="-", report_batches=lambda observe: None, context_length=2048)
    model_server = server.create_app(backend, "MODEL")
    front = router.create_app("NAME", "-", {}, None)
    front_registry = front.state.supervisor.registry
    server_registry = Metrics(backend, server.ROUTES).registry
    events = ["| event | when | payload |", "| --- | --- | --- |"]
    events += [f"| `{name}` | {when} | {payload} |" for name, (when, payload) in EVENTS.items()]
    lines = [
        "# HTTP API, events and metrics",
        "",
        "Generated from the code (`python -m ladle.cli.reference > docs/http.md`); a test keeps it current.",
        "",
        "## The model server (`ladle serve`, and each version behind the front)",
        "",
        "OpenAI-compatible. With `serve.api_key_env` set (`ladle serve --api-key-env NAME`), every route but",
        "`/health`, `/ready` and `/metrics` needs `Authorization: Bearer KEY`, compared in constant time. Errors",
        'are OpenAI\'s shape: `{"error": {"message", "type", "param", "code"}}`, with the field and value named',
        "for a bad request.",
        "",
        "The control routes (`POST` and `DELETE` under `/v1/adapters`: they change what a served name answers",
        "with) take their own credential, the admin key (`--admin-key-file FILE`; `ladle model serve` makes one",
        "per base server), as `Authorization: Bearer ADMIN_KEY`; the API key does not open them. Without it they",
        "are refused (403), unless the server was started with `--admin-loopback`, which allows them from this",
        "machine. `POST /v1/adapters` loads only from under an `--adapter-source` folder or store URL. ladle's",
        "front never forwards a control route.",
        "",
        "Every request is bounded before the work it bounds (`serve.limits`, see the config reference): a body",
        "over `max_body_bytes` gets 413 before it is read whole; more than `max_messages` messages, a prompt over",
        "`max_prompt_chars` characters, a stop string over `max_stop_chars` or `max_tokens` over `max_tokens` get",
        "400 naming the field; a request finding `max_queue` requests waiting gets 429 with `Retry-After`, and one",
        "that waits past `queue_timeout_s` gets 503 with `Retry-After` (a streamed one too: the status is known",
        "before the first chunk). A client that hangs up, streaming or not, cancels its generation. `/ready` and",
        "`/health` answer 503 once the engine fails every step.",
        "",
        *routes(model_server),
        "",
        "### Request fields",
        "",
        "`POST /v1/chat/completions` takes `messages` (a list of `{role, content}`, at least one);",
        "`POST /v1/completions` takes `prompt` (a string). Both take:",
        "",
        *fields(Sampling),
        "",
        "A field not listed is refused with HTTP 400 naming it (`unknown_parameter`), as is a value out of",
        "its limits; OpenAI fields this server does not implement answer `unsupported_parameter`.",
        "",
        "### Metrics (`/metrics`)",
        "",
        *metrics(server_registry),
        "",
        "## The front (`serve.front_port`: one stable address per registered model)",
        "",
        "Admin routes answer only requests from this machine carrying `x-ladle-admin-token` (the token is in",
        "the front's run record, `$LADLE_HOME/served/routers/NAME.json`, mode 0600).",
        "",
        *routes(front),
        "",
        "### Metrics (`/ladle/metrics`)",
        "",
        *metrics(front_registry),
        "",
        "## Prefect events",
        "",
        "Resource `ladle.model.NAME`, with labels `ladle.model.name` and `ladle.model.version`.",
        "",
        *events,
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(render())
