"""User-Agent blacklist: case-insensitive substrings and regular expressions from config."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from services.ingress.policy.filters import PASS, FilterVerdict

DEFAULT_SUBSTRINGS: tuple[str, ...] = ("sqlmap", "nikto", "masscan", "zgrab", "nmap scripting")
"""Well-known scanners; operators extend the list in config."""


@dataclass(frozen=True, slots=True)
class UserAgentBlacklist:
    substrings: tuple[str, ...] = ()
    """Case-folded."""
    patterns: tuple[re.Pattern[str], ...] = ()
    block_missing: bool = False
    """Refuse requests without a User-Agent (or with an empty one)."""

    @classmethod
    def from_config(
        cls,
        substrings: Iterable[str] = DEFAULT_SUBSTRINGS,
        regexes: Iterable[str] = (),
        *,
        block_missing: bool = False,
    ) -> UserAgentBlacklist:
        """Build from config; an invalid regex raises ``re.error`` at start, not per request."""
        return cls(
            tuple(s.casefold() for s in substrings if s),
            tuple(re.compile(r, re.IGNORECASE) for r in regexes),
            block_missing,
        )

    def check(self, user_agent: str | None) -> FilterVerdict:
        if not user_agent:
            return FilterVerdict(False, "user_agent_missing") if self.block_missing else PASS
        folded = user_agent.casefold()
        if any(s in folded for s in self.substrings) or any(
            p.search(user_agent) for p in self.patterns
        ):
            return FilterVerdict(False, "user_agent_blocked")
        return PASS
