"""The quota hints ingress refuses by (pure): tenant → until when its requests bucket
is empty, as admission published (``schemas.hints``).

A hint refuses only before its ``until`` and never admits anything: a request it does
not refuse goes to admission, the authority, as before. Compared on this host's clock
with ``until`` (the quota store's): a clock behind the store's refuses up to the skew
longer (NTP keeps it to milliseconds). At most ``max_tenants`` hints are held; when
full, hints that have passed are dropped, then the one that ends soonest. A hint covers
at most ``max_hint_s`` from when it is read, whatever its ``until`` says: a longer wait
is confirmed by admission again, and a forged hint cannot lock a tenant out for long.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from schemas import QuotaHint


@dataclass
class QuotaHints:
    max_tenants: int = 100_000
    max_hint_s: float = 60.0
    _hints: dict[str, QuotaHint] = field(default_factory=dict)

    def observe(self, hint: QuotaHint, now: float) -> None:
        if hint.until <= hint.issued_at:  # a clear (``schemas.hints``)
            held = self._hints.get(hint.tenant)
            if held is not None and held.issued_at <= hint.issued_at:
                del self._hints[hint.tenant]
            return
        if hint.until > now + self.max_hint_s:
            hint = hint.model_copy(update={"until": now + self.max_hint_s})
        held = self._hints.get(hint.tenant)
        if (
            self.max_tenants <= 0
            or hint.until <= now
            or (held is not None and held.until >= hint.until)
        ):
            return
        if held is None and len(self._hints) >= self.max_tenants:
            for tenant in [t for t, h in self._hints.items() if h.until <= now]:
                del self._hints[tenant]
            if len(self._hints) >= self.max_tenants:
                del self._hints[min(self._hints, key=lambda t: self._hints[t].until)]
        self._hints[hint.tenant] = hint

    def covering(self, tenant: str, now: float) -> QuotaHint | None:
        """The hint that refuses ``tenant``'s request at ``now``, if one does."""
        hint = self._hints.get(tenant)
        if hint is not None and hint.until <= now:
            del self._hints[tenant]
            return None
        return hint

    def __len__(self) -> int:
        return len(self._hints)
