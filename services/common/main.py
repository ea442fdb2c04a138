"""The body of every service's ``python -m``: logs, ``/metrics``, run until signalled."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from services.common.lifecycle import Component, run_until_signalled
from services.common.logs import configure
from services.common.metrics import serve_metrics
from services.common.settings import CommonSettings


def run_service(name: str, settings: CommonSettings, build: Callable[[], Component]) -> int:
    """Configure logging, serve metrics on ``SEAWALL_METRICS_PORT`` if set, and run the
    component ``build`` makes (inside the event loop) until SIGTERM/SIGINT."""
    configure(settings.log_level, settings.log_format)
    metrics = (
        serve_metrics(settings.metrics_port, name, settings.metrics_host)
        if settings.metrics_port is not None
        else None
    )

    async def run() -> int:
        return await run_until_signalled(build(), settings.shutdown_grace_s)

    try:
        return asyncio.run(run())
    finally:
        if metrics is not None:
            metrics.close()
