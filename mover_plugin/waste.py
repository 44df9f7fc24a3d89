"""What interruptions cost a training job at scale: GPU-hours wasted per week, by system.

A pure model (no torch, no processes) behind ``mover simulate``. A job of ``gpus`` GPUs, in
hosts of ``gpus_per_host``, is interrupted by unexpected failures and planned maintenance at
rates proportional to its size (:class:`FailureModel`). Each interruption stops every GPU of
the job for the system's downtime of that kind; a system may also keep idle standby hosts,
whose GPUs are wasted all week (:class:`SystemCosts`). The expected waste per week is::

    gpus * (unplanned/week * (unplanned_s + extra) + planned/week * (planned_s + extra)) / 3600
      + standby_hosts * gpus_per_host * 168

where ``extra`` is an infrastructure cost added to every interruption of a system that does
not already count it (``rescheduling_s``; a restart's measured downtime includes its own) plus,
for a system that resumes from a checkpoint, half the checkpoint interval of lost work on an
unexpected failure. Downtimes are held at the value given for each system, whatever the scale
(TrainMover's projection does the same). Expected values, not a sampled failure process.

The published figures the defaults come from are constants of this module, each with its
source: the Llama 3 interruption mix, the production restart breakdown at 8K GPUs and
TrainMover's measured downtimes at 1,024 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from mover_plugin.errors import ConfigError

HOURS_PER_WEEK = 168.0

# --- published figures -----------------------------------------------------------------------

LLAMA3_UNPLANNED = 419
LLAMA3_PLANNED = 47
LLAMA3_DAYS = 54
LLAMA3_GPUS = 16_384
"""Llama 3 405B pretraining: 466 interruptions (419 unexpected, 47 planned) in 54 days on
16,384 H100 GPUs."""

RESTART_S = 6.47 * 60
"""A production restart at 8,192 GPUs (TrainMover, Table 1): 6.47 min per interruption."""
RESTART_INFRASTRUCTURE_S = 2.02 * 60
"""Of that, job stop and cleanup (0.52 min) and rescheduling (1.50 min)."""
RESTART_FRAMEWORK_S = RESTART_S - RESTART_INFRASTRUCTURE_S
"""And the framework's own initialisation, 4.45 min: checkpoint loading 35.1 %,
communicator instantiation 24.5 %, cold warm-up 40.4 %."""
COLD_WARMUP_S = 0.404 * RESTART_FRAMEWORK_S
"""The cold warm-up a restart pays (40.4 % of 4.45 min, 108 s): what a pre-warmed standby
spares a replacement."""

TRAINMOVER_UNPLANNED_S = 21.1
TRAINMOVER_PLANNED_S = 16.6
"""TrainMover's downtime at 1,024 GPUs with a standby (its Figure 8): 21.1 s for an unexpected
failure, 16.6 s for a planned event."""

TRAINMOVER_RESCHEDULING_S = 120.0
"""TrainMover's projection adds 2 min of infrastructure rescheduling to every system."""
TRAINMOVER_PLANNED_PER_UNPLANNED = 1 / 8.9
"""TrainMover's projection: one planned event per 8.9 unexpected ones (Llama 3's mix)."""
TRAINMOVER_MTTF_HOURS_AT_8K = 3.0
"""TrainMover's projection at 8K GPUs: a 3 h mean time between unexpected failures."""


