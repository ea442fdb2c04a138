"""``python -m services.admission``: one admission process (as ``seawall up`` runs it).

Run several with the same ``SEAWALL_TOPIC_PREFIX``: they form one consumer group on the
priority topics and share the tenants' buckets in Redis.
"""

from __future__ import annotations

import sys

from services.admission.service import Admission
from services.admission.settings import AdmissionSettings
from services.common.main import run_service


def main() -> int:
    settings = AdmissionSettings()
    return run_service("admission", settings, lambda: Admission(settings))


if __name__ == "__main__":
    sys.exit(main())
