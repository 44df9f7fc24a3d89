"""``mover simulate``: the GPU-hours that interruptions waste per week, from 1K to 128K GPUs.

::

    mover simulate --costs runs/demo/summary.json           # this project's measured costs
    mover simulate --crash-s 20 --migration-s 15 -o waste.png
    mover simulate --assume trainmover                      # TrainMover's own projection

It compares restart-from-checkpoint (the production breakdown of 6.47 min at 8K GPUs),
TrainMover's published downtimes (with one standby host, and without one) and, when costs are
given, this project's: with its spare hosts, without a spare (the restart fallback) and, with
``--shrink-s``, on pipeline templates. Costs come from a run's summary (``--costs``: the median
downtime of its failures recovered by a standby, of its migrations and of its restarts) or from
flags, which win over the summary. The failure model is Llama 3's mix by default, or an MTTF
per GPU or per host with a planned:unplanned ratio. The model and the published figures are in
:mod:`mover_plugin.waste`. It prints a table (``--json``: the rows) and, with ``-o``, draws
the waste per system against the job's size.
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from mover_plugin import waste
from mover_plugin.errors import ConfigError
from mover_plugin.launch.flag_types import non_negative_int, positive_int

SCALES = tuple(1024 * 2 ** i for i in range(8))
"""1K to 128K GPUs."""


def _amount(text: str, *, zero: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value >= 0 if zero else value > 0):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a {'non-negative' if zero else 'positive'} number")
    return value


def _positive(text: str) -> float:
    return _amount(text)


def _non_negative(text: str) -> float:
    return _amount(text, zero=True)


def _scales(text: str) -> list[int]:
    return [positive_int(part.strip()) for part in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    costs = parser.add_argument_group("this project's costs (seconds of downtime)")
    costs.add_argument("--costs", type=Path, metavar="SUMMARY",
                       help="a run's --summary file: median downtimes of its interruptions")
    costs.add_argument("--crash-s", type=_non_negative, help="a failure taken by a standby")
    costs.add_argument("--migration-s", type=_non_negative,
                       help="a planned migration to a standby")
    costs.add_argument("--restart-s", type=_non_negative,
                       help="the restart fallback (default: the production restart, 6.47 min)")
    costs.add_argument("--shrink-s", type=_non_negative,
                       help="a switch onto pipeline templates (default: not shown)")
    costs.add_argument("--spare-hosts", type=non_negative_int, default=1,
                       help="idle spare hosts kept for standbys (default 1)")
    failures = parser.add_argument_group("failure model (default: Llama 3's 419 unexpected + "
                                         "47 planned interruptions in 54 days on 16,384 GPUs)")
    mttf = failures.add_mutually_exclusive_group()
    mttf.add_argument("--mttf-gpu-hours", type=_positive,
                      help="mean time between unexpected failures of one GPU")
    mttf.add_argument("--mttf-host-hours", type=_positive,
                      help="mean time between unexpected failures of one host")
    failures.add_argument("--planned-per-unplanned", type=_non_negative,
                          help="planned events per unexpected one with an MTTF (default "
                          "47/419, Llama 3's)")
    failures.add_argument("--assume", choices=("trainmover",),
                          help="TrainMover's projection: a 3 h MTTF at 8K GPUs, 1:8.9, +2 min "
                          "rescheduling for every system")
    parser.add_argument("--gpus", type=_scales, default=list(SCALES), metavar="N,N,...",
                        help="job sizes in GPUs (default 1024 to 131072, doubling)")
    parser.add_argument("--gpus-per-host", type=positive_int, default=8)
    parser.add_argument("--rescheduling-s", type=_non_negative,
                        help="infrastructure time added to every interruption of a system "
                        "whose costs do not include it (default 0)")
    parser.add_argument("--checkpoint-interval-min", type=_non_negative, default=0.0,
                        help="minutes between checkpoints; a restart loses half of it on a "
                        "failure (default 0: a checkpoint every step)")
    parser.add_argument("-o", "--output", metavar="FILE.png", help="draw the waste per system")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The systems compared, the rows and (with ``--assume trainmover``) the published
    comparisons, as a JSON-ready dict; raises ConfigError on bad input."""
    scenario = _scenario(args)
    systems = [waste.restart_system(), *waste.trainmover_systems()]
    measured = measured_costs(args)
    if measured is not None:
        systems += waste.mover_systems(measured)
    rows = waste.simulate(systems, scenario, args.gpus)
    result: dict[str, Any] = {
        "systems": [asdict(s) for s in systems],
        "scenario": {"unplanned_per_gpu_hour": scenario.failures.unplanned_per_gpu_hour,
                     "planned_per_gpu_hour": scenario.failures.planned_per_gpu_hour,
                     "gpus_per_host": scenario.gpus_per_host,
                     "rescheduling_s": scenario.rescheduling_s,
                     "checkpoint_interval_s": scenario.checkpoint_interval_s},
        "rows": [asdict(row) for row in rows],
        "published": [],
    }
    if args.assume == "trainmover":
        for gpus, published in waste.TRAINMOVER_PUBLISHED:
            model = waste.simulate(systems, scenario, [gpus])
            result["published"].append({
                "gpus": gpus, "system": "trainmover", "versus": "trainmover-no-standby",
                "published_reduction": published,
                "model_reduction": waste.reduction(model, "trainmover", "trainmover-no-standby",
                                                   gpus)})
    return result


