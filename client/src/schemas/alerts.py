"""Alerts: what an operator must look at, one record per alert and change, on
``llm.alerts`` keyed by ``fingerprint``.

The controller raises an alert while a condition holds (a breaker open, the degradation
ladder engaged, a worker's heartbeat lost, long prompts over their share, a region
throttled, a canary rolled back) and resolves it when the condition is gone; the same
condition always has the same ``fingerprint``, so readers keep the latest record per
fingerprint. A firing alert is re-published every
``valid_for_s / 2`` or so with a fresh ``last_seen``: a reader trusts it while
``last_seen + valid_for_s`` is ahead of its clock (a controller that stopped cannot
leave an alert firing forever). Notifications (webhook, e-mail) are derived from these
records, de-duplicated and grouped by the controller; the records themselves are the
truth ``seawall alerts`` shows.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.base import Ident, Message, Seconds, ShortText, Timestamp
from schemas.control import Evidence

AlertRule = Literal[
    "breaker_open",
    "degradation",
    "heartbeat_lost",
    "engine_stalled",
    "long_prompt_share",
    "output_inconsistency",
    "hotspot_throttle",
    "canary_rollback",
]
Severity = Literal["info", "warning", "critical"]
AlertStatus = Literal["firing", "resolved"]


class Alert(Message):
    type: Literal["alert"] = "alert"
    rule: AlertRule
    scope: Ident
    """What the alert is about: ``worker:<id>``, ``pool:<name>`` or ``fleet``."""
    pool: Ident | None = None
    """The pool the scope belongs to (what notifications are grouped by)."""
    severity: Severity
    status: AlertStatus
    fingerprint: Ident
    """The same for every record of the same (rule, scope): de-duplication's key."""
    first_seen: Timestamp
    """When this alert first fired (kept across flaps, see ``count``)."""
    last_seen: Timestamp
    """When the condition was last seen holding (firing) or found gone (resolved)."""
    count: int = Field(ge=1, le=2**31)
    """How many times it fired since ``first_seen``: a flapping condition counts up
    here instead of notifying anew each time."""
    valid_for_s: Seconds = 120.0
    summary: ShortText
    evidence: Evidence
