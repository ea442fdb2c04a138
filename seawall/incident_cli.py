"""``seawall record``, ``seawall replay`` and ``seawall report``: an incident kept as a
recording, replayed through the controller's core with changed settings, and written up."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from seawall.cli_options import pairs

if TYPE_CHECKING:
    from seawall.recording import Recording


def _recording(path: Path) -> Recording:
    from seawall.recording import read_recording

    try:
        return read_recording(path)
    except (OSError, ValueError) as e:
        typer.echo(f"cannot read the recording: {e}", err=True)
        raise typer.Exit(1) from None


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
        changes = rp.overrides(pairs(set_, "--set", "NAME=VALUE"), ControllerSettings.model_fields)
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
        slo_ms = {cls: float(ms) for cls, ms in pairs(slo, "--slo", "CLASS=MS").items()}
    except ValueError:
        raise typer.BadParameter(f"--slo takes CLASS=MS, got {slo}") from None
    path = write_report(analyse(_recording(recording), window, slo_ms), out)
    typer.echo(f"report: {path}")