# --- the model -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FailureModel:
    """Interruptions per GPU-hour; a job's rate is proportional to its GPUs."""

    unplanned_per_gpu_hour: float
    """Unexpected failures (a rank or host lost), per GPU and hour."""
    planned_per_gpu_hour: float
    """Planned maintenance events (a host to be drained), per GPU and hour."""

    @classmethod
    def llama3(cls) -> "FailureModel":
        """Llama 3's mix: 419 unexpected and 47 planned interruptions in 54 days on 16,384
        GPUs."""
        gpu_hours = LLAMA3_DAYS * 24 * LLAMA3_GPUS
        return cls(LLAMA3_UNPLANNED / gpu_hours, LLAMA3_PLANNED / gpu_hours)

    @classmethod
    def from_mttf(cls, mttf_hours: float, per_gpus: int,
                  planned_per_unplanned: float) -> "FailureModel":
        """``mttf_hours``: mean time between unexpected failures of ``per_gpus`` GPUs (1 for a
        GPU's MTTF, a host's size for a host's); planned events come at
        ``planned_per_unplanned`` times that rate."""
        if mttf_hours <= 0 or per_gpus <= 0 or planned_per_unplanned < 0:
            raise ConfigError(f"an MTTF of {mttf_hours} h for {per_gpus} GPUs with "
                              f"{planned_per_unplanned} planned per unplanned event: the MTTF "
                              "and GPUs must be positive, the ratio not negative")
        unplanned = 1.0 / (mttf_hours * per_gpus)
        return cls(unplanned, unplanned * planned_per_unplanned)

    def per_week(self, gpus: int) -> tuple[float, float]:
        """Expected (unplanned, planned) interruptions per week of a job of ``gpus`` GPUs."""
        gpu_hours = gpus * HOURS_PER_WEEK
        return self.unplanned_per_gpu_hour * gpu_hours, self.planned_per_gpu_hour * gpu_hours


@dataclass(frozen=True)
class SystemCosts:
    """What one way of handling interruptions costs per interruption."""

    system: str
    unplanned_s: float
    """Downtime of an unexpected failure: every GPU of the job stands still this long."""
    planned_s: float
    """Downtime of a planned maintenance event."""
    standby_hosts: int = 0
    """Idle standby hosts kept for the job, counted as wasted all week."""
    includes_rescheduling: bool = False
    """The downtimes already count the infrastructure's cleanup and rescheduling, so the
    model's ``rescheduling_s`` is not added to them."""
    loses_work: bool = False
    """The system resumes an unexpected failure from the last checkpoint: half the checkpoint
    interval of training is lost on average."""
    source: str = ""
    """Where the figures come from, in a few words."""


@dataclass(frozen=True)
class Scenario:
    """Everything besides the systems that the waste depends on."""

    failures: FailureModel
    gpus_per_host: int = 8
    rescheduling_s: float = 0.0
    """Infrastructure time added to every interruption of a system whose downtimes do not
    include it."""
    checkpoint_interval_s: float = 0.0
    """Time between checkpoints; a system that resumes from one loses half of it on an
    unexpected failure (0: a checkpoint at every step, the idealised restart)."""


@dataclass(frozen=True)
class WeeklyWaste:
    """One system at one scale: a row of ``mover simulate``'s table and JSON."""

    system: str
    gpus: int
    unplanned_per_week: float
    planned_per_week: float
    downtime_hours_per_week: float
    """Hours per week the job stands still."""
    standby_gpu_hours_per_week: float
    wasted_gpu_hours_per_week: float
    """Every GPU of the job over the downtime, plus the idle standby hosts' GPUs."""


def weekly_waste(costs: SystemCosts, scenario: Scenario, gpus: int) -> WeeklyWaste:
    """The expected waste per week of ``costs`` on a job of ``gpus`` GPUs (module docstring)."""
    unplanned, planned = scenario.failures.per_week(gpus)
    extra = 0.0 if costs.includes_rescheduling else scenario.rescheduling_s
    lost = scenario.checkpoint_interval_s / 2 if costs.loses_work else 0.0
    down_s = unplanned * (costs.unplanned_s + extra + lost) + planned * (costs.planned_s + extra)
    standby = costs.standby_hosts * scenario.gpus_per_host * HOURS_PER_WEEK
    return WeeklyWaste(costs.system, gpus, unplanned, planned, down_s / 3600, standby,
                       gpus * down_s / 3600 + standby)


def simulate(systems: Sequence[SystemCosts], scenario: Scenario,
             scales: Sequence[int]) -> list[WeeklyWaste]:
    """Every system at every scale, by scale then system."""
    for gpus in scales:
        if gpus <= 0 or gpus % scenario.gpus_per_host:
            raise ConfigError(f"a job of {gpus} GPUs: the GPU counts must be positive multiples "
                              f"of the host size ({scenario.gpus_per_host})")
    return [weekly_waste(costs, scenario, gpus) for gpus in scales for costs in systems]


