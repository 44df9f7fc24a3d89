"""Step times for the run's timeline: what the agents report and the controller logs.

Every rank of a synchronous job ends a step within milliseconds of the others, so one rank's
step times stand for the job's: the agent of the host that runs global rank 0 (it may change
with a migration or a recovery) batches that rank's step ends (:class:`StepBatch`) and posts
them every :data:`REPORT_PERIOD_S` as one ``steps`` event, and when its workers stop or finish
or an alarm reaches them (so that the controller learns the last step before a failure that no
worker's exit report describes: a host lost with its agent).
The controller's :class:`StepTimeline` writes each batch into the event log as a ``steps``
record, ``steps`` being ``[step, end time, duration in seconds]`` triples. A step redone after a
rollback or a restart appears again, with its new times; the step at whose end rank 0 moves
to another process in a planned migration does not appear (the leaver hands the rank over
inside it and reports no end). ``mover report`` draws them
(:mod:`mover_plugin.launch.report`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Optional

from mover_plugin.launch.context import Context, Event, EventHandler, Unit

REPORT_PERIOD_S = 2.0
"""How often an agent posts the step ends it collected (a few events per second at most for
the whole job, whatever its size)."""

TIMED_RANK = 0
"""The global rank whose step ends are reported."""


class StepBatch:
    """An agent's step ends of :data:`TIMED_RANK` since its last ``steps`` event."""

    def __init__(self, post: Callable[..., None], period_s: float = REPORT_PERIOD_S) -> None:
        self._post = post
        self._period_s = period_s
        self._pending: list[list[float]] = []
        self._last_post = time.monotonic()

    def add(self, rank: Optional[int], step: int, end: float, duration_s: float) -> None:
        if rank == TIMED_RANK:
            self._pending.append([step, round(end, 6), round(duration_s, 6)])

    def post_if_due(self) -> None:
        if time.monotonic() - self._last_post >= self._period_s:
            self.post()

    def post(self) -> None:
        """Posts what was collected (nothing when there is nothing)."""
        self._last_post = time.monotonic()
        if self._pending:
            self._post("steps", steps=self._pending)
            self._pending = []


class StepTimeline(Unit):
    """Writes the reported step ends into the event log, and tells its listeners of them."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._listeners: list[Callable[[list[list[float]]], None]] = []
        self._last_step: dict[int, int] = {}
        """Per attempt: the latest step reported."""

    def when_reported(self, listener: Callable[[list[list[float]]], None]) -> None:
        """``listener`` hears every batch of step ends (the controller drops those of an
        earlier attempt)."""
        self._listeners.append(listener)

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"steps": self._on_steps}

    def _on_steps(self, event: Event) -> Optional[int]:
        fields: dict[str, Any] = {"attempt": event["attempt"], "steps": event["steps"]}
        self._ctx.record("steps", "job", when=event["time"], recent=False, **fields)
        attempt = event["attempt"]
        self._last_step[attempt] = max([self._last_step.get(attempt, 0),
                                        *(int(step[0]) for step in event["steps"])])
        for listener in self._listeners:
            listener(event["steps"])
        return None

    @property
    def last_step(self) -> int:
        """The latest step of the current attempt reported (0 before any)."""
        return self._last_step.get(self._ctx.attempt.number, 0)
