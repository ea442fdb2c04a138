"""Ingress pre-filters (DESIGN, "Pre-filter"): cheap, pure checks run before a request
is classified and produced onto a priority topic.

Each module is a policy without I/O: ``body`` (size limit on the raw bytes),
``useragent`` (blacklist), ``sensitive`` (credentials, card, ID and phone numbers;
block or redact), ``geo`` (client region from ``X-Forwarded-For``) and
``prompt_length`` (token estimate and histogram buckets). Reasons are stable codes and
never carry the inspected value.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FilterVerdict:
    allowed: bool
    reason: str | None = None
    """A stable code (``body_too_large``, ``user_agent_blocked``, ...); never user data."""


PASS = FilterVerdict(True)
