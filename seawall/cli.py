"""The ``seawall`` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from seawall import up as up_mod
from seawall.cli_options import pairs, show_events
from seawall.incident_cli import record, replay, report
from seawall.keys import keys_app
from seawall.load.profiles import Profile
from seawall.steer_cli import canary_app, profile, quota_app, region_app

if TYPE_CHECKING:
    pass

app = typer.Typer(
    no_args_is_help=True,
    add_completion=False,
    help="seawall: keep vLLM fleets stable under bursts.",
)


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
        canary_settings |= pairs(canary_env, "--canary-env", "NAME=VALUE")
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
    scheduling_policy: Annotated[
        str,
        typer.Option(
            help="vllm serve's --scheduling-policy: fcfs (its default) refuses requests "
            "with a non-zero priority; priority runs lower values first."
        ),
    ] = "fcfs",
) -> None:
    """Serve the simulated engine as an OpenAI-compatible server with vLLM's metric names.

    A stand-in for `vllm serve` on machines without a GPU. The engine is configured like a
    worker's (SEAWALL_ENGINE_*, SEAWALL_SIM_*: model and GPU profile, limits, faults).
    """
    import uvicorn

    from seawall.sim_serve import create_app
    from services.workers.engine.factory import build_engine
    from services.workers.settings import WorkerSettings

    if scheduling_policy not in ("fcfs", "priority"):
        raise typer.BadParameter("fcfs or priority", param_hint="--scheduling-policy")
    policy: Literal["fcfs", "priority"] = "priority" if scheduling_policy == "priority" else "fcfs"
    settings = WorkerSettings(engine="sim", engine_scheduling_policy=policy)
    uvicorn.run(
        create_app(build_engine(settings), model_name, policy),
        host=host,
        port=port,
        log_level="info",
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
    show_events(scope, kind, follow)


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
def trace(
    request_id: Annotated[str, typer.Argument(help="A request id (X-Request-Id) or a trace id.")],
    trace_dir: Annotated[
        Path | None,
        typer.Option(
            envvar="SEAWALL_TRACE_DIR",
            help="Where the services write their spans (seawall up: .seawall/traces).",
        ),
    ] = None,
) -> None:
    """Print one request's waterfall: every stage it went through, from ingress to the
    worker and back, read from the spans the services wrote (no tracing backend)."""
    from seawall.traces import traces_of, waterfall
    from services.common.settings import CommonSettings

    configured = CommonSettings().trace_dir  # the environment, then .seawall/stack.env
    directory = trace_dir or (Path(configured) if configured else None)
    if directory is None or not directory.is_dir():
        typer.echo(
            "no trace directory: start the stack with seawall up (it writes .seawall/traces) "
            "or set SEAWALL_TRACE_DIR / --trace-dir",
            err=True,
        )
        raise typer.Exit(2)
    found = traces_of(directory, request_id)
    if not found:
        typer.echo(f"no spans of {request_id!r} in {directory}", err=True)
        raise typer.Exit(1)
    for trace_id, spans in found.items():
        typer.echo(f"trace {trace_id}")
        for line in waterfall(spans):
            typer.echo(line)


@app.command("export-schemas")
def export_schemas(
    check: Annotated[
        bool, typer.Option(help="Only check that the files match the models.")
    ] = False,
) -> None:
    """Write the JSON Schema of every wire message into schemas/json/."""
    from schemas.export import main as export_main

    raise typer.Exit(export_main(["--check"] if check else []))


@app.command("control-keys")
def control_keys(
    keys_dir: Annotated[Path, typer.Argument(help="Where the keys go (made owner-only).")],
    operator: Annotated[
        str | None,
        typer.Option(help="The operator key's name (default: this login)."),
    ] = None,
) -> None:
    """Make the control topic's signing keys where missing: the controller's, the
    workers' and an operator's, with trusted.pub (services.common.control_signing).
    Mount trusted.pub in every service and each private key only where its role runs;
    point SEAWALL_CONTROL_KEYS_DIR at the directory."""
    from seawall.steer import operator as operator_principal
    from services.common.control_signing import TRUSTED_FILE, ensure_keys

    ensure_keys(keys_dir, operator_principal(operator))
    typer.echo((keys_dir / TRUSTED_FILE).read_text(), nl=False)


@app.command("redis-acl")
def redis_acl(
    directory: Annotated[Path, typer.Argument(help="Where the ACL file and passwords go.")],
    prefix: Annotated[
        str, typer.Option(help="The services' SEAWALL_REDIS_PREFIX: their keys' prefix.")
    ] = "seawall:",
) -> None:
    """Make Redis ACL users for a shared Redis (seawall.redis_acl): 'default' off,
    'seawall' for the services (keys and channels under the prefix only, no admin or
    dangerous commands) and 'admin'. Passwords are made where missing; start Redis with
    --aclfile DIR/users.acl and give the services SEAWALL_REDIS_USERNAME=seawall and
    SEAWALL_REDIS_PASSWORD_FILE=DIR/seawall.password."""
    from seawall.redis_acl import write_acl

    typer.echo(write_acl(directory, prefix))


@app.command("kafka-secrets")
def kafka_secrets(
    directory: Annotated[Path, typer.Argument(help="Where the files go (owner-only).")],
    prefix: Annotated[
        str, typer.Option(help="The services' SEAWALL_TOPIC_PREFIX: their topics' prefix.")
    ] = "",
    host: Annotated[
        list[str] | None,
        typer.Option(help="A name the broker answers to (repeat); first: its advertised one."),
    ] = None,
) -> None:
    """Make what an Apache Kafka broker needs to admit only seawall's principals over
    TLS, each with the ACLs of its role (seawall.kafka_secrets): a password per
    principal (seawall-ingress, -admission, -workers, -controller, -operator, admin), a
    CA and the broker's certificate, server.properties (SASL_SSL, SCRAM-SHA-512,
    StandardAuthorizer), start-kafka.sh, admin.properties and acls.sh. Passwords and
    the CA are made where missing. compose/ mounts them (deploy/README.md)."""
    from seawall.kafka_secrets import DEFAULT_HOSTS, write_kafka_secrets

    write_kafka_secrets(directory, prefix, tuple(host) if host else DEFAULT_HOSTS)
    typer.echo(directory)


app.add_typer(keys_app, name="keys", help="Create, list, rotate and revoke API keys.")
app.add_typer(quota_app, name="quota", help="Change a tenant's quota while the fleet runs.")
app.add_typer(region_app, name="region", help="Throttle a client region while the fleet runs.")
app.add_typer(
    canary_app, name="canary", help="Release a pool's new version step by step, or roll it back."
)
app.command()(profile)
app.command()(record)
app.command()(replay)
app.command()(report)


def main() -> None:
    from services.common.control_signing import ControlKeysMissing

    try:
        app()
    except ControlKeysMissing as e:  # a command that reads or issues control events
        typer.echo(str(e), err=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
