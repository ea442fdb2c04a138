"""Each service serves its Prometheus metrics on ``/metrics`` (``SEAWALL_METRICS_PORT``)."""

from __future__ import annotations

from importlib.metadata import version
from threading import Thread
from wsgiref.simple_server import WSGIServer

from prometheus_client import Info, start_http_server

BUILD = Info("seawall_build", "seawall version and service")


class MetricsServer:
    """The exposition server; ``close`` is idempotent."""

    def __init__(self, server: WSGIServer, thread: Thread) -> None:
        self._server: WSGIServer | None = server
        self._thread = thread

    @property
    def port(self) -> int:
        return self._server.server_port if self._server else 0

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = None


def serve_metrics(port: int, service: str, host: str = "127.0.0.1") -> MetricsServer:
    # the installed distribution's version: the runtime never imports the CLI above it
    BUILD.info({"version": version("seawall"), "service": service})
    server, thread = start_http_server(port, addr=host)
    return MetricsServer(server, thread)
