"""The ``seawall`` command line."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from seawall import up as up_mod
from seawall.keys import keys_app
from seawall.load.profiles import Profile

if TYPE_CHECKING:
    from schemas import ControlEvent
    from seawall.recording import Recording

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="seawall: keep vLLM fleets stable under bursts.",
)


def _recording(path: Path) -> Recording:
    from seawall.recording import read_recording

    try:
        return read_recording(path)
    except (OSError, ValueError) as e:
        typer.echo(f"cannot read the recording: {e}", err=True)
        raise typer.Exit(1) from None


def _pairs(items: list[str] | None, option: str, shape: str) -> dict[str, str]:
    """A repeatable ``KEY=VALUE`` option as a dict; a malformed item is a usage error."""
    out: dict[str, str] = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise typer.BadParameter(f"{option} takes {shape}, got {item!r}")
        out[key.strip()] = value
    return out


@app.command()
def up(
    broker_port: Annotated[
        int, typer.Option(envvar="SEAWALL_BROKER_PORT", help="Port of the embedded broker.")
    ] = 9092,
    redis: Annotated[
        str,
        typer.Option(
            envvar="SEAWALL_REDIS_URL",
            help="'auto': a Redis on 127.0.0.1:<redis-port> if one answers, else a private one; "
            "'embedded': always a private one; or a redis:// URL.",
        ),
    ] = "auto",
    redis_port: Annotated[int, typer.Option(help="Port for the local or private Redis.")] = 6379,
    topic_prefix: Annotated[str, typer.Option(envvar="SEAWALL_TOPIC_PREFIX")] = "",
    partitions: Annotated[int, typer.Option(envvar="SEAWALL_TOPIC_PARTITIONS", min=1)] = 3,
    state_dir: Annotated[Path, typer.Option(help="Where logs and the private Redis live.")] = Path(
        ".seawall"
    ),
    workers: Annotated[int, typer.Option(min=0, help="Simulated workers in the main pool.")] = 2,
    small_workers: Annotated[
        int, typer.Option(min=0, help="Simulated workers in the small pool.")
    ] = 1,
    enterprise_workers: Annotated[
        int,
        typer.Option(
            min=0,
            help="Simulated workers of the enterprise tier's dedicated pool (the main "
            "pool's model); 0: enterprise shares the main pool.",
        ),
    ] = 1,
    ingress_port: Annotated[
        int, typer.Option(envvar="SEAWALL_INGRESS_PORT", help="Port of the OpenAI-compatible API.")
    ] = 8080,
    canary: Annotated[
        str | None,
        typer.Option(
            help="Also start workers of this canary version of the main pool "
            "(then: seawall canary start --pool main --version <it>)."
        ),
    ] = None,
    canary_workers: Annotated[int, typer.Option(min=0, help="How many (with --canary).")] = 1,
    canary_env: Annotated[
        list[str] | None,
        typer.Option(
            help="A setting of the canary's workers only, NAME=VALUE (repeatable), e.g. "
            "SEAWALL_SIM_ERROR_RATE=0.3 for a version that fails."
        ),
    ] = None,
) -> None:
    """Start the stack on embedded defaults (broker, Redis, services) until Ctrl-C."""
    canary_settings: dict[str, str] | None = None
    if canary is not None:
        canary_settings = {"SEAWALL_CANARY_VERSION": canary}
        canary_settings |= _pairs(canary_env, "--canary-env", "NAME=VALUE")
    options = up_mod.UpOptions(
        kafka_bootstrap=os.environ.get("SEAWALL_KAFKA_BOOTSTRAP") or None,
        broker_port=broker_port,
        redis=redis,
        redis_port=redis_port,
        topic_prefix=topic_prefix,
        partitions=partitions,
        state_dir=state_dir,
        services=up_mod.default_services(
            workers,
            small_workers,
            ingress_port,
            canary_settings,
            canary_workers,
            enterprise_workers,
        ),
        env=up_mod.fleet_env(enterprise_workers),
    )
    raise typer.Exit(up_mod.run(options))


@app.command("sim-serve")
def sim_serve(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Port to listen on.")] = 8000,
    model_name: Annotated[
        str, typer.Option(help="The model name the server answers as.")
    ] = "sim-llama-2-7b",
) -> None:
    """Serve the simulated engine as an OpenAI-compatible server with vLLM's metric names.

    A stand-in for `vllm serve` on machines without a GPU. The engine is configured like a
    worker's (SEAWALL_ENGINE_*, SEAWALL_SIM_*: model and GPU profile, limits, faults).
    """
    import uvicorn

    from seawall.sim_serve import create_app
    from services.workers.engine.factory import build_engine
    from services.workers.settings import WorkerSettings

    settings = WorkerSettings(engine="sim")
    uvicorn.run(
        create_app(build_engine(settings), model_name), host=host, port=port, log_level="info"
    )


@app.command()
def alerts(
    all_: Annotated[
        bool, typer.Option("--all", help="Also list the alerts that resolved.")
    ] = False,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing alerts until Ctrl-C.")
    ] = False,
) -> None:
    """Show the controller's alerts as they fired and resolved, then those active."""
    from rich.console import Console

    from seawall.alerts import run_alerts
    from services.common.settings import CommonSettings

    raise typer.Exit(run_alerts(CommonSettings(), all_, follow, Console()))


