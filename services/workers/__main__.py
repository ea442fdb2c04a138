"""``python -m services.workers``: one worker process (as ``seawall up`` runs it)."""

from __future__ import annotations

import os
import sys

from services.common.main import run_service
from services.workers.engine.factory import build_engine
from services.workers.engine.sim import SimulatedEngine
from services.workers.gpu import CUDA_DEVICES, open_gpu_probe, visible_devices
from services.workers.service import Worker
from services.workers.settings import WorkerSettings


def build(settings: WorkerSettings) -> Worker:
    engine = build_engine(settings)
    fallback = (lambda: [engine.gpu_reading()]) if isinstance(engine, SimulatedEngine) else None
    named = settings.gpu_devices
    devices = visible_devices(named if named is not None else os.environ.get(CUDA_DEVICES))
    return Worker(settings, engine, open_gpu_probe(fallback, devices))


def main() -> int:
    settings = WorkerSettings()
    return run_service("worker", settings, lambda: build(settings))


if __name__ == "__main__":
    sys.exit(main())
