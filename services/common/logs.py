"""Structured logs: logfmt (as in seed 1's example) or JSON, one line per event.

Pass fields with ``extra``: ``log.info("request completed", extra={"latency_s": 1.23})``
prints ``ts=… level=INFO logger=… msg="request completed" latency_s=1.23``.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any

_STANDARD = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
    }


def _ts(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def logfmt_value(value: object) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    if text == "" or any(c in text for c in ' ="\\\n\t'):
        escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        return f'"{escaped}"'
    return text


def _document(record: logging.LogRecord, formatter: logging.Formatter) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "ts": _ts(record),
        "level": record.levelname,
        "logger": record.name,
        "msg": record.getMessage(),
        **_fields(record),
    }
    if record.exc_info:
        doc["exc"] = formatter.formatException(record.exc_info)
    return doc


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return " ".join(f"{k}={logfmt_value(v)}" for k, v in _document(record, self).items())


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(_document(record, self), default=str, ensure_ascii=False)


def configure(level: str = "INFO", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
