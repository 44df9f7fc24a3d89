"""``mover report``: what happened in a run, from its summary and its event log.

``mover report RUN [-o FILE.png]`` reads the run summary (``mover-launch --summary``) and the
event log (``--event-log``) — RUN is a folder holding ``summary.json`` and ``events.jsonl``, or
the two paths — and prints a table of the interruptions (kind, rank, step, recovery, generation,
downtime and the time of each phase after the failure), then draws a timeline picture:

* the step time of global rank 0 over wall-clock time (the event log's ``steps`` records,
  :mod:`mover_plugin.launch.step_times`), each attempt in its own colour;
* each interruption as a band from its first phase to the first step completed after it,
  split into its phases (for a failure: detected, alarm, left, switched, first step; for a
  restart: detected, stopped, started, recovered, first step; for a migration: prepared,
  boundary, handed over, switched, first step), with its kind, rank and downtime;
* below, the generation and the standby pool over the same time.

The picture needs matplotlib (``pip install 'mover_plugin[report]'``); the table does not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

from mover_plugin.errors import ConfigError
from mover_plugin.launch.summary import PHASES

SUMMARY_NAME = "summary.json"
EVENT_LOG_NAME = "events.jsonl"
PICTURE_NAME = "report.png"
TITLED_BANDS = 12
"""Up to this many interruptions, each band over the step times carries its title; beyond,
only its number (the titles would overlap)."""

PHASE_COLOURS = {
    "detected": "#d62728", "alarm": "#ff7f0e", "left": "#bcbd22", "switched": "#2ca02c",
    "prepared": "#17becf", "boundary": "#9467bd", "handed_over": "#8c564b",
    "stopped": "#e377c2", "started": "#7f7f7f", "recovered": "#aec7e8",
    "first_step_completed": "#1f77b4",
}
"""The colour of the part of a band that ends at each phase."""


@dataclass(frozen=True)
class Run:
    """One run's summary and event log."""

    summary: dict[str, Any]
    events: list[dict[str, Any]]
    folder: Path
    """Where the picture goes unless ``-o`` says otherwise."""

    @property
    def start(self) -> float:
        return float(self.summary["started_at"])

    def steps(self) -> list[tuple[int, int, float, float]]:
        """(attempt, step, end time, duration) of every reported step end, in order."""
        return [(record["attempt"], int(step), float(end), float(duration))
                for record in self.events if record.get("event") == "steps"
                for step, end, duration in record["steps"]]

    def generations(self) -> list[tuple[float, int]]:
        """(time, the highest generation so far) at every record that moves it on (a record
        may name an earlier generation: a late report of a rank that has switched since)."""
        points: list[tuple[float, int]] = []
        for record in sorted(self.events, key=lambda r: r["time"]):
            generation = record.get("generation")
            if isinstance(generation, int) and (not points or generation > points[-1][1]):
                points.append((record["time"], generation))
        return points

    def pool(self) -> list[tuple[float, int]]:
        """(time, ready standbys) wherever the event log gives the pool's size."""
        return [(record["time"], record["pool"]) for record in self.events
                if isinstance(record.get("pool"), int)]


def load_run(paths: Sequence[str]) -> Run:
    """The run of ``paths``: a folder, or a summary and an event log (in either order)."""
    if len(paths) == 1 and Path(paths[0]).is_dir():
        folder = Path(paths[0])
        summary_path, events_path = folder / SUMMARY_NAME, folder / EVENT_LOG_NAME
    elif len(paths) == 2:
        summary_path, events_path = sorted((Path(p) for p in paths),
                                           key=lambda p: p.suffix == ".jsonl")
        folder = summary_path.parent
    else:
        raise ConfigError(f"{' '.join(paths) or 'nothing'}: give a run folder (holding "
                          f"{SUMMARY_NAME} and {EVENT_LOG_NAME}) or the run's --summary and "
                          "--event-log files")
    return Run(_read_summary(summary_path), _read_event_log(events_path), folder)


