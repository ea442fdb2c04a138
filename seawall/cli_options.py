"""What the ``seawall`` commands share: repeatable ``KEY=VALUE`` options, the
operator's reason and time-to-live, publishing an operator's control event, and printing
the control topic's decisions."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from schemas import ControlEvent

Reason = Annotated[str | None, typer.Option(help="Why (shown with the event).")]
Ttl = Annotated[
    float, typer.Option(min=1, max=86_400, help="How long it holds, in seconds (at most a day).")
]


def pairs(items: list[str] | None, option: str, shape: str) -> dict[str, str]:
    """A repeatable ``KEY=VALUE`` option as a dict; a malformed item is a usage error."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"{option} takes {shape}, got {item!r}")
        out[key.strip()] = value
    return out


def publish(
    event_of: Callable[[str, str, float], ControlEvent], reason: str | None, what: str
) -> None:
    """Build the event (``event_of(reason, issuer, now)``: issued by this operator, at
    this time) and publish it."""
    import asyncio
    import time

    from aiokafka.errors import KafkaError

    from seawall import steer
    from seawall.events import describe
    from services.common.control_signing import ControlKeysMissing
    from services.common.settings import CommonSettings

    settings = CommonSettings()
    try:
        issuer = steer.issuer_of(settings)
    except (ControlKeysMissing, OSError, ValueError) as e:
        typer.echo(f"no operator key to sign with: {e}", err=True)
        raise typer.Exit(1) from None
    try:
        event = event_of(reason or f"{what} by {issuer}", issuer, time.time())
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        asyncio.run(steer.publish(settings, event))
    except (OSError, TimeoutError, KafkaError) as e:
        typer.echo(f"could not publish to the control topic: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{event.control_key}: {describe(event)} (issuer {issuer}, seq {event.seq})")


def show_events(scope: str | None, kind: str | None, follow: bool) -> None:
    """Print the controller's decisions with their evidence, then those in force."""
    from rich.console import Console

    from seawall.events import run_events
    from services.common.settings import CommonSettings

    raise typer.Exit(run_events(CommonSettings(), scope, kind, follow, Console()))
