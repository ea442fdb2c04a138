"""What admission does when a control decision changes or expires.

``ControlFollower`` (``services.common.control``; wired by the service) keeps the latest
control event per key (and dead-letters what is not one: admission is the fleet's one
group on it); a decision that expires falls back to the default. Its changes land here:
a worker's breaker sets that worker's share of the pacing rule, a pool's breaker is
logged once per change, a tenant's quota override that came, went or changed clears the
tenant's hint at ingress, and every event asks for a dispatch round now.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from schemas import BreakerState, ControlEvent, QuotaOverride
from services.admission.hint_publisher import HintPublisher
from services.admission.policy.capacity import FleetCapacity
from services.admission.policy.routing import worker_share
from services.common.control_state import ControlState

log = logging.getLogger(__name__)


class ControlReactions:
    """The follower's callback (``on_control``), on a change and on an expiry."""

    def __init__(
        self,
        control: ControlState,
        capacity: FleetCapacity,
        rate_limit_factor: float,
        hints: HintPublisher,
        wake: Callable[[], None],
    ) -> None:
        self._control = control
        self._capacity = capacity
        self._rate_limit_factor = rate_limit_factor
        self._hints = hints
        self._wake = wake
        self._breakers: dict[str, tuple[str, int]] = {}

    def on_control(self, event: ControlEvent) -> None:
        """A decision changed or expired: apply what is in force now for its scope."""
        if isinstance(event, QuotaOverride):
            self._hints.quota_changed(event.tenant)
        if isinstance(event, BreakerState):
            kind, _, name = event.scope.partition(":")
            current = self._control.get(BreakerState, event.scope)
            if kind == "worker":
                share = 1.0 if current is None else worker_share(current, self._rate_limit_factor)
                self._capacity.share(name, share)
            else:
                state = ("closed", 0) if current is None else (current.state, int(current.level))
                if self._breakers.get(event.scope, ("closed", 0)) != state:
                    # Level 1 of the matrix is "log only": this is that log (once per
                    # change, not per re-publication).
                    self._breakers[event.scope] = state
                    log.warning(
                        "pool breaker changed",
                        extra={"scope": event.scope, "state": state[0], "breaker_level": state[1]},
                    )
        self._wake()
