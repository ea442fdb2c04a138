from __future__ import annotations

import json
import logging

from services.common.logs import JsonFormatter, LogfmtFormatter


def _record(msg: str, **fields: object) -> logging.LogRecord:
    record = logging.makeLogRecord(
        {"name": "seawall.test", "levelname": "INFO", "msg": msg, "created": 0}
    )
    record.__dict__.update(fields)
    return record


def test_logfmt_quotes_what_needs_it() -> None:
    line = LogfmtFormatter().format(
        _record("request completed", latency_s=1.23, batch_size=8, note='a "b"')
    )
    assert line.startswith("ts=1970-01-01T00:00:00.000Z level=INFO logger=seawall.test ")
    assert 'msg="request completed" latency_s=1.23 batch_size=8 note="a \\"b\\""' in line


def test_json_lines_parse() -> None:
    doc = json.loads(JsonFormatter().format(_record("x", worker="w1")))
    assert doc["msg"] == "x"
    assert doc["worker"] == "w1"
