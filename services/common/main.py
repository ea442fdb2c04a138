"""The body of every service's ``python -m``: logs, ``/metrics``, run until signalled."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable

from services.common.lifecycle import Component, run_until_signalled
from services.common.logs import configure
from services.common.metrics import serve_metrics
from services.common.settings import CommonSettings
from services.common.tracing import configure as configure_tracing

GC_YOUNG_THRESHOLD = 20_000
"""Container allocations between two collections of the youngest generation (CPython's
default is 700). A service allocates a few dozen objects per record and frees nearly
all of them by reference counting; at the default, admission collected about 600 times
in a 20,000-request run and spent 9-10 % of its CPU there (0.46 s), against 0.05 s at
this threshold (``bench/admission_throughput.py``). Cycles still get collected, later."""


def loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the event loop ``choice`` names (``CommonSettings.event_loop``);
    None: the standard library's. ``uvloop`` where it is not installed is an error,
    ``auto`` then falls back on the standard loop."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise
        return None
    return uvloop.new_event_loop


def run_service(name: str, settings: CommonSettings, build: Callable[[], Component]) -> int:
    """Configure logging, serve metrics on ``SEAWALL_METRICS_PORT`` if set, and run the
    component ``build`` makes (inside the event loop) until SIGTERM/SIGINT."""
    configure(settings.log_level, settings.log_format)
    configure_tracing(
        name,
        trace_dir=settings.trace_dir,
        file_mb=settings.trace_file_mb,
        sample=settings.trace_sample,
    )
    metrics = (
        serve_metrics(settings.metrics_port, name, settings.metrics_host)
        if settings.metrics_port is not None
        else None
    )

    # What the imports built (modules, schemas, validators) lives as long as the process:
    # no full collection needs to walk it again.
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])

    async def run() -> int:
        return await run_until_signalled(build(), settings.shutdown_grace_s)

    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            return runner.run(run())
    finally:
        if metrics is not None:
            metrics.close()
