"""Interruption timing and the JSON run summary written by ``mover-launch --summary``.

An interruption moves through phases, each stamped with wall-clock time:

* ``failed`` — the signal was delivered (injected failures) or, for a failure nobody injected,
  when it was detected;
* ``detected`` — the agent saw the worker exit (or declared it hung); for a host lost with
  its agent, ``failed`` is when it was last known alive (its last heartbeat seen, or rank 0's
  last step end before the loss was found, whichever is later: that step needed every rank)
  and ``detected`` when the controller declared it lost;
* resilient policy: ``alarm`` — the controller posted the next generation's plan and the alarm;
  ``left`` — every survivor had left the failed step; ``switched`` — every rank, the
  replacement included, runs in the new generation;
* restart policy: ``stopped`` — every other worker was stopped; ``started`` — the new workers
  were started; ``recovered`` — every rank is ready to train again (checkpoint loaded);
* planned migration: ``requested`` — the controller accepted the migration; ``prepared`` —
  every joiner and every staying rank has its new groups ready (phase 1 done); ``boundary`` —
  every rank ended the iteration at which they switch; ``handed_over`` — every leaver sent
  its state; ``switched``;
* ``first_step_completed`` — every rank completed its first step after the interruption.

``phases_s`` are seconds after ``failed`` (``requested`` for a migration). ``downtime_s`` is
the time training stood still: the gap between the last step completed
before the failure and the first step completed after it, less one normal step time (the
duration of that last step before the failure). An interruption that costs less than the
steps' jitter (a planned migration can) may come out slightly negative.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

HOST_LOSS = "host_loss"

PHASES = ("failed", "requested", "detected", "alarm", "left", "prepared", "boundary",
          "handed_over", "switched", "stopped", "started", "recovered", "first_step_completed")


@dataclass
class Interruption:
    kind: str
    """``failure``: a worker died (crash, kill, or any non-zero exit); ``hang``: a worker
    stopped sending heartbeats and was killed; ``host_loss``: a host was lost with its agent
    (every rank on it); ``migration``: a planned move of ranks."""
    rank: int
    """The rank that failed (the first of ``ranks``)."""
    step: int
    """The step the rank was running when it failed (1-based; 0 before the first step); for
    a migration, the step at whose end the ranks switched."""
    how: str
    """The exit as the agent saw it, e.g. ``signal SIGKILL`` or ``exit code 1``."""
    injected: bool
    attempt: int
    recovery: str = "restart"
    """``standby`` (a standby took the rank's place in-process), ``shrink`` (no standby was
    ready: the survivors went on alone, on pipeline templates) or ``restart``."""
    plan: Optional[str] = None
    """For a ``shrink``: the survivors' pipelines, e.g. ``[0 2] layers 0-2|3 x 2 + [1]
    layers 0-3 x 2`` (each pipeline's ranks in the new world, layers per stage, and
    micro-batches of the global batch); for a ``grow``, the job's own layout in the same
    form."""
    generation: int = 0
    ranks: list[int] = field(default_factory=list)
    """Every rank the interruption took (``[rank]`` unless a host loss or a migration took
    several)."""
    times: dict[str, float] = field(default_factory=dict)
    left_s: dict[int, float] = field(default_factory=dict)
    """Per survivor: seconds from the failure until it left the failed step."""
    last_step_before: Optional[float] = None
    step_time_before: Optional[float] = None
    typical_step_s: Optional[float] = None
    """The median duration of the steps rank 0 reported before the interruption ended: a
    last step before it that was slower (the one after a migration's switch) is not what the
    step would have taken without the interruption."""
    rolled_back_to: Optional[int] = None
    """The checkpoint's step every rank went back to, when the ranks could not continue in
    place (DeepSpeed, a lost optimizer shard that no live rank holds)."""
    inexact: Optional[str] = None
    """Why the training after this interruption may differ from the run without it (a rank
    said so when it recovered); None when the recovery is exact."""

    def __post_init__(self) -> None:
        self.ranks = self.ranks or [self.rank]

    def mark(self, phase: str, when: float) -> None:
        assert phase in PHASES, phase
        self.times.setdefault(phase, when)

    @property
    def downtime_s(self) -> Optional[float]:
        """From the end of the last step before the interruption to the end of the first step
        after it, less one step's time: the step time before it, or the typical one where
        that is shorter."""
        after = self.times.get("first_step_completed")
        if after is None or self.last_step_before is None:
            return None
        step_s = self.step_time_before or 0.0
        if self.typical_step_s is not None:
            step_s = min(step_s, self.typical_step_s)
        return after - self.last_step_before - step_s

    def to_dict(self) -> dict:
        origin = self.times.get("failed", self.times.get("requested"))
        return {
            "kind": self.kind,
            "rank": self.rank,
            "ranks": list(self.ranks),
            "step": self.step,
            "how": self.how,
            "injected": self.injected,
            "attempt": self.attempt,
            "generation": self.generation,
            "recovery": self.recovery,
            "plan": self.plan,
            "rolled_back_to": self.rolled_back_to,
            "inexact": self.inexact,
            "times": {p: self.times[p] for p in PHASES if p in self.times},
            "phases_s": {
                p: round(self.times[p] - origin, 6)
                for p in PHASES
                if p in self.times and origin is not None
            },
            "left_s": {str(r): round(t, 6) for r, t in sorted(self.left_s.items())},
            "downtime_s": None if self.downtime_s is None else round(self.downtime_s, 6),
        }


@dataclass
class Refill:
    """A standby started to bring the pool back to its target after a promotion."""

    standby: str
    node: int
    requested_at: float
    ready_at: Optional[float] = None
    lost_at: Optional[float] = None
    """When it exited before it was ready."""
    stopped_at: Optional[float] = None
    """When the job began to end before it was ready (its agent stopped it)."""


@dataclass
class RunSummary:
    policy: str
    world_size: int
    command: list[str]
    started_at: float
    finished_at: Optional[float] = None
    exit_code: Optional[int] = None
    steps_completed: Optional[int] = None
    restarts: int = 0
    worker_peak_rss_mb: Optional[float] = None
    """The largest peak resident memory of any worker that completed the job."""
    median_step_time_s: Optional[float] = None
    """The median over ranks of each rank's median step time (last attempt)."""
    median_cpu_per_step_s: Optional[float] = None
    """The median over ranks of each rank's CPU seconds per step (all its threads, from its
    first step end to its last; last attempt): unlike the step time, not stretched by waiting
    for a core or for the other ranks."""
    interruptions: list[Interruption] = field(default_factory=list)
    refills: list[Refill] = field(default_factory=list)
    rejected_events: int = 0
    """Events the controller did not act on because they were unknown or malformed (each is
    in the event log as ``event_rejected``, with the reason)."""
    refused_connections: int = 0
    """Connections to the job's port refused for want of the job's secret (each is in the
    event log as ``connection_refused``, with the peer and the reason)."""

    @property
    def wall_time_s(self) -> Optional[float]:
        return None if self.finished_at is None else self.finished_at - self.started_at

    def to_dict(self) -> dict:
        data = asdict(self)
        data["wall_time_s"] = self.wall_time_s
        data["interruptions"] = [i.to_dict() for i in self.interruptions]
        data["total_downtime_s"] = sum(i.downtime_s or 0.0 for i in self.interruptions)
        return data

    def write(self, path: str | Path) -> None:
        """Writes the summary atomically (a partial file never replaces a previous one)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        temporary.replace(path)
