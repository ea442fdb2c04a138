"""``seawall quota``, ``seawall region``, ``seawall canary`` and ``seawall profile``: an
operator's decisions, published on the control topic while the fleet runs."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer

from seawall.cli_options import Reason, Ttl, publish, show_events

if TYPE_CHECKING:
    from schemas import ControlEvent

quota_app = typer.Typer(no_args_is_help=True, add_completion=False)
region_app = typer.Typer(no_args_is_help=True, add_completion=False)
canary_app = typer.Typer(no_args_is_help=True, add_completion=False)


@quota_app.command("set")
def quota_set(
    tenant: Annotated[str, typer.Option(help="The tenant.")],
    rps: Annotated[float | None, typer.Option(min=0, help="Requests per second.")] = None,
    tpm: Annotated[float | None, typer.Option(min=0, help="Tokens per minute.")] = None,
    burst: Annotated[float | None, typer.Option(min=0, help="Requests bucket size.")] = None,
    ttl: Ttl = 3_600.0,
    reason: Reason = None,
) -> None:
    """Override a tenant's quota (0 suspends it) at every admission replica."""
    from seawall import steer

    publish(
        lambda why, issuer, now: steer.quota_set(
            tenant,
            requests_per_s=rps,
            tokens_per_minute=tpm,
            burst=burst,
            ttl_s=ttl,
            reason=why,
            issuer=issuer,
            now=now,
        ),
        reason,
        "quota set",
    )


@quota_app.command("clear")
def quota_clear(
    tenant: Annotated[str, typer.Option(help="The tenant.")], reason: Reason = None
) -> None:
    """Back to the tenant's tier quota."""
    from seawall import steer

    publish(
        lambda why, issuer, now: steer.quota_clear(tenant, reason=why, issuer=issuer, now=now),
        reason,
        "quota cleared",
    )


@quota_app.command("list")
def quota_list() -> None:
    """The quota overrides on the control topic, with who issued them and why."""
    show_events("tenant:*", "quota_override", follow=False)


@region_app.command("throttle")
def region_throttle(
    region: Annotated[str, typer.Option(help="The region (ingress's region table).")],
    rps: Annotated[float, typer.Option(min=0, help="Requests per second (0 suspends).")],
    ttl: Ttl = 3_600.0,
    reason: Reason = None,
) -> None:
    """Throttle the requests from a region at every admission replica."""
    from seawall import steer

    publish(
        lambda why, issuer, now: steer.region_throttle(
            region, rate_per_s=rps, ttl_s=ttl, reason=why, issuer=issuer, now=now
        ),
        reason,
        "region throttled",
    )


@region_app.command("lift")
def region_lift(
    region: Annotated[str, typer.Option(help="The region.")], reason: Reason = None
) -> None:
    """Lift a region's throttle."""
    from seawall import steer

    publish(
        lambda why, issuer, now: steer.region_throttle(
            region, rate_per_s=None, ttl_s=3_600.0, reason=why, issuer=issuer, now=now
        ),
        reason,
        "region throttle lifted",
    )


@region_app.command("list")
def region_list() -> None:
    """The region throttles on the control topic, with who issued them and why."""
    show_events("region:*", "region_throttle", follow=False)


Pool = Annotated[str, typer.Option(help="The pool the version is released into.")]


