"""Crash recovery: the controller's unit that recovers the job from a lost worker.

With the ``restart`` policy a failed worker makes the controller stop every worker and start
all again as a new attempt (up to ``max_restarts`` times); the script resumes from its latest
checkpoint.

A worker that reports an error of its own before it exits (``worker_error``: its training code
raised, and no alarm said a peer was lost) is not replaced in place whatever the policy: a
standby taking its rank would redo the same step and meet the same error. The job follows the
``restart`` path (a restart while ``max_restarts`` allows, then the end of the job), and the
event log names the error.

With the ``resilient`` policy, when a worker dies (or is found hung, and killed) the controller
plans generation ``g + 1`` (:func:`mover_plugin.generations.plan_recovery`): a ready standby
takes the lost global rank and copies a data-parallel twin. It publishes the plan
(``gen{g+1}/plan``), sends generation ``g`` an alarm notice (relayed by the agents: survivors
leave the failed step), and promotes the standby. Without a ready standby, a job that can train
on pipeline templates (its rank 0 published a :class:`~mover_plugin.shrink.TemplateSpec`)
*shrinks*: the survivors go on alone in generation ``g + 1``, on the planner's pipelines for
them (:func:`mover_plugin.shrink.plan_shrink`), and the agents forget the lost ranks. A rank
lost while the job trains on templates shrinks it again, from the templates (the pool's standbys
wait to grow it back), once every survivor of the shrink had moved onto them; a loss while it
grows back, or one the templates cannot cover, restarts. Otherwise, or without a twin, it falls
back to the restart policy, and the event log says why.

A unit that coordinates a change of the job (a planned migration) has the first say over a
failure while its change is under way: it registers as a :class:`Coordinator`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Literal, Mapping, Optional, Protocol, Union

from mover_plugin.contract import GenerationPlan, PlanKind
from mover_plugin.generations import Fallback, Replacement, plan_recovery
from mover_plugin.launch.attempts import Attempts
from mover_plugin.launch.context import AttemptPhase, Context, Event, EventHandler, Unit
from mover_plugin.launch.summary import Interruption
from mover_plugin.launch.timing import InterruptionTiming, note_last_step
from mover_plugin.shrink import ShrinkPlan, TemplateSpec, plan_shrink

logger = logging.getLogger(__name__)

HANDLED: Literal["handled"] = "handled"
Claim = Union[Literal["handled"], list[int], None]
"""A coordinator's answer about a failure: None (not its concern), :data:`HANDLED` (the job
goes on without a recovery now) or the ranks to recover."""


class Coordinator(Protocol):
    """A unit coordinating a change of the job that a rank's exit can affect."""

    def rank_finished(self, rank: int) -> None:
        """The worker of ``rank`` exited 0: it finished training."""

    def claim_failure(self, event: Event, *, leaver: bool) -> Claim:
        """A process died (``leaver``: one handing its rank over); see :data:`Claim`."""


