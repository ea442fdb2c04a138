"""What one request occupies on a worker, in the engine's units (pure)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


@dataclass(frozen=True, slots=True)
class Cost:
    """What one request occupies on a worker, in the engine's units."""

    prompt_tokens: int = 0
    max_tokens: int = 0

    @property
    def kv_tokens(self) -> int:
        """The most its sequence can hold: what its KV reservation counts."""
        return self.prompt_tokens + self.max_tokens


NO_COST: Final = Cost()
"""A request that needs no engine (a static reply), or one whose cost is not known."""
