"""Prometheus metrics of one API instance (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from meshnet.speculative import SpeculationStats

# Endpoints with their own label value; anything else is counted as "other" so that arbitrary request
# paths cannot grow the label set without bound.
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/v1/responses", "/health", "/metrics")


class ApiMetrics:
    """Counters, gauges and histograms exported at ``GET /metrics``.

    * ``meshnet_api_requests_total{endpoint,status}``: answered requests, each counted once, when its
      answer ends. A stream (sent with status 200 before its first token) counts 200 when it finished,
      499 when its client went away (or took nothing for a minute) before its end, and the status of the
      error that ended it when it failed (503 when the mesh lost a node it could not replace, 500 for a
      fault of the server); see :class:`~meshnet.api.middleware.BodyLimitAndMetrics`.
    * ``meshnet_api_prompt_tokens_total`` / ``meshnet_api_generated_tokens_total``: tokens in and out.
    * ``meshnet_api_ttft_seconds``: request arrival to first generated token, seconds.
    * ``meshnet_api_request_seconds{endpoint}``: request arrival to last byte, seconds.
    * ``meshnet_api_active_sessions``: generations holding a mesh session now.
    * ``meshnet_api_queued_requests``: generations waiting for a free slot.
    * ``meshnet_api_admission_waiting``: first prefills waiting in line for a stage's room (KV cells,
      sessions), as ``admission_waiting()`` counts them.
    * ``meshnet_api_errors_total{kind}``: error answers and failed streams by kind.
    * speculative decoding: ``meshnet_api_speculative_steps_total`` (verification steps),
      ``meshnet_api_speculative_drafted_tokens_total``, ``meshnet_api_speculative_accepted_tokens_total``
      and ``meshnet_api_speculative_acceptance_rate`` (accepted over drafted since start).
    * in process, per stage (label ``layers``): ``meshnet_stage_kv_bytes`` (KV pool resident bytes),
      ``meshnet_stage_kv_tokens_{held,kept,reserved,capacity}``, ``meshnet_stage_iterations_total``,
      ``meshnet_stage_batch_rows_total``, ``meshnet_stage_max_batch_rows``, ``meshnet_stage_waiting_steps``,
      ``meshnet_stage_queue_seconds_total`` (over ``meshnet_stage_queued_steps_total`` steps).
    * over a mesh, the client's: ``meshnet_mesh_failovers_total`` (sessions re-routed and replayed after a
      node failed), ``meshnet_mesh_unlike_failovers_total`` (of them, onto a node that computes otherwise:
      another backend or kernel), ``meshnet_mesh_orphan_releases_pending`` (sessions left on nodes it moved
      away from, not yet confirmed freed), ``meshnet_mesh_blocked_links`` (links between nodes that failed
      while both answered this client, whose routes it steps itself for now).

    Args:
        stage_metrics: returns ``(layers, Metrics)`` per in-process stage; None over a mesh.
        admission_waiting: returns how many requests wait in the admission line (None: no gauge).
        mesh_figures: returns the mesh client's figures (:data:`MESH_COUNTERS` and :data:`MESH_GAUGES`
            by name); None in process.
    """

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, stage_metrics: Callable[[], list] | None = None,
                 admission_waiting: Callable[[], int] | None = None,
                 mesh_figures: Callable[[], dict[str, int]] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        if stage_metrics is not None:
            r.register(_StageCollector(stage_metrics))
        if mesh_figures is not None:
            r.register(_MeshCollector(mesh_figures))
        self.requests = Counter("meshnet_api_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter("meshnet_api_prompt_tokens", "prompt tokens processed", registry=r)
        self.generated_tokens = Counter("meshnet_api_generated_tokens", "tokens generated", registry=r)
        self.ttft = Histogram("meshnet_api_ttft_seconds", "request arrival to first generated token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64), registry=r)
        self.latency = Histogram("meshnet_api_request_seconds", "request arrival to last byte",
                                 ["endpoint"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120),
                                 registry=r)
        self.active_sessions = Gauge("meshnet_api_active_sessions", "generations holding a mesh session",
                                     registry=r)
        self.queued = Gauge("meshnet_api_queued_requests", "generations waiting for a slot", registry=r)
        if admission_waiting is not None:
            Gauge("meshnet_api_admission_waiting", "first prefills waiting in line for a stage's room",
                  registry=r).set_function(admission_waiting)
        self.errors = Counter("meshnet_api_errors", "error answers and failed streams", ["kind"], registry=r)
        self.n_active = 0  # mirrors of the two gauges, for /health and admission (event-loop only)
        self.n_queued = 0
        self.speculation = SpeculationStats()
        self.spec_steps = Counter("meshnet_api_speculative_steps", "speculative verification steps", registry=r)
        self.spec_drafted = Counter("meshnet_api_speculative_drafted_tokens", "draft tokens verified", registry=r)
        self.spec_accepted = Counter("meshnet_api_speculative_accepted_tokens", "draft tokens accepted",
                                     registry=r)
        Gauge("meshnet_api_speculative_acceptance_rate", "accepted over drafted tokens since start",
              registry=r).set_function(lambda: self.speculation.acceptance_rate)

    def add_speculation(self, steps: int, drafted: int, accepted: int) -> None:
        """Count verification steps and their drafted and accepted tokens."""
        self.speculation.add(steps, drafted, accepted)
        self.spec_steps.inc(steps)
        self.spec_drafted.inc(drafted)
        self.spec_accepted.inc(accepted)

    def add_active(self, delta: int) -> None:
        self.n_active += delta
        self.active_sessions.set(self.n_active)

    def add_queued(self, delta: int) -> None:
        self.n_queued += delta
        self.queued.set(self.n_queued)

    @staticmethod
    def endpoint_label(path: str) -> str:
        return path if path in ENDPOINTS else "other"

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The mesh client's figures at /metrics: counters, then gauges, each (name, help).
MESH_COUNTERS = (("failovers", "sessions re-routed and replayed after a node failed"),
                 ("unlike_failovers", "failovers onto a node that computes otherwise (another backend or kernel)"))
MESH_GAUGES = (("orphan_releases_pending", "sessions left on nodes failed over away from, not yet confirmed freed"),
               ("blocked_links", "links between nodes that failed while both answered, stepped by this client"))


class _MeshCollector:
    """The mesh client's figures, read at each scrape."""

    def __init__(self, source: Callable[[], dict[str, int]]) -> None:
        self.source = source

    def collect(self):
        figures = self.source()
        for name, text in MESH_COUNTERS:
            yield CounterMetricFamily(f"meshnet_mesh_{name}", text, value=float(figures[name]))
        for name, text in MESH_GAUGES:
            yield GaugeMetricFamily(f"meshnet_mesh_{name}", text, value=float(figures[name]))


class _StageCollector:
    """The in-process stages' engine figures, read at each scrape."""

    GAUGES = ("kv_bytes", "kv_tokens_held", "kv_tokens_kept", "kv_tokens_reserved", "kv_tokens_capacity",
              "max_batch_rows", "waiting_steps")
    COUNTERS = ("iterations", "batch_rows", "queue_seconds", "queued_steps")

    def __init__(self, source: Callable[[], list]) -> None:
        self.source = source

    def collect(self):
        stages = self.source()
        for name in self.GAUGES:
            g = GaugeMetricFamily(f"meshnet_stage_{name}", f"stage {name}", labels=["layers"])
            for layers, m in stages:
                g.add_metric([layers], float(getattr(m, name)))
            yield g
        for name in self.COUNTERS:
            c = CounterMetricFamily(f"meshnet_stage_{name}", f"stage {name}", labels=["layers"])
            for layers, m in stages:
                c.add_metric([layers], float(getattr(m, name)))
            yield c
