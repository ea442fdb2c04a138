"""The ``seawall`` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from seawall import up as up_mod
from services.ingress.keys_cli import keys_app

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
    ingress_port: Annotated[
        int, typer.Option(envvar="SEAWALL_INGRESS_PORT", help="Port of the OpenAI-compatible API.")
    ] = 8080,
) -> None:
    """Start the stack on embedded defaults (broker, Redis, services) until Ctrl-C."""
    options = up_mod.UpOptions(
        kafka_bootstrap=os.environ.get("SEAWALL_KAFKA_BOOTSTRAP") or None,
        broker_port=broker_port,
        redis=redis,
        redis_port=redis_port,
        topic_prefix=topic_prefix,
        partitions=partitions,
        state_dir=state_dir,
        services=up_mod.default_services(workers, small_workers, ingress_port),
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

    from services.workers.engine.factory import build_engine
    from services.workers.settings import WorkerSettings
    from services.workers.sim_serve import create_app

    settings = WorkerSettings(engine="sim")
    uvicorn.run(
        create_app(build_engine(settings), model_name), host=host, port=port, log_level="info"
    )


@app.command()
def events(
    scope: Annotated[
        str | None, typer.Option(help="Only this scope; a glob such as 'worker:*' or 'pool:main'.")
    ] = None,
    kind: Annotated[
        str | None,
        typer.Option(
            help="Only this kind: breaker, degradation, batch_limit, traffic_split, "
            "region_throttle, quota_override."
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


def main() -> None:
    app()


if __name__ == "__main__":
    main()