def reduction(rows: Sequence[WeeklyWaste], system: str, versus: str, gpus: int) -> float:
    """How much less ``system`` wastes than ``versus`` at ``gpus`` GPUs, as a fraction."""
    waste = {row.system: row.wasted_gpu_hours_per_week for row in rows if row.gpus == gpus}
    return 1.0 - waste[system] / waste[versus]


# --- the systems compared ----------------------------------------------------------------------


def restart_system() -> SystemCosts:
    """Restart from the last checkpoint, as a production job at 8K GPUs pays it."""
    return SystemCosts("restart", RESTART_S, RESTART_S, includes_rescheduling=True,
                       loses_work=True, source="production restart at 8K GPUs, 6.47 min")


def trainmover_systems() -> list[SystemCosts]:
    """TrainMover with one standby host (its measured downtimes at 1,024 GPUs), and without
    one: an unexpected failure then waits for a replacement that warms up cold (the cold
    warm-up of a restart, which its sandbox otherwise does in advance; the paper gives no
    figure for this case), planned events unchanged."""
    return [
        SystemCosts("trainmover", TRAINMOVER_UNPLANNED_S, TRAINMOVER_PLANNED_S, standby_hosts=1,
                    source="TrainMover at 1,024 GPUs, one standby host"),
        SystemCosts("trainmover-no-standby", TRAINMOVER_UNPLANNED_S + COLD_WARMUP_S,
                    TRAINMOVER_PLANNED_S,
                    source="TrainMover + a cold warm-up (108 s) on an unexpected failure"),
    ]


@dataclass(frozen=True)
class MeasuredCosts:
    """This project's costs as measured in a run (or given by hand)."""

    crash_s: float
    """Downtime of a failure recovered by a standby."""
    migration_s: float
    """Downtime of a planned migration to a standby."""
    restart_s: Optional[float] = None
    """Downtime of the restart fallback (no standby); None: the production restart's."""
    shrink_s: Optional[float] = None
    """Downtime of a switch onto pipeline templates (no standby); None: not modelled."""
    spare_hosts: int = 1
    source: str = "given"


def mover_systems(measured: MeasuredCosts) -> list[SystemCosts]:
    """This project with its spare hosts; without a spare (a failure then costs the restart
    fallback; so does a maintenance event, which has nowhere to move to); and, where a shrink
    cost is given, without a spare but on pipeline templates."""
    systems = [SystemCosts("mover", measured.crash_s, measured.migration_s,
                           standby_hosts=measured.spare_hosts, source=measured.source)]
    if measured.restart_s is None:
        systems.append(SystemCosts("mover-no-spare", RESTART_S, RESTART_S,
                                   includes_rescheduling=True, loses_work=True,
                                   source="the restart fallback: production restart"))
    else:
        systems.append(SystemCosts("mover-no-spare", measured.restart_s, measured.restart_s,
                                   loses_work=True, source=f"{measured.source}: restart"))
    if measured.shrink_s is not None:
        systems.append(SystemCosts("mover-templates", measured.shrink_s, measured.shrink_s,
                                   source=f"{measured.source}: shrink onto templates"))
    return systems


def trainmover_scenario(gpus_per_host: int = 8) -> Scenario:
    """TrainMover's own assumptions for its projection: a 3 h MTTF at 8K GPUs scaling with the
    job's size, 1 planned per 8.9 unexpected events, +2 min rescheduling for every system."""
    failures = FailureModel.from_mttf(TRAINMOVER_MTTF_HOURS_AT_8K, 8192,
                                      TRAINMOVER_PLANNED_PER_UNPLANNED)
    return Scenario(failures, gpus_per_host, rescheduling_s=TRAINMOVER_RESCHEDULING_S)


TRAINMOVER_PUBLISHED = ((8192, 0.3591), (131_072, 0.55))
"""TrainMover's published comparison (its Figure 9 and §8.2): at 8K GPUs with a 3 h MTTF,
with one standby host it wastes 35.91 % less than without one; at 128K GPUs 55 % less."""
