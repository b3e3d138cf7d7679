"""Prometheus metrics of one server: requests, failures, per-phase seconds (the frontend's and the
workers'), open sessions, and how the shards of sessions opened with ``capture`` ran (recorded,
replayed, eager: ``psg_captured_shards_total``).

Each server owns its own ``CollectorRegistry`` (several servers can live in one process, as in
tests), served over HTTP by :meth:`Metrics.serve_http` when ``--metrics-port`` is set.

>>> metrics = Metrics()
>>> with metrics.phase("compute"):
...     pass
>>> metrics.requests.labels(method="GetServerInfo").inc()
>>> b"psg_requests_total" in metrics.exposition()
True
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, start_http_server

__all__ = ["Metrics", "PHASES", "WORKER_PHASES"]

logger = logging.getLogger(__name__)

#: Phases of a ComputeGradients step, in order.
PHASES = ("receive", "validate", "compute", "noise", "account", "send")
#: Phases of one shard on its worker (within the step's "compute"): parameters and inputs onto the
#: worker's device, the DP computation, the result off it.
WORKER_PHASES = ("copy_in", "compute", "copy_out")
_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
            60.0, 120.0, 300.0)


class Metrics:
    """The server's Prometheus collectors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("psg_requests", "RPCs received, by method.", ["method"],
                                registry=self.registry)
        self.failures = Counter("psg_request_failures", "RPCs that ended with an error status.",
                                ["method", "code"], registry=self.registry)
        self.phase_seconds = Histogram("psg_step_phase_seconds", "Seconds per phase of a step.",
                                       ["phase"], buckets=_BUCKETS, registry=self.registry)
        self.sessions = Gauge("psg_open_sessions", "Open sessions.", registry=self.registry)
        self.samples = Counter("psg_samples", "Samples whose gradients were computed.",
                               registry=self.registry)
        self.worker_seconds = Histogram("psg_worker_phase_seconds", "Seconds per phase of a shard on its "
                                        "worker (copy_in, compute, copy_out).", ["phase"], buckets=_BUCKETS,
                                        registry=self.registry)
        self.captured_shards = Counter("psg_captured_shards", "Shards of sessions opened with capture, by how "
                                       "their worker's psg_core.CapturedStep ran them (eager, recorded, validated, "
                                       "replayed, refused, reruns).", ["path"], registry=self.registry)
        # Bound children: a labels() lookup per observation costs more than the observation.
        self._phases = {name: self.phase_seconds.labels(phase=name) for name in PHASES}
        self._worker_phases = {name: self.worker_seconds.labels(phase=name) for name in WORKER_PHASES}
        self._http: Any = None
        self._http_thread: Any = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Times the enclosed block as phase ``name`` of a step."""
        start = time.perf_counter()
        child = self._phases.get(name) or self.phase_seconds.labels(phase=name)
        try:
            yield
        finally:
            child.observe(time.perf_counter() - start)

    def observe_workers(self, results: Iterable[object]) -> None:
        """Records the worker-side phases of each shard result that carries ``timings`` (a
        :class:`~psg_server.executor.ShardResult`), and the captured step's path of each that
        carries one (``capture_path``)."""
        for result in results:
            timings = getattr(result, "timings", None)
            if timings is not None:
                self._worker_phases["copy_in"].observe(timings.copy_in)
                self._worker_phases["compute"].observe(timings.compute)
                self._worker_phases["copy_out"].observe(timings.copy_out)
            path = getattr(result, "capture_path", None)
            if path is not None:
                self.captured_shards.labels(path=path).inc()

    def exposition(self) -> bytes:
        """The text format Prometheus scrapes."""
        return generate_latest(self.registry)

    def serve_http(self, host: str, port: int) -> int:
        """Starts the ``/metrics`` HTTP endpoint in a daemon thread; returns the bound port."""
        self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        bound = int(self._http.server_port)
        logger.info("metrics: serving Prometheus metrics on http://%s:%d/metrics", host, bound)
        return bound

    def close(self) -> None:
        """Stops the HTTP endpoint, if any."""
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http_thread.join(timeout=5)
            self._http = self._http_thread = None
