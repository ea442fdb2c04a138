"""Ingress's spans (``services.common.tracing``)."""

from __future__ import annotations

from services.common.tracing import Tracer

TRACER = Tracer("ingress")
