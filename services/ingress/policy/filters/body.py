"""Request body size limit, checked on the raw bytes before any parsing."""

from __future__ import annotations

from schemas.base import MAX_REQUEST_BYTES
from services.ingress.policy.filters import PASS, FilterVerdict

DEFAULT_MAX_BODY_BYTES = MAX_REQUEST_BYTES


def check_body(body: bytes | bytearray, limit: int = DEFAULT_MAX_BODY_BYTES) -> FilterVerdict:
    if len(body) > limit:
        return FilterVerdict(False, "body_too_large")
    return PASS


def check_declared_length(
    content_length: str | None, limit: int = DEFAULT_MAX_BODY_BYTES
) -> FilterVerdict:
    """Reject on the ``Content-Length`` header before reading the body.

    A missing header passes (a chunked body is checked by ``check_body`` as it is read);
    a malformed one is refused rather than guessed at.
    """
    if content_length is None:
        return PASS
    value = content_length.strip()
    if not value.isascii() or not value.isdigit():
        return FilterVerdict(False, "bad_content_length")
    # Compare lengths first: int() of a huge digit string is slow (and capped by Python).
    if len(value.lstrip("0")) > len(str(limit)) or int(value) > limit:
        return FilterVerdict(False, "body_too_large")
    return PASS