def _scenario(args: argparse.Namespace) -> waste.Scenario:
    if args.assume == "trainmover":
        chosen = [flag for flag, value in (("--mttf-gpu-hours", args.mttf_gpu_hours),
                                           ("--mttf-host-hours", args.mttf_host_hours),
                                           ("--planned-per-unplanned",
                                            args.planned_per_unplanned),
                                           ("--rescheduling-s", args.rescheduling_s))
                  if value is not None]
        if chosen:
            raise ConfigError(f"--assume trainmover sets the failure model and rescheduling; "
                              f"drop {', '.join(chosen)}")
        return waste.trainmover_scenario(args.gpus_per_host)
    ratio = args.planned_per_unplanned
    if args.mttf_gpu_hours is None and args.mttf_host_hours is None:
        if ratio is not None:
            raise ConfigError("--planned-per-unplanned goes with --mttf-gpu-hours or "
                              "--mttf-host-hours (Llama 3's mix has its own ratio)")
        failures = waste.FailureModel.llama3()
    else:
        ratio = waste.LLAMA3_PLANNED / waste.LLAMA3_UNPLANNED if ratio is None else ratio
        if args.mttf_gpu_hours is not None:
            failures = waste.FailureModel.from_mttf(args.mttf_gpu_hours, 1, ratio)
        else:
            failures = waste.FailureModel.from_mttf(args.mttf_host_hours, args.gpus_per_host,
                                                    ratio)
    return waste.Scenario(failures, args.gpus_per_host, args.rescheduling_s or 0.0,
                          args.checkpoint_interval_min * 60)


def measured_costs(args: argparse.Namespace) -> Optional[waste.MeasuredCosts]:
    """This project's costs from ``--costs`` and the flags (which win); None if neither gives
    any. A crash and a migration cost are both needed once one is given."""
    from_summary = summary_costs(args.costs) if args.costs else {}
    flags = {key: getattr(args, key) for key in ("crash_s", "migration_s", "restart_s",
                                                 "shrink_s")}
    costs = {**from_summary, **{k: v for k, v in flags.items() if v is not None}}
    if not costs:
        return None
    missing = [f"--{key.replace('_', '-')}" for key in ("crash_s", "migration_s")
               if key not in costs]
    if missing:
        where = f"{args.costs} has no such interruption; give " if args.costs else "give "
        raise ConfigError(f"this project's costs need {' and '.join(missing)}: {where}"
                          f"{' and '.join(missing)}")
    source = f"measured in {args.costs}" if from_summary else "given"
    return waste.MeasuredCosts(costs["crash_s"], costs["migration_s"], costs.get("restart_s"),
                               costs.get("shrink_s"), args.spare_hosts, source)


