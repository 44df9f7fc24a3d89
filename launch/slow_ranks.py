"""The slow-rank policy: which rank to migrate because it keeps slowing the job down.

In a synchronous job every rank's step takes as long as the slowest rank's, so wall-clock step
times cannot tell the straggler apart. Each resilient worker therefore reports its *busy time*
per step: the step's duration minus the time it spent blocked waiting for its peers' data
(:func:`mover_plugin.comm.work.waited_s`). The straggler is the rank the others wait for: its
busy time stands out. A rank whose busy time stays above ``factor`` times the median of all
ranks for ``steps`` consecutive steps is reported for migration (``mover-launch
--slow-rank-factor F --slow-rank-steps N``; off by default). Pure logic: each agent collects
its host's busy times of a step (:class:`HostBusyTimes`), and the controller feeds the agents'
per-step reports to :class:`SlowRankDetector`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional

_KEEP_STEPS = 16
"""Steps whose reports are kept while waiting for the rest of the ranks."""


class HostBusyTimes:
    """An agent's busy times by step, then rank, until every rank training on its host
    reported the step."""

    def __init__(self) -> None:
        self._by_step: dict[int, dict[int, float]] = {}

    def add(self, step: int, rank: int, busy_s: float,
            training: Collection[int]) -> Optional[dict[int, float]]:
        """Adds ``rank``'s busy time of ``step``; the step's report once every rank of
        ``training`` has one (then forgotten), else None."""
        report = self._by_step.setdefault(step, {})
        report[rank] = busy_s
        for old in [s for s in self._by_step if s < step - _KEEP_STEPS]:
            del self._by_step[old]
        if not set(training) <= set(report):
            return None
        return self._by_step.pop(step)


@dataclass(frozen=True)
class SlowRank:
    rank: int
    step: int
    busy_s: float
    median_busy_s: float


@dataclass
class SlowRankDetector:
    factor: float
    steps: int
    world_size: int
    _reports: dict[int, dict[int, float]] = field(default_factory=dict)
    _streaks: dict[int, int] = field(default_factory=dict)

    def observe(self, step: int, busy_s: Mapping[int, float]) -> Optional[SlowRank]:
        """Adds one host's busy times of ``step``; once every rank reported that step,
        returns the rank to migrate, if one has been slow for ``steps`` steps in a row."""
        report = self._reports.setdefault(step, {})
        report.update(busy_s)
        for old in [s for s in self._reports if s <= step - _KEEP_STEPS]:
            del self._reports[old]
        if len(report) < self.world_size:
            return None
        del self._reports[step]
        median = statistics.median(report.values())
        slow = {rank for rank, busy in report.items() if busy > self.factor * median}
        self._streaks = {rank: self._streaks.get(rank, 0) + 1 for rank in slow}
        due = [rank for rank, streak in self._streaks.items() if streak >= self.steps]
        if not due:
            return None
        rank = max(due, key=lambda r: report[r])
        self.reset()
        return SlowRank(rank=rank, step=step, busy_s=report[rank], median_busy_s=median)

    def reset(self) -> None:
        """Forgets every report and streak (after a decision, and while the job is being
        changed: a migration or a recovery in progress)."""
        self._reports.clear()
        self._streaks.clear()
