"""``python -m services.workers``: one worker process (as ``seawall up`` runs it)."""

from __future__ import annotations

import asyncio
import sys

from services.common.lifecycle import run_until_signalled
from services.common.logs import configure
from services.common.metrics import serve_metrics
from services.workers.engine.factory import build_engine
from services.workers.engine.sim import SimulatedEngine
from services.workers.gpu import open_gpu_probe
from services.workers.service import Worker
from services.workers.settings import WorkerSettings


async def _run(settings: WorkerSettings) -> int:
    engine = build_engine(settings)
    fallback = (lambda: [engine.gpu_reading()]) if isinstance(engine, SimulatedEngine) else None
    worker = Worker(settings, engine, open_gpu_probe(fallback))
    return await run_until_signalled(worker, settings.shutdown_grace_s)


def main() -> int:
    settings = WorkerSettings()
    configure(settings.log_level, settings.log_format)
    metrics = (
        serve_metrics(settings.metrics_port, "worker")
        if settings.metrics_port is not None
        else None
    )
    try:
        return asyncio.run(_run(settings))
    finally:
        if metrics is not None:
            metrics.close()


if __name__ == "__main__":
    sys.exit(main())
