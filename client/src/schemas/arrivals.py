"""What ingress tells the controller about where requests come from.

Every ingress instance publishes, about once a second, the requests it received per
client region since its previous report (``RegionArrivals`` on ``llm.arrivals``). The
controller sums them over the instances and throttles a region whose arrivals surge
past a multiple of its own baseline while the fleet is hurting (hotspot detection,
``services.controller.policy.hotspots``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints

from schemas.base import Count, Ident, Message, Seconds, Timestamp

RegionName = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MAX_REGIONS = 256


class RegionArrivals(Message):
    type: Literal["region_arrivals"] = "region_arrivals"
    instance: Ident
    """The ingress instance that counted them."""
    at: Timestamp
    window_s: Seconds
    """How long the counting lasted (it ends at ``at``)."""
    counts: dict[RegionName, Count] = Field(max_length=MAX_REGIONS)
    """Requests received per region (clients of no known region are not counted)."""