@canary_app.command("start")
def canary_start(
    pool: Pool,
    version: Annotated[
        str,
        typer.Option(
            help="The version; its workers run with SEAWALL_POOL=<pool> "
            "SEAWALL_CANARY_VERSION=<version>."
        ),
    ],
    steps: Annotated[
        str, typer.Option(help="The canary's share at each step, in percent.")
    ] = "5,25,50,100",
    hold: Annotated[str, typer.Option(help="How long each step holds (300, 30s, 5m).")] = "5m",
    check: Annotated[
        str, typer.Option(help="How long its workers must report, with no traffic, first.")
    ] = "30s",
    min_requests: Annotated[
        int, typer.Option(min=1, help="Canary requests a window needs to be judged.")
    ] = 20,
    max_error_delta: Annotated[
        float, typer.Option(min=0, max=1, help="Error rate allowed above the pool's.")
    ] = 0.02,
    max_latency_ratio: Annotated[
        float, typer.Option(min=1, help="Latency P99 allowed, as a multiple of the pool's.")
    ] = 1.5,
    max_ttft_ratio: Annotated[
        float, typer.Option(min=1, help="Mean TTFT allowed, as a multiple of the pool's.")
    ] = 1.5,
    max_mismatch_delta: Annotated[
        float,
        typer.Option(
            min=0,
            max=1,
            help="Output mismatch rate of its shadow runs allowed above the pool's "
            "(with admission's consistency_sample on).",
        ),
    ] = 0.05,
    reason: Reason = None,
) -> None:
    """Start a canary release of a pool's new version.

    Its workers are checked first (reporting, with no traffic), then its share widens
    step by step while it stays within bounds of the pool's own workers; crossing one
    rolls it back, with an alert.
    """
    import asyncio
    import time

    from aiokafka.errors import KafkaError

    from seawall import steer
    from services.common.settings import CommonSettings

    def release(why: str, issuer: str, now: float) -> ControlEvent:
        return steer.canary_start(
            pool,
            version,
            steps=steer.percent_steps(steps),
            hold_s=steer.duration_s(hold),
            check_s=steer.duration_s(check),
            min_requests=min_requests,
            max_error_rate_delta=max_error_delta,
            max_latency_ratio=max_latency_ratio,
            max_ttft_ratio=max_ttft_ratio,
            max_mismatch_rate_delta=max_mismatch_delta,
            reason=why,
            issuer=issuer,
            now=now,
        )

    try:
        release("", steer.operator(), time.time())  # terms checked before any topic exists
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        asyncio.run(steer.create_canary_topic(CommonSettings(), pool, version))
    except (OSError, TimeoutError, KafkaError) as e:
        typer.echo(f"could not create the canary's dispatch topic: {e}", err=True)
        raise typer.Exit(1) from None
    publish(release, reason, "canary started")


def _canary_command(pool: str, action: str, reason: str | None) -> None:
    import asyncio

    from schemas import CanaryRelease
    from seawall import steer
    from services.common.settings import CommonSettings

    state = asyncio.run(steer.read_control(CommonSettings()))
    running = state.get(CanaryRelease, f"pool:{pool}")
    if running is None:
        typer.echo(f"no canary release of pool {pool} on the control topic", err=True)
        raise typer.Exit(1)
    publish(
        lambda why, issuer, now: steer.canary_command(
            running, action, reason=why, issuer=issuer, now=now
        ),
        reason,
        f"canary {action}",
    )


@canary_app.command("promote")
def canary_promote(pool: Pool, reason: Reason = None) -> None:
    """Give the canary all of the pool's traffic now, without the steps left."""
    _canary_command(pool, "promote", reason)


@canary_app.command("abort")
def canary_abort(pool: Pool, reason: Reason = None) -> None:
    """Send the pool's traffic back to its own workers (acknowledges a rollback too)."""
    _canary_command(pool, "abort", reason)


@canary_app.command("status")
def canary_status(
    pool: Annotated[str | None, typer.Option(help="Only this pool.")] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing changes until Ctrl-C.")
    ] = False,
) -> None:
    """Each release's commands and steps, with their evidence, and where each stands."""
    show_events(f"pool:{pool or '*'}", "canary,traffic_split", follow)


def profile(
    worker: Annotated[str, typer.Option(help="The worker's instance id (seawall status).")],
    seconds: Annotated[float, typer.Option(min=0.1, max=600, help="How long to profile.")] = 10,
    reason: Reason = None,
) -> None:
    """Profile one worker's engine for a while and print where the trace is."""
    import asyncio

    from schemas import Profile
    from seawall import steer
    from services.common.settings import CommonSettings

    made: list[ControlEvent] = []

    def request(why: str, issuer: str, now: float) -> ControlEvent:
        made.append(
            steer.profile_request(worker, seconds=seconds, reason=why, issuer=issuer, now=now)
        )
        return made[0]

    publish(request, reason, "profile requested")
    asked = made[0]
    assert isinstance(asked, Profile)
    done = asyncio.run(steer.await_profile(CommonSettings(), asked, seconds + 60))
    if done is None:
        typer.echo(f"no answer from worker {worker} (is it running?)", err=True)
        raise typer.Exit(1)
    if done.status == "failed":
        typer.echo(f"worker {worker} could not profile: {done.evidence.reason}", err=True)
        raise typer.Exit(1)
    typer.echo(f"profile of {worker}: {done.path}")
