"""The timeline picture of a job: ranks' committed steps over time, with every fault.

One figure, two rows sharing the time axis (seconds since the agent started):

* top: one line per rank, its committed steps (the regroup leader's ``progress`` events),
  a shaded band per fault from when it happened to when training progressed again, a
  marker at its detection, and a marker where a replacement or spare joined;
* bottom: the world size (member epochs; job generations for restarts).

Each fault is one named trace (``fault N: rank R cause``) so that it is in the legend, in
the HTML's figure data and in the PNG's metadata: a reader (or a test) can check that every
fault is drawn. HTML is drawn with plotly (self-contained: it opens without a network),
PNG with matplotlib (headless ``Agg``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftrun.observe.faults import FaultBook, FaultRecord


class PictureError(ValueError):
    """The picture cannot be written (unknown suffix, unwritable path); one line."""


@dataclass
class Timeline:
    """What the picture shows, in seconds since ``origin``."""

    origin: float
    ranks: dict[int, list[tuple[float, int]]] = field(default_factory=dict)  # rank -> steps
    world: list[tuple[float, int]] = field(default_factory=list)
    faults: list[FaultRecord] = field(default_factory=list)
    end: float | None = None

    def t(self, ts: float) -> float:
        return round(ts - self.origin, 3)


def fault_name(fault: FaultRecord) -> str:
    return f"fault {fault.index}: {fault.who} {fault.cause}"


def build(events: list[dict[str, Any]], book: FaultBook) -> Timeline:
    """The timeline of a replayed event log (``book`` has seen ``events``)."""
    origin = book.started if book.started is not None else 0.0
    timeline = Timeline(origin=origin, faults=list(book.faults))
    for item in book.progress:
        steps = item.get("steps")
        if not isinstance(steps, dict):
            continue
        for rank, step in steps.items():
            if isinstance(step, int) and str(rank).isdigit():
                timeline.ranks.setdefault(int(rank), []).append((timeline.t(item["ts"]), step))
    for event in events:
        ts, world = event.get("ts"), event.get("world_size")
        if event.get("event") in ("epoch", "generation") and isinstance(ts, (int, float)) \
                and isinstance(world, int):
            timeline.world.append((timeline.t(ts), world))
    summary = book.summary()
    if summary.ended is not None:
        timeline.end = timeline.t(summary.ended)
    return timeline


def write(timeline: Timeline, path: Path, title: str) -> None:
    """Write the picture; the suffix chooses the format (.html or .png). Raises
    :class:`PictureError`."""
    suffix = path.suffix.lower()
    if suffix not in (".html", ".htm", ".png"):
        raise PictureError(f"cannot write {path}: the picture is .html or .png")
    try:
        if suffix == ".png":
            _png(timeline, path, title)
        else:
            _html(timeline, path, title)
    except OSError as error:
        raise PictureError(f"cannot write {path}: {error.strerror or error}") from None
    except ImportError as error:
        raise PictureError(f"cannot draw {path}: {error.name} is not installed (pip install "
                           "'ftrun[report]')") from None


def _fault_span(timeline: Timeline, fault: FaultRecord) -> tuple[float, float]:
    start = timeline.t(fault.happened)
    if fault.recovered is not None:
        return start, timeline.t(fault.recovered)
    return start, timeline.end if timeline.end is not None else timeline.t(fault.detected)


def _step_at(timeline: Timeline, fault: FaultRecord) -> float:
    if fault.step is not None:
        return float(fault.step)
    steps = [s for points in timeline.ranks.values() for t, s in points
             if t <= timeline.t(fault.detected)]
    return float(max(steps)) if steps else 0.0


def _html(timeline: Timeline, path: Path, title: str) -> None:
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.75, 0.25],
                           vertical_spacing=0.05)
    for rank in sorted(timeline.ranks):
        points = timeline.ranks[rank]
        figure.add_trace(go.Scatter(x=[t for t, _ in points], y=[s for _, s in points],
                                    mode="lines", name=f"rank {rank}",
                                    line={"shape": "hv"}), row=1, col=1)
    for fault in timeline.faults:
        start, end = _fault_span(timeline, fault)
        figure.add_vrect(x0=start, x1=max(end, start + 0.01), fillcolor="red", opacity=0.2,
                         line_width=0, row=1, col=1)
        step = _step_at(timeline, fault)
        detail = (f"{fault.who} {fault.cause}<br>path {fault.path or '-'}, detected in "
                  f"{fault.detection_s:.2f} s, recovered in "
                  f"{'-' if fault.recovery_s is None else f'{fault.recovery_s:.2f}'} s")
        xs = [start, timeline.t(fault.detected)]
        labels = ["happened", "detected"]
        if fault.recovered is not None:
            xs.append(end)
            labels.append("progressing again")
        figure.add_trace(go.Scatter(
            x=xs, y=[step] * len(xs), mode="markers+lines", name=fault_name(fault),
            marker={"color": "red", "symbol": ["x", "diamond", "circle"][:len(xs)],
                    "size": 10},
            text=labels, hovertext=[f"{label}: {detail}" for label in labels],
            hoverinfo="text"), row=1, col=1)
        if fault.joined is not None:
            figure.add_trace(go.Scatter(
                x=[timeline.t(fault.joined)], y=[fault.joined_step or step], mode="markers",
                name=f"join after fault {fault.index}", marker={"color": "green",
                                                                "symbol": "triangle-up",
                                                                "size": 11}), row=1, col=1)
    if timeline.world:
        xs = [t for t, _ in timeline.world]
        ys = [w for _, w in timeline.world]
        if timeline.end is not None:
            xs, ys = [*xs, timeline.end], [*ys, ys[-1]]
        figure.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="world size",
                                    line={"shape": "hv", "color": "black"}), row=2, col=1)
    figure.update_layout(title=title, hovermode="closest", height=650)
    figure.update_yaxes(title_text="committed steps", row=1, col=1)
    figure.update_yaxes(title_text="world size", row=2, col=1)
    figure.update_xaxes(title_text="seconds since start", row=2, col=1)
    figure.write_html(str(path), include_plotlyjs=True, full_html=True)


def _png(timeline: Timeline, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(11, 6.5),
                                      gridspec_kw={"height_ratios": [3, 1]})
    try:
        for rank in sorted(timeline.ranks):
            points = timeline.ranks[rank]
            top.step([t for t, _ in points], [s for _, s in points], where="post",
                     label=f"rank {rank}")
        for fault in timeline.faults:
            start, end = _fault_span(timeline, fault)
            top.axvspan(start, max(end, start + 0.01), color="red", alpha=0.2)
            step = _step_at(timeline, fault)
            top.plot([start, timeline.t(fault.detected)], [step, step], "rx-",
                     label=fault_name(fault))
            if fault.recovered is not None:
                top.plot([end], [step], "ro")
            if fault.joined is not None:
                top.plot([timeline.t(fault.joined)], [fault.joined_step or step], "g^")
        if timeline.world:
            xs = [t for t, _ in timeline.world]
            ys = [w for _, w in timeline.world]
            if timeline.end is not None:
                xs, ys = [*xs, timeline.end], [*ys, ys[-1]]
            bottom.step(xs, ys, where="post", color="black")
        top.set_ylabel("committed steps")
        top.set_title(title)
        top.legend(loc="upper left", fontsize="small")
        bottom.set_ylabel("world size")
        bottom.set_xlabel("seconds since start")
        described = "; ".join(fault_name(f) for f in timeline.faults) or "no faults"
        fig.savefig(str(path), format="png", dpi=100,
                    metadata={"Title": title, "Description": described})
    finally:
        plt.close(fig)