def _read_summary(path: Path) -> dict[str, Any]:
    try:
        summary = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (the run's --summary)") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: not a run summary ({error})") from None
    if not isinstance(summary, dict) or "started_at" not in summary or \
            "interruptions" not in summary:
        raise ConfigError(f"{path}: not a run summary (no started_at or interruptions)")
    return summary


def _read_event_log(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file (the run's --event-log)") from None
    events = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # a last line cut short by a killed launcher
            raise ConfigError(f"{path}:{number}: not an event-log line") from None
        if not isinstance(record, dict) or "event" not in record or "time" not in record:
            raise ConfigError(f"{path}:{number}: not an event-log record (no event or time)")
        events.append(record)
    return events


# -- the table --------------------------------------------------------------------------------


def interruption_table(run: Run) -> str:
    """One line per interruption (and below it, its rollback and why it was inexact, if so),
    and a line with the run's totals."""
    header = f"{'#':>2}  {'kind':<9} {'rank':>5} {'step':>5}  {'how':<16} {'recovery':<8} " \
             f"{'gen':>3}  {'downtime':>9}  phases (s after the failure or request)"
    lines = [header, "-" * len(header)]
    for number, item in enumerate(run.summary["interruptions"], start=1):
        downtime = item.get("downtime_s")
        phases = "  ".join(f"{name} {seconds:.3f}" for name, seconds in
                           item.get("phases_s", {}).items() if name not in ("failed",
                                                                            "requested"))
        lines.append(f"{number:>2}  {item['kind']:<9} {_ranks(item):>5} {item['step']:>5}  "
                     f"{item['how'][:16]:<16} {item['recovery']:<8} {item['generation']:>3}  "
                     f"{_seconds(downtime):>9}  {phases}")
        if item.get("rolled_back_to") is not None:
            lines.append(f"    rolled back to the checkpoint of step {item['rolled_back_to']}")
        if item.get("inexact"):
            lines.append(f"    inexact: {item['inexact']}")
    summary = run.summary
    lines.append(f"{len(summary['interruptions'])} interruption(s), downtime "
                 f"{_seconds(summary.get('total_downtime_s'))} in all; "
                 f"{summary.get('steps_completed')} steps in {_seconds(summary.get('wall_time_s'))}"
                 f", {summary.get('restarts', 0)} restart(s), exit code {summary.get('exit_code')}")
    return "\n".join(lines)


def _seconds(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f} s"


# -- the picture ------------------------------------------------------------------------------


def pyplot_module() -> Any:
    """matplotlib's pyplot, drawing to files only; a ConfigError without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("the picture needs matplotlib: pip install 'mover_plugin[report]' "
                          "(or matplotlib)") from None
    matplotlib.use("Agg")
    from matplotlib import pyplot

    return pyplot


def draw_timeline(run: Run, path: Path) -> Path:
    """Draws the run's timeline into ``path`` (PNG); returns it."""
    pyplot = pyplot_module()
    count = len(run.summary["interruptions"])
    figure = pyplot.figure(figsize=(12, 7.5 + 0.3 * count))
    grid = figure.add_gridspec(3, 1, height_ratios=[3, 1, 0.8 + 0.35 * count])
    steps_axis = figure.add_subplot(grid[0])
    pool_axis = figure.add_subplot(grid[1], sharex=steps_axis)
    phases_axis = figure.add_subplot(grid[2])
    try:
        _draw_steps(run, steps_axis)
        _draw_interruptions(run, steps_axis)
        _draw_generations_and_pool(run, pool_axis)
        span = _training_span(run)
        if span is not None:
            steps_axis.set_xlim(*span)
        pool_axis.set_xlabel("wall-clock time since the job started (s)"
                             + (", while it trained" if span is not None else ""))
        _draw_phases(run, phases_axis)
        summary = run.summary
        figure.suptitle(f"{summary.get('policy')} policy, world size {summary.get('world_size')}: "
                        f"{count} interruption(s), downtime "
                        f"{_seconds(summary.get('total_downtime_s'))}")
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp.png")
        figure.savefig(temporary, dpi=110)
        temporary.replace(path)
    finally:
        pyplot.close(figure)
    return path


def _draw_steps(run: Run, axis: Any) -> None:
    by_attempt: dict[int, list[tuple[float, float]]] = {}
    for attempt, _, end, duration in run.steps():
        by_attempt.setdefault(attempt, []).append((end - run.start, duration * 1000.0))
    for attempt, points in sorted(by_attempt.items()):
        axis.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1,
                  label=f"attempt {attempt}")
    axis.set_ylabel("step time of rank 0 (ms)")
    if by_attempt:
        axis.legend(loc="upper left", fontsize=7)
    else:
        axis.text(0.5, 0.5, "no step times in the event log", transform=axis.transAxes,
                  ha="center", va="center")


def _training_span(run: Run) -> Optional[tuple[float, float]]:
    """The time from the first step's start to the last step's end or interruption's end,
    with a margin, since the job started (None without step times)."""
    steps = run.steps()
    if not steps:
        return None
    times = [end - duration for _, _, end, duration in steps] + [end for _, _, end, _ in steps]
    times += [t for item in run.summary["interruptions"] for t in item.get("times", {}).values()]
    begin, end = min(times) - run.start, max(times) - run.start
    margin = max(0.5, 0.03 * (end - begin))
    return begin - margin, end + margin


def _draw_interruptions(run: Run, axis: Any) -> None:
    """Each interruption as a band over the step times, split into its phases, labelled with
    its number (and, when there are few, its title; the phase chart below has them all)."""
    items = run.summary["interruptions"]
    for number, item in enumerate(items, start=1):
        segments = _phase_segments(item)
        for begin, end, phase in segments:
            axis.axvspan(begin - run.start, end - run.start, alpha=0.35, linewidth=0,
                         color=PHASE_COLOURS.get(phase, "#cccccc"))
        if segments:
            label = f"#{number} {_title(item)}" if len(items) <= TITLED_BANDS else f"#{number}"
            axis.annotate(label, xy=(segments[0][0] - run.start, 0.98),
                          xycoords=("data", "axes fraction"), xytext=(-3, 0),
                          textcoords="offset points", va="top", ha="right", rotation=90,
                          fontsize=7)


def _draw_phases(run: Run, axis: Any) -> None:
    """One bar per interruption, in seconds after its failure (or request): its phases."""
    labelled: set[str] = set()
    items = run.summary["interruptions"]
    for row, item in enumerate(items):
        segments = _phase_segments(item)
        origin = segments[0][0] if segments else 0.0
        for begin, end, phase in segments:
            label = None if phase in labelled else _phase_label(phase)
            labelled.add(phase)
            axis.barh(row, end - begin, left=begin - origin, height=0.6, label=label,
                      color=PHASE_COLOURS.get(phase, "#cccccc"))
        if segments:
            axis.annotate(f" step {item['step']}, {item['recovery']}, downtime "
                          f"{_seconds(item.get('downtime_s'))}",
                          xy=(segments[-1][1] - origin, row), va="center", fontsize=7)
    axis.set_yticks(range(len(items)), [f"#{n} {item['kind']}, rank {_ranks(item)}"
                                         for n, item in enumerate(items, start=1)], fontsize=7)
    axis.margins(x=0.25)
    axis.invert_yaxis()
    axis.set_xlabel("seconds after the failure (or the migration's request)")
    if labelled:
        axis.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
    else:
        axis.text(0.5, 0.5, "no interruptions", transform=axis.transAxes, ha="center",
                  va="center")


def _phase_segments(item: dict[str, Any]) -> list[tuple[float, float, str]]:
    """(begin, end, phase) for each phase of an interruption: the time from the phase before
    it to this one."""
    times = sorted(((t, PHASES.index(p), p) for p, t in item.get("times", {}).items()
                    if p in PHASES))
    return [(begin, end, phase) for (begin, _, _), (end, _, phase) in zip(times, times[1:])]


def _title(item: dict[str, Any]) -> str:
    return (f"{item['kind']} of rank {_ranks(item)} at step {item['step']}: "
            f"{item['recovery']}, downtime {_seconds(item.get('downtime_s'))}")


def _ranks(item: dict[str, Any]) -> str:
    """The ranks an interruption took, ``2`` or ``2,3`` (a host loss, a migration of several;
    a summary older than the ``ranks`` field has only ``rank``)."""
    return ",".join(str(rank) for rank in item.get("ranks") or [item["rank"]])


def _phase_label(phase: str) -> str:
    return "until " + phase.replace("_", " ").replace("first step completed", "first step")


def _draw_generations_and_pool(run: Run, axis: Any) -> None:
    end = run.summary.get("finished_at") or max((r["time"] for r in run.events),
                                                default=run.start)
    generations = _until(run.generations(), end)
    if generations:
        axis.step([t - run.start for t, _ in generations], [g for _, g in generations],
                  where="post", color="#1f77b4")
    axis.set_ylabel("generation", color="#1f77b4")
    pool = _until(run.pool(), end)
    if pool:
        twin = axis.twinx()
        twin.step([t - run.start for t, _ in pool], [n for _, n in pool], where="post",
                  color="#2ca02c")
        twin.set_ylabel("standbys ready", color="#2ca02c")
        twin.set_ylim(bottom=0, top=max(n for _, n in pool) + 0.5)


def _until(points: list[tuple[float, int]], end: float) -> list[tuple[float, int]]:
    """A step series held at its last value until ``end``."""
    return points + [(end, points[-1][1])] if points and end > points[-1][0] else points


def report(paths: Sequence[str], output: Optional[str] = None) -> tuple[str, Path]:
    """The table, and the picture's path once drawn (``output``, or ``report.png`` beside the
    summary)."""
    run = load_run(paths)
    table = interruption_table(run)
    picture = draw_timeline(run, Path(output) if output else run.folder / PICTURE_NAME)
    return table, picture
