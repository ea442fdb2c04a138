"""``python -m services.ingress``: one ingress process (HTTP on ``SEAWALL_INGRESS_HOST``
:``SEAWALL_INGRESS_PORT``, the Kafka ingress, the reply router)."""

from __future__ import annotations

import logging
import sys

from pydantic import ValidationError

from services.common.main import run_service
from services.ingress.service import IngressService
from services.ingress.settings import IngressSettings


class _NoColour(logging.Filter):
    """uvicorn adds an ANSI-coloured copy of each message as an extra field."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.__dict__.pop("color_message", None)
        return True


def main() -> int:
    try:
        settings = IngressSettings()
    except ValidationError as e:  # say what to set, not a traceback
        for error in e.errors(include_url=False, include_input=False):
            print(f"ingress: {error['msg']}", file=sys.stderr)
        return 2
    logging.getLogger("uvicorn.error").addFilter(_NoColour())
    return run_service("ingress", settings, lambda: IngressService(settings))


if __name__ == "__main__":
    sys.exit(main())
