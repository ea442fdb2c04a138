"""The scaling benchmark's figure: lag, reaction and throughput against workers; quota
decisions and Redis memory against tenants."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _scaling_admission import INTAKE_BATCH
from _scaling_controller import SCALES


def _dress(
    ax: Any, xlabel: str, ylabel: str, title: str, *, log_x: bool = True, log_y: bool = True
) -> None:
    """Scales, labels, grid and legend, as every panel has them."""
    if log_x:
        ax.set_xscale("log")
    if log_y:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _lag_panel(ax: Any, phases: list[dict[str, Any]], key: str, title: str) -> None:
    styles = {0: ":", 1: "-", 2: "--"}
    colours = dict(zip(SCALES, ("tab:green", "tab:blue", "tab:red"), strict=False))
    for phase in phases:
        points = [(s["t"], s[key]) for s in phase["samples"] if key in s]
        if points:
            ax.plot(
                [p[0] for p in points],
                [max(1.0, p[1]) for p in points],
                styles.get(phase["controllers"], "-"),
                color=colours.get(phase["workers"], "black"),
                label=phase["label"],
            )
    _dress(ax, "seconds since the load began", "records (log)", title, log_x=False)


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(17, 9.5))
    phases_1 = doc["controller"]["phases"]
    _lag_panel(axes[0][0], phases_1, "lag", "Consumer lag on the telemetry topic (route)")
    _lag_panel(
        axes[0][1],
        [p for p in phases_1 if p["controllers"]],
        "lag_internal",
        "Consumer lag on the controller's internal topic (decide)",
    )

    ax = axes[0][2]
    figures = doc["controller"]["figures"]
    for controllers, style in ((1, "o-"), (2, "s--")):
        rows = [f for f in figures if f["controllers"] == controllers]
        xs = [f["workers"] for f in rows if f["reaction_ms"]["p50"] is not None]
        ys = [f["reaction_ms"]["p50"] for f in rows if f["reaction_ms"]["p50"] is not None]
        ax.plot(xs, ys, style, label=f"reaction p50, {controllers} controller(s)")
        missed = [f for f in rows if f["missed"]]
        ax.plot(
            [f["workers"] for f in missed],
            [f["missed_waited_ms_min"] for f in missed],
            "x" if controllers == 1 else "+",
            color="red",
            markersize=11,
            label=f"missed, {controllers} controller(s): waited at least",
        )
    base = [f for f in figures if f["controllers"] == 0 and f["ping_ms"]["p50"] is not None]
    ax.plot(
        [f["workers"] for f in base],
        [f["ping_ms"]["p50"] for f in base],
        "k:",
        label="baseline: broker round trip p50",
    )
    _dress(ax, "workers", "ms (log)", "Hot GPU sample → DegradationLevel 3 on the control topic")

    ax = axes[1][0]
    bare = [f for f in figures if f["controllers"] == 0]
    ax.plot([f["workers"] for f in bare], [f["offered_per_s"] for f in bare], "k:", label="offered")
    ax.plot(
        [f["workers"] for f in bare],
        [f["sent_per_s"] for f in bare],
        "ko-",
        label="sent, bare consumer (baseline)",
    )
    for controllers, style in ((1, "o-"), (2, "s--")):
        rows = [f for f in figures if f["controllers"] == controllers]
        xs = [f["workers"] for f in rows]
        ax.plot(xs, [f["sent_per_s"] for f in rows], style, label=f"sent, {controllers} ctl")
        ax.plot(
            xs,
            [f["processed_per_s"] or 0.0 for f in rows],
            style,
            label=f"decided, {controllers} ctl",
        )
    _dress(ax, "workers", "telemetry records per second (log)", "Telemetry sent and decided")

    phases = doc["admission"]["phases"]
    tenants = [p["tenants"] for p in phases]
    ax = axes[1][1]
    ax.plot(tenants, [p["decisions_per_s"] for p in phases], "o-", label="quota decisions/s")
    ax.axhline(
        doc["admission"]["trivial_evalsha_per_s"],
        color="grey",
        linestyle=":",
        label="baseline: trivial EVALSHA, same rounds",
    )
    title = f"Admission's quota path (pipelined rounds of {INTAKE_BATCH})"
    _dress(ax, "tenants", "decisions per second", title, log_y=False)
    ax.set_ylim(bottom=0)

    ax = axes[1][2]
    series = (
        ("ingress_records_delta_bytes", "o-", "used_memory delta: ingress records"),
        ("used_memory_delta_bytes", "^:", "used_memory delta after the decisions"),
        ("all_alive_bytes", "s--", "MEMORY USAGE per tenant × tenants, every bucket alive"),
    )
    for key, style, label in series:
        # The Redis is shared: a small delta can come out negative (left out on a log axis).
        points = [(p["tenants"], p[key] / 2**20) for p in phases if p[key] > 0]
        ax.plot([x for x, _ in points], [y for _, y in points], style, label=label)
    _dress(ax, "tenants", "MiB (log)", "Redis memory of the tenants' keys")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
