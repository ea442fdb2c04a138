"""``python -m services.controller``: the controller process (as ``seawall up`` runs it).

The faust worker runs inside this process; SIGTERM/SIGINT stop it cleanly (agents
finish their record, offsets are committed, the producers flush). Prometheus metrics
on ``SEAWALL_METRICS_PORT`` if set.
"""

from __future__ import annotations

import asyncio
import logging
import sys

from services.common.lifecycle import run_until_signalled
from services.common.logs import configure
from services.common.metrics import serve_metrics
from services.controller.app import Controller
from services.controller.settings import ControllerSettings


async def _run(settings: ControllerSettings) -> int:
    return await run_until_signalled(Controller(settings), settings.shutdown_grace_s)


def main() -> int:
    settings = ControllerSettings()
    configure(settings.log_level, settings.log_format)
    if settings.log_level != "DEBUG":
        # faust and mode narrate every service start and stop at INFO.
        for noisy in ("faust", "mode"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    metrics = (
        serve_metrics(settings.metrics_port, "controller")
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
