"""``seawall status``: the fleet at a glance, for operators.

``fold`` (pure): telemetry and control records → a ``FleetStatus``; ``render``: that
status as tables; ``collect``: the records read from the broker, and ``run_status``,
what the command runs.
"""

from seawall.status.collect import StatusError, collect, run_status
from seawall.status.fold import STALE_AFTER_S, FleetStatus, StatusFold, TopicLag, lags
from seawall.status.render import render

__all__ = [
    "STALE_AFTER_S",
    "FleetStatus",
    "StatusError",
    "StatusFold",
    "TopicLag",
    "collect",
    "lags",
    "render",
    "run_status",
]
