"""``python -m services.controller``: the controller process (as ``seawall up`` runs it).

The faust worker runs inside this process; SIGTERM/SIGINT stop it cleanly (agents
finish their record, offsets are committed, the producers flush). Prometheus metrics
on ``SEAWALL_METRICS_PORT`` if set.
"""

from __future__ import annotations

import logging
import sys

from services.common.main import run_service
from services.controller.service import Controller
from services.controller.settings import ControllerSettings


def main() -> int:
    settings = ControllerSettings()
    if settings.log_level != "DEBUG":
        # faust and mode narrate every service start and stop at INFO.
        for noisy in ("faust", "mode"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
    return run_service("controller", settings, lambda: Controller(settings))


if __name__ == "__main__":
    sys.exit(main())
