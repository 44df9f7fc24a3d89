"""Interruption timing: the controller's unit that stamps each interruption's phases.

What the phases are is in :mod:`mover_plugin.launch.summary`. This unit keeps what classifies
and times a failure before any unit acts on it (the injected signals, the ranks found hung,
when each survivor left the failed step), opens the interruption of a failure
(:meth:`InterruptionTiming.record_failure`), marks the phases the workers' reports end
(``left``, ``switched``, ``started``, ``recovered``) and closes the interruption in progress
once every rank completed a step after it, telling the units that wait for that
(:meth:`InterruptionTiming.when_resumed`).
"""

from __future__ import annotations

import collections
import logging
import statistics
from typing import Callable, Mapping, Optional

from mover_plugin.launch.context import Context, Event, EventHandler, Unit
from mover_plugin.launch.summary import HOST_LOSS, Interruption

logger = logging.getLogger(__name__)

TYPICAL_OF_STEPS = 32
"""How many of rank 0's latest step durations make the typical step time."""

ResumeListener = Callable[[Interruption], None]
"""Called with an interruption once training runs again after it."""


def note_last_step(interruption: Interruption, workers: list[Event]) -> None:
    """Keeps in ``interruption`` the latest step end (and its duration) among ``workers``'
    progress reports."""
    for worker in workers:
        end = worker.get("last_step_end")
        if end is not None and (interruption.last_step_before is None
                                or end > interruption.last_step_before):
            interruption.last_step_before = end
            interruption.step_time_before = worker.get("last_step_duration")


