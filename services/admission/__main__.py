"""``python -m services.admission``: one admission process (as ``seawall up`` runs it).

Run several with the same ``SEAWALL_TOPIC_PREFIX``: they form one consumer group on the
priority topics and share the tenants' buckets in Redis.
"""

from __future__ import annotations

import asyncio
import sys

from services.admission.service import Admission
from services.admission.settings import AdmissionSettings
from services.common.lifecycle import run_until_signalled
from services.common.logs import configure
from services.common.metrics import serve_metrics


async def _run(settings: AdmissionSettings) -> int:
    return await run_until_signalled(Admission(settings), settings.shutdown_grace_s)


def main() -> int:
    settings = AdmissionSettings()
    configure(settings.log_level, settings.log_format)
    metrics = (
        serve_metrics(settings.metrics_port, "admission")
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