@app.command()
def events(
    scope: Annotated[
        str | None, typer.Option(help="Only this scope; a glob such as 'worker:*' or 'pool:main'.")
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option(
            help="Only this kind (or these, separated by commas): breaker, degradation, "
            "batch_limit, traffic_split, canary, region_throttle, quota_override."
        ),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing new decisions until Ctrl-C.")
    ] = False,
) -> None:
    """Show the controller's decisions with their evidence, then the decisions in force."""
    from rich.console import Console

    from seawall.events import run_events
    from services.common.settings import CommonSettings

    raise typer.Exit(run_events(CommonSettings(), scope, kind, follow, Console()))


@app.command()
def submit(
    prompt: Annotated[str | None, typer.Argument(help="The prompt.")] = None,
    key: Annotated[
        str | None,
        typer.Option(
            envvar="SEAWALL_API_KEY",
            help="The API key as `seawall keys create` printed it; the request is signed "
            "with it, only its id and the signature are sent.",
        ),
    ] = None,
    max_tokens: Annotated[int, typer.Option(min=1, max=32_768)] = 256,
    system: Annotated[
        str | None, typer.Option(help="A system prompt (sends chat messages).")
    ] = None,
    messages_json: Annotated[
        str | None,
        typer.Option(help='Chat messages as JSON, e.g. \'[{"role": "user", "content": "hi"}]\'.'),
    ] = None,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds to wait for the reply, retries included.")
    ] = 60.0,
    no_stream: Annotated[
        bool, typer.Option("--no-stream", help="Wait for the whole reply.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the terminal reply as JSON, not its text.")
    ] = False,
) -> None:
    """Send one request; print its tokens as they arrive, then a summary line (on
    standard error). Exits 1 unless the reply is ok or degraded."""
    import sys

    from seawall import submit as submit_mod
    from services.common.settings import CommonSettings

    try:
        checked_key = submit_mod.check_key(key)
        text, messages = submit_mod.request_input(prompt, system, messages_json)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    code = submit_mod.run(
        CommonSettings(),
        checked_key,
        text,
        messages,
        max_tokens=max_tokens,
        timeout_s=timeout,
        stream=not no_stream,
        as_json=as_json,
        stdout=sys.stdout,
        stderr=sys.stderr,
    )
    raise typer.Exit(code)


