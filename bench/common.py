"""What the benchmarks share: their command line, interleaved repetitions of several modes, the
check that every run ended with the same parameters, and the pieces of their reports."""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

CRASH_PHASES = ("detected", "alarm", "left", "switched", "first_step_completed")
"""A resilient recovery's phases after a crash, in the order they happen."""

WORKER_COSTS = (("worker_peak_rss_mb", "worker peak RSS MB"),
                ("median_step_time_s", "median step time s"))
"""The run-summary fields (and their labels) that say what a worker costs."""


def benchmark_parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """A parser described by the first paragraph of ``doc``, with ``--repeats`` (runs of each
    mode, default ``repeats``)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--repeats", type=_at_least_one, default=repeats)
    return parser


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def repeats_argument(doc: str, default: int) -> argparse.Namespace:
    """Parses ``--repeats`` (runs of each mode) for a benchmark described by ``doc``."""
    return benchmark_parser(doc, default).parse_args()


def add_out_argument(parser: argparse.ArgumentParser, name: str) -> None:
    """Adds ``--out``, the folder the runs are kept in (default runs/``name``-<date-time>)."""
    parser.add_argument("--out", default=f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}")


def new_out_folder(out: str) -> Path:
    """The ``--out`` folder; stops the benchmark if it exists (nothing is overwritten)."""
    folder = Path(out)
    if folder.exists():
        raise SystemExit(f"--out {folder} exists; give a new folder (nothing is overwritten)")
    return folder


def job_folder(parent: Path, name: str) -> Path:
    """A new folder ``parent``/``name`` for one run's files."""
    folder = parent / name
    folder.mkdir(parents=True)
    return folder


def interleaved(modes: Sequence[str], repeats: int, run: Callable[[str, int], dict],
                describe: Callable[[dict], str]) -> dict[str, list[dict]]:
    """Runs ``run(mode, repeat)`` for every mode in turn, ``repeats`` times, printing
    ``describe(result)`` after each; returns the results by mode. The order of the modes is
    reversed every other repeat, so that neither always runs first (on a shared machine the
    first and second run of a pair can differ by 10 % or more)."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in (modes if repeat % 2 == 0 else list(reversed(modes))):
            result = run(mode, repeat)
            runs[mode].append(result)
            print(f"{mode} run {repeat}: {describe(result)}", flush=True)
    return runs


def interleaved_in(parent: Path, modes: Sequence[str], repeats: int,
                   run: Callable[[str, Path], dict],
                   describe: Callable[[dict], str]) -> dict[str, list[dict]]:
    """:func:`interleaved`, each run given a new folder ``parent``/<mode>-<repeat>:
    ``run(mode, folder)``."""
    return interleaved(modes, repeats,
                       lambda mode, repeat: run(mode, job_folder(parent, f"{mode}-{repeat}")),
                       describe)


def check_same_digest(runs: Mapping[Any, list[dict]], *, blank_line: bool = False) -> None:
    """Stops the benchmark unless every run's ``digest`` (its PARAMS_DIGEST) is the same; says
    so otherwise (after an empty line with ``blank_line``)."""
    digests = {result["digest"] for results in runs.values() for result in results}
    if len(digests) != 1:
        raise SystemExit(f"PARAMS_DIGEST differs between runs: {sorted(digests)}")
    count = sum(len(results) for results in runs.values())
    separator = "\n" if blank_line else ""
    print(f"{separator}all {count} runs end with the same PARAMS_DIGEST")


def joined(values: Iterable[float], spec: str = ".3f") -> str:
    """``values`` formatted with ``spec``, separated by commas."""
    return ", ".join(format(value, spec) for value in values)


def median_of(runs: Iterable[dict], field: str) -> float:
    """The median of ``field`` over ``runs``."""
    return statistics.median(run[field] for run in runs)


def percent_more(value: float, reference: float) -> float:
    """How many percent ``value`` is above ``reference`` (negative: below)."""
    return 100 * (value / reference - 1)


def print_downtime_medians(downtimes: Mapping[str, list[float]]) -> dict[str, float]:
    """Prints each way's median downtime and its runs' downtimes; returns the medians."""
    medians = {way: statistics.median(values) for way, values in downtimes.items()}
    for way, values in downtimes.items():
        print(f"{way:9s} downtime median {medians[way]:7.3f} s ({joined(values)})")
    return medians


def print_phase_medians(heading: str, interruptions: Sequence[dict],
                        phases: Iterable[str]) -> None:
    """Prints ``heading`` and the median time of each of ``phases`` (of the run summaries'
    ``interruptions``) that any of them reached."""
    print(heading)
    for phase in phases:
        values = [i["phases_s"][phase] for i in interruptions if phase in i["phases_s"]]
        if values:
            print(f"  {phase:22s} {statistics.median(values):8.3f}")
