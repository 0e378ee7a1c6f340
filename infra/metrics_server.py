"""The ``/metrics`` HTTP server of a TrainGuard process without a web framework of its own (the
node exporter, the action service; a stream worker serves its metrics from Faust's web server).

prometheus_client's own threaded WSGI server on ``host:port``; ``port`` 0 or an empty ``host``
serves nothing.  A port already taken is logged, not raised: metrics are for watching a process
that must keep running (an exporter is its node's witness, the action service drives recoveries),
and several exporters on one host (a simulated cluster) would otherwise all but one die at start.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)


@dataclass
class MetricsServer:
    """A running ``/metrics`` server; :meth:`close` stops it and frees its port."""

    httpd: Any
    thread: threading.Thread

    @property
    def port(self) -> int:
        """The port it listens on."""
        return int(self.httpd.server_address[1])

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5.0)


def serve_metrics(registry: CollectorRegistry, host: str, port: int, what: str) -> MetricsServer | None:
    """Serve ``registry`` on ``host:port`` (None: disabled, or the port could not be bound)."""
    if not host or port <= 0:
        return None
    try:
        httpd, thread = start_http_server(port, host, registry)
    except OSError as exc:
        log.warning("%s: cannot serve /metrics on %s:%d (%s); running without metrics", what, host, port, exc)
        return None
    log.info("%s: /metrics on %s:%d", what, host, port)
    return MetricsServer(httpd, thread)