@app.command()
def load(
    profile: Annotated[
        Profile,
        typer.Option(help="steady: --rate throughout; burst: ×--burst-multiplier mid-run."),
    ] = "steady",
    duration: Annotated[float, typer.Option(min=0.1, help="Seconds of arrivals.")] = 60.0,
    rate: Annotated[
        float, typer.Option(min=0.001, help="Requests per second (Poisson); burst's base rate.")
    ] = 5.0,
    burst_multiplier: Annotated[
        float, typer.Option(min=1.0, help="The burst profile's rate in its middle third.")
    ] = 5.0,
    tenants: Annotated[int, typer.Option(min=1, help="Synthetic tenants, one key each.")] = 6,
    tier_mix: Annotated[
        str, typer.Option(help="How the tenants spread over the tiers (weights).")
    ] = "basic=0.5,pro=0.3,enterprise=0.2",
    tenant_prefix: Annotated[
        str, typer.Option(help="Tenants are <prefix>-<tier>-<n>, reused across runs.")
    ] = "load",
    long_fraction: Annotated[
        float, typer.Option(min=0.0, max=1.0, help="Share of long (512-2048 word) prompts.")
    ] = 0.2,
    max_tokens: Annotated[int, typer.Option(min=1, max=32_768)] = 64,
    temperature: Annotated[
        float,
        typer.Option(
            min=0.0, max=2.0, help="Sampling temperature (0: greedy, what shadow runs sample)."
        ),
    ] = 1.0,
    timeout: Annotated[
        float, typer.Option(min=0.1, help="Seconds per request, retries included.")
    ] = 30.0,
    drain: Annotated[
        float, typer.Option(min=0.0, help="Seconds to wait for replies after the last send.")
    ] = 30.0,
    max_attempts: Annotated[int, typer.Option(min=1, help="1 turns the SDK's retries off.")] = 4,
    seed: Annotated[int, typer.Option(help="Seeds arrivals, prompts and tenant picks.")] = 0,
    out: Annotated[Path | None, typer.Option(help="Write the results here as JSON.")] = None,
) -> None:
    """Open-loop load: Poisson arrivals from synthetic tenants of every tier, streamed
    through one SDK client per tenant; a live view, then TTFT and latency per class.

    The burst profile runs at --rate in its first and last thirds and at
    --burst-multiplier × --rate in the middle third."""
    from rich.console import Console

    from seawall.load import profiles
    from seawall.load.run import LoadConfig
    from seawall.load.run import main as load_main
    from services.ingress.settings import IngressSettings

    try:
        config = LoadConfig(
            profile=profile,
            duration_s=duration,
            rate=rate,
            burst_multiplier=burst_multiplier,
            seed=seed,
            tenants=tenants,
            tier_mix=profiles.parse_mix(tier_mix),
            tenant_prefix=tenant_prefix,
            prompts=profiles.PromptMix(long_fraction=long_fraction),
            max_tokens=max_tokens,
            temperature=temperature,
            timeout_s=timeout,
            drain_s=drain,
            max_attempts=max_attempts,
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    raise typer.Exit(load_main(config, IngressSettings(), out, Console()))


@app.command()
def status(
    window: Annotated[
        float, typer.Option(min=1, help="How far back telemetry is read, in seconds.")
    ] = 30.0,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON document instead of tables.")
    ] = False,
    timeout: Annotated[
        float, typer.Option(min=1, help="Give up if the broker has not answered by then (s).")
    ] = 10.0,
) -> None:
    """Show the fleet: workers and pools, the breakers, degradation levels and batch
    limits in force, consumer-group lags and the age of the control state."""
    from rich.console import Console

    from seawall.status import run_status
    from services.common.settings import CommonSettings

    raise typer.Exit(run_status(CommonSettings(), window, as_json, timeout, Console()))


