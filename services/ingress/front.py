"""What the HTTP routes share: the ``Front``, kept on the app's state
(``app.state.front``) by ``http.create_app`` and reached from a request with
``front_of``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import HTTPConnection

from seawall_client.clock import Clock
from services.ingress.pipeline import IngressPipeline
from services.ingress.replies import ReplyRouter
from services.ingress.settings import IngressSettings


@dataclass(frozen=True, slots=True)
class Front:
    """``pipeline`` and ``router`` are started and stopped by their owner (the ingress
    service), ``ready`` says whether they are up (``/health``); ``openapi`` is the
    document served at ``/openapi.json``."""

    pipeline: IngressPipeline
    router: ReplyRouter
    ready: Callable[[], bool]
    clock: Clock
    openapi: dict[str, Any]

    @property
    def settings(self) -> IngressSettings:
        return self.pipeline.settings


def front_of(conn: HTTPConnection) -> Front:
    """The ``Front`` of the app that ``conn`` came to."""
    front: Front = conn.app.state.front
    return front