class InterruptionTiming(Unit):
    ANY_ATTEMPT = frozenset({"injected"})
    """An injection is kept with its attempt: only a failure of that attempt matches it."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._injected: dict[tuple[int, int], Event] = {}
        self._hung: set[Optional[int]] = set()
        self._left: dict[int, dict[int, float]] = {}
        """Per generation: when each survivor left its failed step (it may report before the
        agent reports the failure)."""
        self._resumed: list[ResumeListener] = []
        self._latest_step: Optional[tuple[float, float]] = None
        """The latest step end of rank 0 reported, with its duration."""
        self._durations: collections.deque[float] = collections.deque(maxlen=TYPICAL_OF_STEPS)
        """The durations of rank 0's latest steps reported."""

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"injected": self._on_injected, "hung": self._on_hung,
                "left_step": self._on_left_step, "switched": self._on_switched,
                "rolled_back": self._on_rolled_back, "caught_up": self._on_caught_up,
                "started": self._on_started,
                "ready": self._on_ready, "first_step": self._on_first_step}

    def when_resumed(self, listener: ResumeListener) -> None:
        """Calls ``listener`` each time an interruption ends (in the order registered)."""
        self._resumed.append(listener)

    def record_failure(self, event: Event, *,
                       ranks: Optional[list[int]] = None) -> Interruption:
        """Opens the interruption of a failed worker (``worker_exit`` or ``leaver_exit``), or
        with ``ranks`` of a host lost with its agent (``event`` then says when its last
        heartbeat was seen, ``time``, and when it was declared lost, ``detected``)."""
        ctx = self._ctx
        injected = self._injected.pop((event["rank"], event["attempt"]), None)
        hung = event["rank"] in self._hung
        self._hung.discard(event["rank"])  # a later failure of this rank is its replacement's
        interruption = Interruption(
            kind=HOST_LOSS if ranks is not None else "hang" if hung else "failure",
            rank=event["rank"],
            ranks=list(ranks) if ranks is not None else [event["rank"]],
            step=event["step_begun"],
            how=event["how"],
            injected=injected is not None,
            attempt=event["attempt"],
            generation=ctx.job.generation,
        )
        interruption.mark("failed", injected["time"] if injected else event["time"])
        interruption.mark("detected", event.get("detected", event["time"]))
        note_last_step(interruption, [event])
        if ranks is not None and self._latest_step is not None:
            self._note_step_before(interruption, [[0, *self._latest_step]])
        ctx.summary.interruptions.append(interruption)
        ctx.job.interruption = interruption
        return interruption

    def note_left(self, item: Interruption) -> None:
        """Copies the survivors' leave times of the interrupted generation into ``item``."""
        if item.recovery not in ("standby", "shrink") or "failed" not in item.times:
            return  # not a crash (a migration's ranks can also leave a step)
        failed = item.times["failed"]
        item.left_s = {rank: when - failed
                       for rank, when in self._left.get(item.generation - 1, {}).items()}
        survivors = len(self._ctx.job.membership.members) - (
            len(item.ranks) if item.recovery == "standby" else 0)
        if len(item.left_s) == survivors:
            item.mark("left", failed + max(item.left_s.values()))

    def on_steps(self, steps: list[list[float]]) -> None:
        """Rank 0's step ends, as reported (``[step, end, duration]``): a host loss, which no
        worker's exit report describes, takes its last step before the failure from them
        (those reported before it was found, and those after), and its ``failed`` too when
        that step ended after the host's last heartbeat seen."""
        for _, end, duration in steps:
            self._durations.append(duration)
            if self._latest_step is None or end > self._latest_step[0]:
                self._latest_step = (end, duration)
        item = self._ctx.job.interruption
        if item is not None and item.kind == HOST_LOSS:
            self._note_step_before(item, steps)

    @staticmethod
    def _note_step_before(item: Interruption, steps: list[list[float]]) -> None:
        """A step rank 0 ended before the host loss was found needed every rank, those of the
        lost host too: the host was alive then, so the failure came after it."""
        for _, end, duration in steps:
            if end < item.times["detected"] and (item.last_step_before is None
                                                 or end > item.last_step_before):
                item.last_step_before, item.step_time_before = end, duration
                item.times["failed"] = max(item.times["failed"], end)

    # -- detection --------------------------------------------------------------------------

    def _on_injected(self, event: Event) -> Optional[int]:
        self._injected[(event["rank"], event["attempt"])] = event
        return None

    def _on_hung(self, event: Event) -> Optional[int]:
        self._ctx.record("hung", "detect", rank=event["rank"], when=event["time"],
                         silent_s=event["silent_s"])
        self._hung.add(event["rank"])
        return None

    # -- a generation switch ----------------------------------------------------------------

    def _on_left_step(self, event: Event) -> Optional[int]:
        """A survivor left the failed step of generation ``event['generation']``."""
        self._ctx.record("left_step", "switch", generation=event["generation"],
                         rank=event["rank"], when=event["time"], cause=event.get("cause"))
        self._left.setdefault(event["generation"], {})[event["rank"]] = event["time"]
        if self._ctx.job.interruption is not None:
            self.note_left(self._ctx.job.interruption)
        return None

    def _on_switched(self, event: Event) -> Optional[int]:
        """A rank (survivor or replacement) runs in the new generation."""
        ctx = self._ctx
        if not self._note_report(ctx.generation.switched, event):
            return None
        extra = {key: event[key] for key in ("adopted", "rebuilt", "kept", "received_bytes")
                 if key in event}
        ctx.record("switched", "switch", generation=event["generation"], rank=event["rank"],
                   when=event["time"], role=event.get("role"), **extra)
        item = ctx.job.interruption
        if item is not None and isinstance(event.get("boundary_end"), (int, float)):
            # A switch at an iteration boundary (growing back): the last step before it is the
            # one that ended there.
            note_last_step(item, [{"last_step_end": event["boundary_end"],
                                   "last_step_duration": event.get("boundary_step_s")}])
            item.step = max(item.step, int(event.get("boundary_step", 0)))
        self._mark_when_all(ctx.generation.switched, "switched")
        return None

    def _on_rolled_back(self, event: Event) -> Optional[int]:
        """After a crash the ranks could not continue in place (a DeepSpeed job whose lost
        optimizer shard no live rank holds): each rolled back to the last checkpoint."""
        self._ctx.record("rolled_back", "switch", generation=event["generation"],
                         rank=event["rank"], when=event["time"], iteration=event["iteration"],
                         reason=event["reason"], load_s=event["load_s"],
                         inexact=event["inexact"])
        item = self._ctx.job.interruption
        if item is not None and item.rolled_back_to is None:
            item.rolled_back_to = event["iteration"]
            logger.info("rolled back to the checkpoint of step %d: %s", event["iteration"],
                        event["reason"])
        self._mark_inexact(event)
        return None

    def _mark_inexact(self, event: Event) -> None:
        """The interruption's recovery is inexact, as a rank's event says (its first such)."""
        item = self._ctx.job.interruption
        if item is not None and event["inexact"] is not None and item.inexact is None:
            item.inexact = f"rank {event['rank']}: {event['inexact']}"
            logger.warning("the recovery is inexact: %s", item.inexact)

    def _on_caught_up(self, event: Event) -> Optional[int]:
        """A joiner of an unmodified DeepSpeed script ran its script's loop through the steps
        the job trained before it came (mover_plugin.deepspeed.drop_in)."""
        self._ctx.record("caught_up", "switch", generation=event["generation"],
                         rank=event["rank"], when=event["time"], steps=event["steps"],
                         catch_up_s=event["catch_up_s"], replayed=event["replayed"],
                         inexact=event["inexact"])
        self._mark_inexact(event)
        return None

    # -- a restart and the first steps after any interruption -------------------------------

    def _on_started(self, event: Event) -> Optional[int]:
        started = self._ctx.attempt.started
        started[event["node"]] = event["time"]
        if set(started) == self._ctx.job.nodes and self._ctx.job.interruption is not None:
            self._ctx.job.interruption.mark("started", max(started.values()))
        return None

    def _on_ready(self, event: Event) -> Optional[int]:
        ctx = self._ctx
        if not self._note_report(ctx.generation.ready, event):
            return None
        ctx.record("worker_ready", "job", rank=event["rank"], when=event["time"])
        self._mark_when_all(ctx.generation.ready, "recovered")
        return None

    def _on_first_step(self, event: Event) -> Optional[int]:
        ctx = self._ctx
        if not self._note_report(ctx.generation.first_step, event):
            return None
        item = ctx.job.interruption
        if len(ctx.generation.first_step) == len(ctx.job.membership.members) and item is not None:
            ctx.job.interruption = None
            if self._durations:
                item.typical_step_s = statistics.median(self._durations)
            item.mark("first_step_completed", max(ctx.generation.first_step.values()))
            ctx.record("resumed", "resume", when=item.times["first_step_completed"],
                       downtime_s=item.downtime_s)
            logger.info("training resumed; downtime %.3f s", item.downtime_s or 0.0)
            for listener in self._resumed:
                listener(item)
        return None

    def _note_report(self, reports: dict[int, float], event: Event) -> bool:
        """Keeps in ``reports`` when ``event``'s rank reported, if the event is about the
        current generation (or names none); returns whether it is."""
        if event.get("generation", self._ctx.job.generation) != self._ctx.job.generation:
            return False
        reports[event["rank"]] = event["time"]
        return True

    def _mark_when_all(self, reports: dict[int, float], phase: str) -> None:
        """Marks ``phase`` of the interruption in progress once every rank reported it."""
        item = self._ctx.job.interruption
        if len(reports) == len(self._ctx.job.membership.members) and item is not None:
            item.mark(phase, max(reports.values()))