@app.command()
def record(
    out: Annotated[Path, typer.Option(help="The recording to write (JSON lines).")],
    since: Annotated[
        str, typer.Option(help="How far back it starts: 300, 30s, 15m, 2h (at most a day).")
    ] = "15m",
    max_mb: Annotated[float, typer.Option(min=0.001, help="Stop past this size.")] = 256.0,
) -> None:
    """Record the telemetry, control decisions and request outcomes of the last --since
    (for seawall replay)."""
    import asyncio
    import time

    from aiokafka.errors import KafkaError

    from seawall import steer
    from seawall.recording import record as record_run
    from services.common.settings import CommonSettings

    try:
        back_s = steer.duration_s(since)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    now = time.time()
    try:
        with out.open("w", encoding="utf-8") as f:
            summary = asyncio.run(
                record_run(
                    CommonSettings(),
                    f,
                    since=now - back_s,
                    until=now,
                    max_bytes=int(max_mb * 1024 * 1024),
                )
            )
    except (OSError, TimeoutError, KafkaError) as e:
        typer.echo(f"could not record: {e}", err=True)
        raise typer.Exit(1) from None
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(summary.records.items()))
    typer.echo(f"{out}: {counts or 'nothing'} ({summary.bytes / 1024:.0f} KiB)")
    if summary.truncated:
        typer.echo(f"truncated at --max-mb {max_mb:g}: the range is not complete", err=True)
    if summary.skipped:
        typer.echo(f"skipped records that do not decode: {dict(summary.skipped)}", err=True)


@app.command()
def replay(
    recording: Annotated[Path, typer.Argument(help="A file of seawall record.")],
    set_: Annotated[
        list[str] | None,
        typer.Option(
            "--set",
            help="A controller setting to change, NAME=VALUE (repeatable), e.g. "
            "latency_trip_ms=1500; the others are the environment's, as the controller's.",
        ),
    ] = None,
    plot: Annotated[
        Path | None, typer.Option(help="Also draw both decision timelines into this PNG.")
    ] = None,
) -> None:
    """Replay a recording's telemetry through the controller's core with changed
    settings, and print the decisions that would have differed."""
    from seawall import replay as rp
    from services.controller.settings import ControllerSettings

    run = _recording(recording)
    base = ControllerSettings()
    try:
        changes = rp.overrides(_pairs(set_, "--set", "NAME=VALUE"), ControllerSettings.model_fields)
        changed = ControllerSettings.model_validate({**base.model_dump(), **changes})
        config = changed.decider_config()
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    before = rp.replay(run, base.decider_config(), base.controller_tick_s)
    after = rp.replay(run, config, changed.controller_tick_s)
    live = rp.live_decisions(run)
    same = rp.matches_live(before, live)
    what = " ".join(set_ or []) or "no change"
    typer.echo(
        f"replayed {sum(1 for _ in run.of('telemetry'))} telemetry records: "
        f"{len(before)} decisions as recorded, {len(after)} with {what}"
    )
    if live:
        typer.echo(
            f"the live controller's decisions: {sum(same.values())} of {len(same)} keys "
            "went through the same states in the replay"
        )
    start = float(run.header["since"])
    differences = rp.compare(before, after)
    for d in differences:
        typer.echo(f"{d.t - start:8.1f}s  {d.key}: {d.before} -> {d.after}  ({d.evidence.reason})")
    if not differences:
        typer.echo("no decision would have differed")
    if plot is not None:
        keys = sorted({d.key for d in differences}) or sorted({d.key for d in before})[:6]
        if keys:
            rp.plot(before, after, keys, ("as recorded", "changed"), str(plot), start)
            typer.echo(f"plot: {plot}")


