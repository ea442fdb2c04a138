"""Record a run and replay it (``seawall record``, ``seawall replay``): a worker failing
most of its requests trips the breakers and the ladder on the real broker; the
recording holds the telemetry, the decisions and the request outcomes; replayed through
the controller's core with the same settings it goes through the same decisions, and
with a lower latency threshold the latency row trips too — and nothing else."""

from __future__ import annotations

import json
import time
from pathlib import Path

from seawall.recording import read_recording
from seawall.replay import compare, live_decisions, matches_live, replay
from seawall_client.topics import Topics
from services.common.settings import CommonSettings
from services.controller.settings import ControllerSettings
from tests.fleet import until
from tests.integration.controller.test_controller import (
    CONTROLLER,
    breaker_open_on,
    control_log,
    controller,
    load,
    worker,
)
from tests.integration.test_steer_cli import seawall as run_cli


def seawall(settings: CommonSettings, *args: str) -> str:
    """A seawall command with the controller's settings of these tests (as replay must
    run with the controller's)."""
    controller_env = {f"SEAWALL_{k.upper()}": str(v).lower() for k, v in CONTROLLER.items()}
    return run_cli(settings, *args, env=controller_env)


async def test_a_recorded_run_replays_to_the_same_decisions_and_differs_where_changed(
    settings: CommonSettings, topics: Topics, tmp_path: Path
) -> None:
    started = time.time()
    async with (
        control_log(settings, topics) as control,
        controller(settings),
        worker(settings, sim_error_rate=0.6),
    ):
        await load(settings, topics, 200)
        trips = breaker_open_on("error_rate")
        await until(lambda: control.first("breaker/pool:main", trips) is not None, 60)
    path = tmp_path / "run.jsonl"
    since = f"{int(time.time() - started) + 5}s"
    out = seawall(settings, "record", "--out", str(path), "--since", since)
    assert "telemetry" in out

    run = read_recording(path)
    kinds = {e.kind for e in run.entries}
    assert kinds == {"telemetry", "control", "completion"}
    completions = [e.value for e in run.of("completion")]
    assert any(getattr(c, "error", None) for c in completions)  # the outcomes, failures too
    assert "tell me about item" not in path.read_text()  # no prompt is recorded
    assert json.loads(path.read_text().splitlines()[-1])["end"] is True

    config = ControllerSettings(**{**settings.model_dump(), **CONTROLLER})
    live = live_decisions(run)
    assert any(d.key == "breaker/pool:main" and d.state.startswith("open") for d in live)
    same = replay(run, config.decider_config(), config.controller_tick_s)
    assert same == replay(run, config.decider_config(), config.controller_tick_s)  # determinism
    reproduced = matches_live(same, live)
    assert reproduced["breaker/pool:main"]
    assert reproduced["breaker/worker:w1"]
    assert compare(same, same) == []

    lower = config.model_copy(
        update={"controller_latency_trip_ms": 5.0, "controller_latency_recover_ms": 2.0}
    )
    changed = replay(run, lower.decider_config(), lower.controller_tick_s)
    differences = compare(same, changed)
    assert differences
    assert {d.key.split("/")[0] for d in differences} <= {"breaker", "degradation", "batch_limit"}
    assert any("latency" in d.after for d in differences if d.key.startswith("breaker/"))

    text = seawall(
        settings,
        "replay",
        str(path),
        "--set",
        "latency_trip_ms=5",
        "--set",
        "latency_recover_ms=2",
        "--plot",
        str(tmp_path / "p.png"),
    )
    assert "latency" in text
    assert "went through the same states" in text
    assert (tmp_path / "p.png").stat().st_size > 1000

    report_dir = tmp_path / "report"
    out = seawall(settings, "report", str(path), "--out", str(report_dir), "--window", "2")
    assert "report.md" in out
    text = (report_dir / "report.md").read_text()
    for section in (
        "## Summary",
        "### SLO attainment and goodput per class",
        "### The first minute after each breaker trip",
        "### Degradation coverage",
        "### Correlation of each signal with P99 latency",
        "## Latency by class, with the decisions",
        "## Preempted/running ratio against latency",
        "## Token rates",
        "## Head-of-line blocking index",
        "## Which signals moved with latency",
    ):
        assert section in text, section
    for plot in ("latency", "preemption", "tokens", "hol", "correlation"):
        assert (report_dir / f"{plot}.png").stat().st_size > 5000
    # the numbers are the recording's: every request, the failed ones, the trips
    failed = sum(1 for c in completions if getattr(c, "error", None))
    assert f"| requests finished | {len(completions)} ({failed} failed) |" in text
    assert "| breaker trips | 0 |" not in text
    assert "requests per kWh" in text
    assert "(simulated GPU power)" in text  # the simulated engine's power, labelled
