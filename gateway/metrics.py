"""Prometheus metrics of one gateway app (its own registry, so apps in one process don't collide).

Request counters come from ``StatusMiddleware`` (every response, by route and
status code) and from ``Generation`` (tokens, latencies, finish reasons). The
workers' load is republished at scrape time from the router's registry cache,
one gauge per field labelled by worker and role; a worker that stopped
heartbeating simply disappears from the scrape. With --enable-lora,
``tandem_lora_adapters`` is the number of LoRA adapters the cluster serves, read at
scrape time (the registry in Redis is the cluster's, so any gateway's count is the count). ``tandem_preemptions_total``
(per decode worker) is a counter that follows the monotonic count the worker
reports, republished as is.

Several gateway processes sharing one port (``tandem serve --gateway-processes``)
share their metrics through prometheus_client's multiprocess mode: the launcher
gives them one directory (``PROMETHEUS_MULTIPROC_DIR``, the library's own
variable, read when it is imported), each process writes its counters there, and
a scrape of any of them reads all of them (gauges: the sum over live processes).
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, multiprocess, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.cluster.process import process_exists

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_WORKER_FIELDS = ("num_free_blocks", "num_total_blocks", "num_running", "num_waiting")


def shared_dir() -> str | None:
    """The multiprocess directory this process writes its metrics to (None: its own registry only)."""
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") if values.ValueClass is not values.MutexValue else None


def forget_dead_processes(path: str) -> None:
    """Drop the live gauges of gateway processes that are gone (a restarted one left them behind)."""
    pids = {name.rsplit("_", 1)[-1].removesuffix(".db") for name in os.listdir(path) if name.endswith(".db")}
    for pid in pids:
        if pid.isdigit() and not process_exists(int(pid)):
            multiprocess.mark_process_dead(int(pid), path)


class GatewayMetrics:
    def __init__(self, worker_snapshot=None, lora_snapshot=None):
        """``worker_snapshot()`` returns the cached live workers ``{role: [WorkerInfo]}``;
        ``lora_snapshot()`` the number of served LoRA adapters last read (None: not reported)."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tandem_gateway_requests", "HTTP requests by route and status code",
                                ["route", "status"], registry=r)
        self.finished = Counter("tandem_gateway_finished_requests", "Generations by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("tandem_gateway_prompt_tokens", "Prompt tokens submitted", registry=r)
        self.generation_tokens = Counter("tandem_gateway_generation_tokens", "Output tokens received", registry=r)
        self.cached_tokens = Counter("tandem_gateway_cached_prompt_tokens", "Prompt tokens reused from a cache",
                                     registry=r)
        self.ttft = Histogram("tandem_gateway_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tandem_gateway_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.failovers = Counter("tandem_gateway_failovers", "Requests resumed on another decode worker after "
                                 "theirs was lost", registry=r)
        self.running = Gauge("tandem_gateway_requests_running", "Generations in flight in the gateways",
                             registry=r, multiprocess_mode="livesum")
        self.queued = Gauge("tandem_gateway_requests_queued", "Requests waiting for room on a decode worker",
                            registry=r, multiprocess_mode="livesum")
        self._worker_load = _WorkerLoadCollector(worker_snapshot) if worker_snapshot is not None else None
        self._cluster = [c for c in (self._worker_load, _LoraCollector(lora_snapshot) if lora_snapshot else None)
                         if c is not None]  # the cluster's state, read at scrape time: reported once
        self._shared = shared_dir()
        if self._shared is not None:
            forget_dead_processes(self._shared)
        for collector in self._cluster:
            r.register(collector)

    def render(self) -> bytes:
        if self._shared is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()  # every gateway process's metrics, and the cluster's state once
        multiprocess.MultiProcessCollector(registry, path=self._shared)
        for collector in self._cluster:
            registry.register(collector)
        return generate_latest(registry)


class _WorkerLoadCollector:
    def __init__(self, worker_snapshot):
        self._snapshot = worker_snapshot

    def describe(self):
        return []  # dynamic labels: nothing to check at registration

    def collect(self):
        families = {
            name: GaugeMetricFamily(f"tandem_worker_{name}", f"Worker {name} from its last heartbeat",
                                    labels=["worker", "role"])
            for name in _WORKER_FIELDS
        }
        preemptions = CounterMetricFamily("tandem_preemptions", "Requests a decode worker paused to free KV blocks",
                                          labels=["worker"])
        restarts = CounterMetricFamily("tandem_worker_restarts", "Times tandem serve's supervisor restarted a worker",
                                       labels=["worker", "role"])
        tier_blocks = GaugeMetricFamily("tandem_kv_host_tier_blocks", "KV blocks a prefill worker's host tier holds",
                                        labels=["worker"])
        tier_capacity = GaugeMetricFamily("tandem_kv_host_tier_capacity_blocks", "KV blocks its host tier can hold",
                                          labels=["worker"])
        tier_hits = CounterMetricFamily("tandem_kv_cache_hit_blocks", "Prompt blocks reused from a KV cache tier",
                                        labels=["worker", "tier"])
        tier_evictions = CounterMetricFamily("tandem_kv_host_tier_evictions", "Host tier blocks dropped for room",
                                             labels=["worker"])
        tier_bytes = CounterMetricFamily("tandem_kv_host_tier_bytes", "Bytes copied between the device pool and "
                                         "the host tier (rate(): the throughput)", labels=["worker", "direction"])
        for role, workers in self._snapshot().items():
            for worker in workers:
                for name, family in families.items():
                    family.add_metric([worker.worker_id, role], float(getattr(worker, name)))
                if role == "decode":
                    preemptions.add_metric([worker.worker_id], float(worker.num_preemptions))
                restarts.add_metric([worker.worker_id, role], float(worker.num_restarts))
                if worker.prefix_device_hits:
                    tier_hits.add_metric([worker.worker_id, "device"], float(worker.prefix_device_hits))
                if worker.host_tier_capacity:
                    tier_blocks.add_metric([worker.worker_id], float(worker.host_tier_blocks))
                    tier_capacity.add_metric([worker.worker_id], float(worker.host_tier_capacity))
                    tier_hits.add_metric([worker.worker_id, "host"], float(worker.host_tier_hits))
                    tier_evictions.add_metric([worker.worker_id], float(worker.host_tier_evictions))
                    tier_bytes.add_metric([worker.worker_id, "to_host"], float(worker.host_tier_bytes_out))
                    tier_bytes.add_metric([worker.worker_id, "to_device"], float(worker.host_tier_bytes_in))
        yield from (tier_blocks, tier_capacity, tier_hits, tier_evictions, tier_bytes)
        yield from families.values()
        yield restarts
        yield preemptions


class _LoraCollector:
    def __init__(self, lora_snapshot):
        self._snapshot = lora_snapshot

    def describe(self):
        return []

    def collect(self):
        count = self._snapshot()
        if count is not None:
            yield GaugeMetricFamily("tandem_lora_adapters", "LoRA adapters the cluster serves", value=float(count))


class StatusMiddleware:
    """Counts every response of the API routes by route path and status code."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, prefixes: tuple[str, ...] = ("/v1/",)):
        self.app = app
        self.metrics = metrics
        self.prefixes = prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not path.startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        status = 500  # what the client sees if the app raises before starting a response

        async def send_and_count(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.requests.labels(route=_route_label(path), status=str(status)).inc()


def _route_label(path: str) -> str:
    # bounded label values: unknown paths collapse into one
    return path if path in _ROUTES else "other"


_ROUTES = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