@app.command()
def report(
    recording: Annotated[Path, typer.Argument(help="A file of seawall record.")],
    out: Annotated[Path, typer.Option(help="The directory for report.md and its plots.")],
    window: Annotated[float, typer.Option(min=1, help="Seconds per window.")] = 10.0,
    slo: Annotated[
        list[str] | None,
        typer.Option(help="A class's latency SLO in ms, CLASS=MS (repeatable), e.g. vip=1500."),
    ] = None,
) -> None:
    """Write the post-incident report of a recording: a summary, then the plots."""
    from seawall.report import analyse, write_report

    try:
        slo_ms = {cls: float(ms) for cls, ms in _pairs(slo, "--slo", "CLASS=MS").items()}
    except ValueError:
        raise typer.BadParameter(f"--slo takes CLASS=MS, got {slo}") from None
    path = write_report(analyse(_recording(recording), window, slo_ms), out)
    typer.echo(f"report: {path}")


@app.command()
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

    _steer(request, reason, "profile requested")
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


@app.command("export-schemas")
def export_schemas(
    check: Annotated[
        bool, typer.Option(help="Only check that the files match the models.")
    ] = False,
) -> None:
    """Write the JSON Schema of every wire message into schemas/json/."""
    from schemas.export import main as export_main

    raise typer.Exit(export_main(["--check"] if check else []))


app.add_typer(keys_app, name="keys", help="Create, list, rotate and revoke API keys.")

quota_app = typer.Typer(no_args_is_help=True, add_completion=False)
region_app = typer.Typer(no_args_is_help=True, add_completion=False)
app.add_typer(quota_app, name="quota", help="Change a tenant's quota while the fleet runs.")
app.add_typer(region_app, name="region", help="Throttle a client region while the fleet runs.")
canary_app = typer.Typer(no_args_is_help=True, add_completion=False)
app.add_typer(
    canary_app, name="canary", help="Release a pool's new version step by step, or roll it back."
)

Reason = Annotated[str | None, typer.Option(help="Why (shown with the event).")]
Ttl = Annotated[
    float, typer.Option(min=1, max=86_400, help="How long it holds, in seconds (at most a day).")
]


def _steer(
    event_of: Callable[[str, str, float], ControlEvent], reason: str | None, what: str
) -> None:
    """Build the event (``event_of(reason, issuer, now)``: issued by this operator, at
    this time) and publish it."""
    import asyncio
    import time

    from aiokafka.errors import KafkaError

    from seawall import steer
    from seawall.events import describe
    from services.common.settings import CommonSettings

    issuer = steer.operator()
    try:
        event = event_of(reason or f"{what} by {issuer}", issuer, time.time())
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    try:
        asyncio.run(steer.publish(CommonSettings(), event))
    except (OSError, TimeoutError, KafkaError) as e:
        typer.echo(f"could not publish to the control topic: {e}", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"{event.control_key}: {describe(event)} (issuer {issuer}, seq {event.seq})")


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

    _steer(
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

    _steer(
        lambda why, issuer, now: steer.quota_clear(tenant, reason=why, issuer=issuer, now=now),
        reason,
        "quota cleared",
    )


@quota_app.command("list")
def quota_list() -> None:
    """The quota overrides on the control topic, with who issued them and why."""
    events(scope="tenant:*", kind="quota_override", follow=False)


@region_app.command("throttle")
def region_throttle(
    region: Annotated[str, typer.Option(help="The region (ingress's region table).")],
    rps: Annotated[float, typer.Option(min=0, help="Requests per second (0 suspends).")],
    ttl: Ttl = 3_600.0,
    reason: Reason = None,
) -> None:
    """Throttle the requests from a region at every admission replica."""
    from seawall import steer

    _steer(
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

    _steer(
        lambda why, issuer, now: steer.region_throttle(
            region, rate_per_s=None, ttl_s=3_600.0, reason=why, issuer=issuer, now=now
        ),
        reason,
        "region throttle lifted",
    )


@region_app.command("list")
def region_list() -> None:
    """The region throttles on the control topic, with who issued them and why."""
    events(scope="region:*", kind="region_throttle", follow=False)


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
    _steer(release, reason, "canary started")


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
    _steer(
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
    events(scope=f"pool:{pool or '*'}", kind="canary,traffic_split", follow=follow)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
