"""What admission tells ingress so that an abusive tenant is refused at the edge.

A ``QuotaHint`` says that a tenant's *requests* bucket cannot pay for one more request
before ``until`` (admission's quota decision, on the quota store's clock): no request of
that tenant can be admitted before then, whatever it asks for. Ingress refuses the
tenant's requests until ``until`` without a Kafka hop or a Redis call; after it, they go
to admission as usual. Only the requests dimension is hinted: its count is never
refunded, so the hint can never refuse what the bucket would admit (the token dimension
is corrected by actual use and refunds, and a short request may still fit it).

A hint whose ``until`` is not after its ``issued_at`` *clears* the tenant's hint: its
quota changed (a ``QuotaOverride`` came, went or changed), so what the last hint said may
no longer hold; the tenant's next requests go to admission again.
"""

from __future__ import annotations

from typing import Literal

from schemas.base import Ident, Message, Timestamp
from schemas.replies import RateLimitInfo


class QuotaHint(Message):
    type: Literal["quota_hint"] = "quota_hint"
    tenant: Ident
    until: Timestamp
    """Epoch seconds (the quota store's clock) before which the tenant's requests bucket
    holds less than one request."""
    issued_at: Timestamp
    rate_limit: RateLimitInfo
    """The figures of the rejection behind the hint, for the refusals' headers."""
