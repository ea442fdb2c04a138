"""``python -m services.ingress``: one ingress process (HTTP on ``SEAWALL_INGRESS_HOST``
:``SEAWALL_INGRESS_PORT``, the Kafka ingress, the reply router)."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.common.lifecycle import run_until_signalled
from services.common.logs import configure
from services.common.metrics import serve_metrics
from services.ingress.service import IngressService
from services.ingress.settings import IngressSettings


class _NoColour(logging.Filter):
    """uvicorn adds an ANSI-coloured copy of each message as an extra field."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("color_message", None)
        return True


async def _run(settings: IngressSettings) -> int:
    return await run_until_signalled(IngressService(settings), settings.shutdown_grace_s)


def main() -> int:
    settings = IngressSettings()
    configure(settings.log_level, settings.log_format)
    logging.getLogger("uvicorn.error").addFilter(_NoColour())
    metrics = (
        serve_metrics(settings.metrics_port, "ingress")
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