class CrashRecovery(Unit):
    def __init__(self, ctx: Context, timing: InterruptionTiming, attempts: Attempts) -> None:
        self._ctx = ctx
        self._timing = timing
        self._attempts = attempts
        self._coordinators: list[Coordinator] = []
        self._own_errors: dict[tuple[int, int], str] = {}
        """(attempt, rank) -> the error a worker reported as its own before it exited."""
        self._finished: set[tuple[int, int]] = set()
        """(attempt, rank) of each worker that exited 0: its script ended."""
        self._slots_freed: list[Callable[[list[int]], None]] = []
        self._rank_finished: list[Callable[[int], None]] = []

    def when_slots_freed(self, listener: Callable[[list[int]], None]) -> None:
        """``listener`` hears, at each recovery in place, the node of each lost rank: a slot
        there is free, while a standby became a worker."""
        self._slots_freed.append(listener)

    def when_rank_finished(self, listener: Callable[[int], None]) -> None:
        """``listener`` hears of every worker of the current attempt that exited 0, after
        the coordinators."""
        self._rank_finished.append(listener)

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"worker_exit": self._on_worker_exit, "stopped": self._on_stopped,
                "worker_error": self._on_worker_error}

    def add_coordinator(self, coordinator: Coordinator) -> None:
        self._coordinators.append(coordinator)

    def on_failure(self, event: Event, *, leaver: bool = False) -> Optional[int]:
        """Recovers from the loss of ``event['rank']``'s process; returns the launcher's exit
        code when the job must end (no restart left)."""
        lost = self._lost_ranks(event, leaver)
        if lost is None:
            return None
        interruption = self._timing.record_failure(event)
        self._ctx.record("worker_failed", "detect", rank=event["rank"], when=event["time"],
                         how=event["how"], step=event["step_begun"], leaver=leaver or None)
        logger.warning("rank %d failed at step %d (%s)", event["rank"], event["step_begun"],
                       event["how"])
        return self._recover(event, lost, interruption)

    def on_host_lost(self, event: Event, ranks: list[int]) -> Optional[int]:
        """Recovers every rank of a host lost with its agent (``ranks``) in one generation;
        ``event`` describes the loss as a worker's exit would (``rank`` the first of them).
        Returns the launcher's exit code when the job must end."""
        if self._ctx.attempt.failed:
            return None  # a restart is under way; it places the host's ranks elsewhere
        lost: set[int] = set()
        for rank in ranks:
            claim = self._lost_ranks({**event, "rank": rank}, leaver=False)
            lost.update(claim or ())
        if not lost:
            return None
        interruption = self._timing.record_failure(event, ranks=ranks)
        return self._recover(event, sorted(lost), interruption)

    def _recover(self, event: Event, lost: list[int],
                 interruption: Interruption) -> Optional[int]:
        rank = event["rank"]
        own_error = self._own_errors.get((event["attempt"], rank))
        if own_error is not None:
            reason = (f"rank {rank} ended with an error of its own ({own_error}), not a lost "
                      "peer: a replacement would meet it again")
            self._ctx.record("fallback", "fallback", rank=rank, reason=reason)
            logger.error("%s; following the restart path", reason)
        elif self._ctx.config.policy == "resilient":
            plan = self._plan_in_place(lost, interruption)
            if plan is None:
                return None
            self._ctx.record("fallback", "fallback", rank=rank, reason=plan.reason)
            logger.warning("falling back to a restart: %s", plan.reason)
        return self._restart(interruption)

    def _plan_in_place(self, lost: list[int],
                       interruption: Interruption) -> Optional[Fallback]:
        """Recovers in the running job (standbys, or else a shrink onto pipeline templates);
        returns the reason it cannot, for the restart."""
        finished = sorted(rank for attempt, rank in self._finished
                          if attempt == self._ctx.attempt.number)
        if finished:  # a new generation's groups would wait for them forever
            return Fallback(f"rank(s) {finished} already finished the script, and a new "
                            "generation needs every rank")
        if self._ctx.attempt.shrunk is not None:  # the pool's standbys wait to grow it back
            return self._shrink_again(lost, interruption)
        unfinished = self._unfinished_joiners()
        plan = plan_recovery(lost, self._ctx.layout(), self._ctx.attempt.pool,
                             self._ctx.job.node_of_rank,
                             carried=[item for item in unfinished if item.rank not in lost])
        if not isinstance(plan, Fallback):
            self._switch_generation(plan, interruption, lost, rebuild_all=bool(unfinished))
            return None
        spec = self._ctx.template_spec()
        if spec is None or unfinished:
            return plan
        shrink = plan_shrink(lost, self._ctx.layout(), spec)
        if isinstance(shrink, ShrinkPlan):
            self._shrink(shrink, spec, interruption, lost, why=plan.reason)
            return None
        logger.warning("cannot shrink onto pipeline templates: %s", shrink.reason)
        return Fallback(f"{plan.reason}; {shrink.reason}")

    def _shrink_again(self, lost: list[int],
                      interruption: Interruption) -> Optional[Fallback]:
        """A loss while the job trains on pipeline templates: the survivors shrink again, from
        the templates' placement; returns the reason they cannot, for the restart."""
        ctx = self._ctx
        shrunk = ctx.attempt.shrunk
        assert shrunk is not None
        if shrunk.generation != ctx.job.generation:
            return Fallback("a rank was lost while the job grows back from pipeline templates")
        pending = sorted(set(shrunk.survivors) - set(ctx.generation.switched) - set(lost))
        if pending:  # their state is on neither side of the shrink for certain
            return Fallback(f"a rank was lost before rank(s) {pending} had moved onto the "
                            "pipeline templates")
        spec = ctx.template_spec()
        again = plan_shrink(lost, ctx.layout(), spec, shrunk)
        if isinstance(again, Fallback):
            logger.warning("cannot shrink again: %s", again.reason)
            return Fallback(f"a rank was lost while the job trains on pipeline templates; "
                            f"{again.reason}")
        assert spec is not None
        self._shrink(again, spec, interruption, lost,
                     why="a rank was lost while the job trains on pipeline templates")
        return None

    def _shrink(self, plan: ShrinkPlan, spec: TemplateSpec, interruption: Interruption,
                lost: list[int], *, why: str) -> None:
        """Starts the survivors' generation on pipeline templates, planned from ``spec``
        (``why``: no standby). The event log keeps the profile the plan came from."""
        ctx = self._ctx
        shrunk = plan.generation_plan()
        ctx.job.membership = ctx.job.membership.without(lost)
        old = ctx.plan_generation(shrunk)
        ctx.attempt.shrunk = dataclasses.replace(shrunk, generation=ctx.job.generation)
        ctx.notify(old, "alarm", reason=f"rank {interruption.rank} lost")
        ctx.command("drop", ranks=lost)
        ctx.command("generation", generation=ctx.job.generation)
        now = time.time()
        interruption.recovery = "shrink"
        interruption.plan = shrunk.describe
        interruption.generation = ctx.job.generation
        interruption.mark("alarm", now)
        self._timing.note_left(interruption)
        for listener in self._slots_freed:  # the lost ranks' slots: refills grow it back
            listener([ctx.job.node_of_rank[rank] for rank in lost])
        ctx.record("shrink", "switch", when=now, lost=lost, survivors=list(shrunk.survivors),
                   plan=shrunk.describe, moved=len(plan.moves), reason=why,
                   profile_source=spec.profile_source, profile=spec.profile)
        logger.warning("generation %d: ranks %s go on without rank(s) %s on pipeline templates "
                       "%s, planned from the %s profile (%s)", ctx.job.generation,
                       list(shrunk.survivors), lost, shrunk.describe, spec.profile_source, why)

    def _lost_ranks(self, event: Event, leaver: bool) -> Optional[list[int]]:
        """The ranks to recover, or None when a coordinator handled the failure."""
        for coordinator in self._coordinators:
            claim = coordinator.claim_failure(event, leaver=leaver)
            if claim == HANDLED:
                return None
            if claim is not None:
                return claim
        return [event["rank"]]

    def _unfinished_joiners(self) -> list[Replacement]:
        """The current generation's replacements (of a crash) that have not reported their
        switch: while any is left, some process may still be building that generation's
        groups or waiting for its state."""
        switched = self._ctx.generation.switched
        return [item for item in self._ctx.generation.joiners if item.rank not in switched]

    def _switch_generation(self, plan: list[Replacement], interruption: Interruption,
                           lost: list[int], *, rebuild_all: bool) -> None:
        """Starts the generation of ``plan``: the standbys of the ``lost`` ranks are promoted;
        a replacement carried over from a switch still under way keeps its standby. With
        ``rebuild_all`` (that switch was not complete, so its groups may exist on some ranks
        and not on others) every process rebuilds all its groups."""
        ctx = self._ctx
        fresh = [item for item in plan if item.rank in lost]
        freed = [ctx.job.node_of_rank[item.rank] for item in fresh]
        ctx.job.membership = ctx.job.membership.next_generation(plan)
        old = ctx.plan_generation(GenerationPlan(PlanKind.CRASH, ctx.config.world_size,
                                                 replacements=tuple(plan),
                                                 rebuild_all=rebuild_all))
        ctx.generation.joiners = list(plan)
        ctx.notify(old, "alarm", reason=f"rank {interruption.rank} lost")
        ctx.promote(fresh, migration=False)
        now = time.time()
        interruption.recovery = "standby"
        interruption.generation = ctx.job.generation
        interruption.mark("alarm", now)
        self._timing.note_left(interruption)
        for item in plan:
            ctx.record("promote" if item in fresh else "carried", "switch", rank=item.rank,
                       when=now, standby=item.standby, twin=item.twin,
                       pool=len(ctx.attempt.pool))
        logger.info("generation %d: %s", ctx.job.generation,
                    ", ".join(f"rank {i.rank} <- standby {i.standby} (twin {i.twin})"
                              for i in plan))
        for listener in self._slots_freed:
            listener(freed)

    def _restart(self, interruption: Interruption) -> Optional[int]:
        """Stops every worker of the attempt (they start again once all are stopped)."""
        ctx = self._ctx
        interruption.recovery = "restart"
        ctx.attempt.phase = AttemptPhase.RESTARTING
        if ctx.summary.restarts >= ctx.config.max_restarts:
            logger.error("no restart left (--max-restarts %d); stopping the job",
                         ctx.config.max_restarts)
            return 1
        if self._attempts.placement() is None:
            return self._attempts.cannot_place()
        ctx.command("stop", attempt=ctx.attempt.number)
        return None

    def _on_worker_exit(self, event: Event) -> Optional[int]:
        ctx = self._ctx
        if event["returncode"] == 0:
            self._finished.add((event["attempt"], event["rank"]))
            for coordinator in self._coordinators:
                coordinator.rank_finished(event["rank"])
            for listener in self._rank_finished:
                listener(event["rank"])
            return None
        if event.get("standby") is not None and (
                ctx.job.membership.members.get(event["rank"]) != event["standby"]):
            # A joiner stopped after its migration failed, exiting before it was reaped.
            ctx.record("discarded_exit", "migrate", rank=event["rank"],
                       standby=event["standby"], how=event["how"])
            return None
        if ctx.attempt.failed:  # a restart of this attempt is under way already
            logger.info("rank %d also exited (%s)", event["rank"], event["how"])
            return None
        return self.on_failure(event)

    def _on_worker_error(self, event: Event) -> Optional[int]:
        """A worker's training code raised with no lost peer behind it; its exit follows."""
        if event["rank"] is not None:
            self._own_errors[(event["attempt"], event["rank"])] = event["error"]
        self._ctx.record("worker_error", "detect", rank=event["rank"], error=event["error"])
        return None

    def _on_stopped(self, event: Event) -> Optional[int]:
        """An agent stopped its workers; once every agent has, the next attempt starts."""
        ctx = self._ctx
        ctx.attempt.stopped[event["node"]] = event["workers"]
        if ctx.job.interruption is not None:
            note_last_step(ctx.job.interruption, event["workers"])
        return self.restart_if_stopped()

    def restart_if_stopped(self) -> Optional[int]:
        """Starts the next attempt once every host in the job stopped its workers (a
        restart is under way); returns the launcher's exit code when it cannot start."""
        ctx = self._ctx
        if not ctx.attempt.failed or set(ctx.attempt.stopped) != ctx.job.nodes:
            return None
        if ctx.job.interruption is not None:
            ctx.job.interruption.mark("stopped", time.time())
        ctx.summary.restarts += 1
        ctx.record("restart", "restart")
        return self._attempts.start(ctx.attempt.number + 1)
