"""What-if replay: a recording's telemetry through the controller's core, with some
settings changed, and the decisions that would have differed.

The core is the live controller's own (``services.controller.decider.pool.PoolDecider``,
one per pool, with the ``DeciderConfig`` that ``ControllerSettings`` builds): replay
feeds each telemetry record at the time the broker stamped it, lets the decider react
as the live controller does after telemetry, and ticks every ``controller_tick_s``
between records. Nothing is random, so the same recording and settings give the same decisions.

``compare`` sets two decision timelines side by side (per control key, the state in
force over time) and lists where they part: when, which key, the state in one → in the
other, and the evidence of the decision that made the difference. Replayed with the
settings the controller ran with, the timeline follows the recorded live decisions
(``matches_live``: the same sequence of states per key; the times differ by the live
controller's scheduling).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from schemas import BatchLimit, BreakerState, ControlEvent, DegradationLevel, Evidence
from seawall.events import describe
from seawall.recording import Recording
from services.controller.decider.config import DeciderConfig
from services.controller.decider.pool import Output, PoolDecider

DECIDED_KINDS = (BreakerState, DegradationLevel, BatchLimit)
"""What the pool deciders decide (the canary, hotspot and operators' events are not)."""


@dataclass(frozen=True)
class Decided:
    t: float
    key: str
    state: str
    evidence: Evidence


@dataclass(frozen=True)
class Difference:
    t: float
    key: str
    before: str
    """The state in force in the first timeline (``-``: none yet)."""
    after: str
    evidence: Evidence
    """The evidence of the decision, in either timeline, that made them part."""


def _decided(t: float, event: ControlEvent) -> Decided:
    return Decided(t, event.control_key, describe(event), event.evidence)


def replay(recording: Recording, config: DeciderConfig, tick_s: float) -> list[Decided]:
    """Every decision (change, not re-publication) the deciders make on the recording."""
    deciders: dict[str, PoolDecider] = {}
    out: list[Decided] = []

    def collect(t: float, output: Output) -> None:
        out.extend(_decided(t, e) for e in output.changes)

    telemetry = list(recording.of("telemetry"))
    if not telemetry:
        return out
    next_tick = telemetry[0].t + tick_s
    for entry in telemetry:
        while next_tick <= entry.t:
            for decider in deciders.values():
                collect(next_tick, decider.tick(next_tick))
            next_tick += tick_s
        event = entry.value
        pool: str = getattr(event, "pool")  # noqa: B009  (every telemetry record names it)
        if pool not in deciders:
            deciders[pool] = PoolDecider(pool, config, entry.t)
        collect(entry.t, deciders[pool].observe(event, entry.t))  # type: ignore[arg-type]
        collect(entry.t, deciders[pool].react(entry.t))
    return out


def live_decisions(recording: Recording) -> list[Decided]:
    """The controller's recorded decisions of the kinds replay makes, republications
    left out (a key's state repeated)."""
    out: list[Decided] = []
    last: dict[str, str] = {}
    for entry in recording.of("control"):
        event = entry.value
        if not isinstance(event, DECIDED_KINDS) or event.issuer != "controller":
            continue
        state = describe(event)
        if last.get(event.control_key) != state:
            last[event.control_key] = state
            out.append(_decided(entry.t, event))
    return out


def sequences(decisions: Iterable[Decided]) -> dict[str, list[str]]:
    """Per key, its states in order (consecutive repetitions folded)."""
    out: defaultdict[str, list[str]] = defaultdict(list)
    for d in decisions:
        states = out[d.key]
        if not states or states[-1] != d.state:
            states.append(d.state)
    return dict(out)


def matches_live(replayed: Sequence[Decided], live: Sequence[Decided]) -> dict[str, bool]:
    """Per key the live controller decided: whether replay went through the same states."""
    mine, theirs = sequences(replayed), sequences(live)
    return {key: mine.get(key) == states for key, states in theirs.items()}


def compare(first: Sequence[Decided], second: Sequence[Decided]) -> list[Difference]:
    """Where the two timelines part, in time order: at each decision of either, per key,
    the states in force in both; a line each time that pair changes while they differ."""
    by_key: defaultdict[str, list[tuple[float, int, Decided]]] = defaultdict(list)
    for side, decisions in enumerate((first, second)):
        for d in decisions:
            by_key[d.key].append((d.t, side, d))
    out: list[Difference] = []
    for key, timeline in by_key.items():
        state = ["-", "-"]
        shown: tuple[str, str] | None = None
        timeline.sort(key=lambda item: (item[0], item[1]))
        for i, (t, side, d) in enumerate(timeline):
            state[side] = d.state
            if i + 1 < len(timeline) and timeline[i + 1][0] == t:
                continue  # both sides' decisions of one instant first
            pair = (state[0], state[1])
            if pair[0] != pair[1] and pair != shown:
                out.append(Difference(t, key, pair[0], pair[1], d.evidence))
            shown = pair if pair[0] != pair[1] else None
    return sorted(out, key=lambda d: (d.t, d.key))


def level(state: str) -> float:
    """A decision's state as a number, for plotting: a breaker's circuit (0 closed, 1
    half-open, 2 open), a ladder's level, a batch limit."""
    word = state.split()[0]
    circuits = {"closed": 0.0, "half_open": 1.0, "open": 2.0}
    if word in circuits:
        return circuits[word]
    return float(state.split()[1]) if word in ("level", "limit") else 0.0


def plot(
    first: Sequence[Decided],
    second: Sequence[Decided],
    keys: Sequence[str],
    labels: tuple[str, str],
    path: str,
    start: float,
) -> None:
    """Both timelines of ``keys`` as step plots, one panel per key (matplotlib, from the
    ``bench`` extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(keys), 1, figsize=(10, 2.2 * len(keys)), squeeze=False)
    end = max([d.t for d in (*first, *second)], default=start) + 1
    for ax, key in zip(axes[:, 0], keys, strict=True):
        for decisions, label, style in ((first, labels[0], "-"), (second, labels[1], "--")):
            points = [(d.t - start, level(d.state)) for d in decisions if d.key == key]
            if not points:
                continue
            xs = [x for x, _ in points] + [end - start]
            ys = [y for _, y in points] + [points[-1][1]]
            ax.step(xs, ys, style, where="post", label=label)
        ax.set_title(key, fontsize=9)
        ax.legend(fontsize=8, loc="upper left")
    axes[-1, 0].set_xlabel("seconds into the recording")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def overrides(pairs: Mapping[str, str], known: Mapping[str, object]) -> dict[str, str]:
    """Settings named as on the command line (``SEAWALL_`` and ``controller_`` may be
    left out) under their field names; an unknown one is a ``ValueError``."""
    out: dict[str, str] = {}
    for given, value in pairs.items():
        name = given.strip().lower().removeprefix("seawall_")
        if name not in known and f"controller_{name}" in known:
            name = f"controller_{name}"
        if name not in known:
            raise ValueError(f"no controller setting {given!r}")
        out[name] = value
    return out
