"""A model server's Prometheus metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ladle.serve.backends import Backend


class Metrics:
    """The server's Prometheus metrics, in a registry of their own. Requests are labelled by route template
    (an unknown path is ``other``), so requests to random paths cannot grow the series without bound."""

    def __init__(self, backend: Backend, routes: frozenset[str]):
        self.routes = routes
        self.registry = r = CollectorRegistry()
        self.requests = Counter("ladle_requests", "Requests by route and status.", ["route", "status"], registry=r)
        self.prompt_tokens = Counter("ladle_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.completion_tokens = Counter("ladle_completion_tokens", "Completion tokens generated.", registry=r)
        self.cancelled = Counter("ladle_cancelled", "Generations cancelled because the client went away.", registry=r)
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
        self.ttft = Histogram("ladle_time_to_first_token_seconds", "Time to first token.", buckets=buckets, registry=r)
        self.latency = Histogram("ladle_request_seconds", "Request latency.", buckets=buckets, registry=r)
        self.batch = Histogram(
            "ladle_batch_size", "Requests per generation batch.", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r
        )
        self.captured = Counter(
            "ladle_captured", "Records kept by serve.capture, by kind (captures, feedback).", ["kind"], registry=r
        )
        self.capture_dropped = Counter(
            "ladle_capture_dropped", "Records serve.capture did not keep, by reason.", ["reason"], registry=r
        )
        self.capture_stopped = Gauge(
            "ladle_capture_stopped",
            "1 once serve.capture stopped (serving goes on), by reason.",
            ["reason"],
            registry=r,
        )
        depth = Gauge("ladle_queue_depth", "Requests waiting for a batch.", registry=r)
        depth.set_function(backend.queue_depth)

    def count(self, path: str, status: int) -> None:
        route = path if path in self.routes else "other"
        self.requests.labels(route, str(status)).inc()