def summary_costs(path: Path) -> dict[str, float]:
    """The median downtime of a run's failures recovered by a standby (``crash_s``), of its
    migrations (``migration_s``) and of its restarts (``restart_s``), where it had any."""
    try:
        interruptions = json.loads(path.read_text())["interruptions"]
    except FileNotFoundError:
        raise ConfigError(f"--costs {path}: no such file") from None
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise ConfigError(f"--costs {path}: not a run summary of mover-launch --summary "
                          f"({type(error).__name__}: {error})") from None
    by_cost: dict[str, list[float]] = {}
    for item in interruptions:
        if item.get("downtime_s") is None:
            continue
        if item["recovery"] == "restart":
            key = "restart_s"
        else:
            key = "migration_s" if item["kind"] == "migration" else "crash_s"
        by_cost.setdefault(key, []).append(float(item["downtime_s"]))
    return {key: max(0.0, statistics.median(values)) for key, values in by_cost.items()}


def describe(result: dict[str, Any]) -> str:
    """The systems, then one line per job size with each system's wasted GPU-hours per week,
    then the published comparisons."""
    systems = result["systems"]
    scenario = result["scenario"]
    lines = [f"failures per 1,000 GPU-days: {scenario['unplanned_per_gpu_hour'] * 24000:.3f} "
             f"unexpected, {scenario['planned_per_gpu_hour'] * 24000:.3f} planned; "
             f"+{scenario['rescheduling_s']:g} s rescheduling where not counted; checkpoint "
             f"every {scenario['checkpoint_interval_s'] / 60:g} min",
             "systems (downtime per unexpected / planned interruption):"]
    for s in systems:
        lines.append(f"  {s['system']:<22} {s['unplanned_s']:9.2f} s / {s['planned_s']:9.2f} s"
                     f"  {s['standby_hosts']} standby host(s)  {s['source']}")
    names = [s["system"] for s in systems]
    width = max(12, *(len(n) for n in names))
    lines.append("wasted GPU-hours per week:")
    lines.append(f"{'GPUs':>8} {'failures/wk':>11}  " + " ".join(f"{n:>{width}}" for n in names))
    rows = result["rows"]
    for gpus in dict.fromkeys(row["gpus"] for row in rows):
        at = {row["system"]: row for row in rows if row["gpus"] == gpus}
        failures = at[names[0]]["unplanned_per_week"] + at[names[0]]["planned_per_week"]
        lines.append(f"{gpus:>8} {failures:>11.1f}  " + " ".join(
            f"{at[n]['wasted_gpu_hours_per_week']:>{width},.0f}" for n in names))
    for point in result["published"]:
        lines.append(f"TRAINMOVER {point['gpus']} GPUs: {point['system']} wastes "
                     f"{point['model_reduction'] * 100:.2f} % less than {point['versus']} "
                     f"(published {point['published_reduction'] * 100:.2f} %)")
    return "\n".join(lines)


def draw(result: dict[str, Any], path: Path) -> Path:
    """Wasted GPU-hours per week against the job's size, one line per system (log-log)."""
    from mover_plugin.launch.report import pyplot_module

    pyplot = pyplot_module()
    figure, axis = pyplot.subplots(figsize=(9, 6))
    try:
        for system in result["systems"]:
            rows = [r for r in result["rows"] if r["system"] == system["system"]]
            axis.plot([r["gpus"] for r in rows], [r["wasted_gpu_hours_per_week"] for r in rows],
                      marker="o", label=system["system"],
                      linestyle="--" if system["system"].startswith("mover") else "-")
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("GPUs in the job")
        axis.set_ylabel("wasted GPU-hours per week")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=100)
    finally:
        pyplot.close(figure)
    return path
