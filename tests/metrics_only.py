"""A stand-in service for ``seawall up``'s supervision tests: it serves ``/metrics`` on
``SEAWALL_METRICS_PORT``, as every service does, and nothing else until SIGTERM."""

from __future__ import annotations

import os
import signal

from services.common.metrics import serve_metrics

if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    server = serve_metrics(int(os.environ["SEAWALL_METRICS_PORT"]), "stand-in")
    signal.sigwait({signal.SIGTERM})
    server.close()
