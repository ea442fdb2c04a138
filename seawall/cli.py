"""The ``seawall`` command line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from seawall import up as up_mod

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
    )
    raise typer.Exit(up_mod.run(options))


@app.command("export-schemas")
def export_schemas(
    check: Annotated[
        bool, typer.Option(help="Only check that the files match the models.")
    ] = False,
) -> None:
    """Write the JSON Schema of every wire message into schemas/json/."""
    from schemas.export import main as export_main

    raise typer.Exit(export_main(["--check"] if check else []))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
