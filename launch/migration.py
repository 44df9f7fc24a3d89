"""Planned migration: the controller's unit that coordinates a generation switch it starts itself.

A planned migration (``mover migrate``, :mod:`mover_plugin.launch.jobctl`; an injected one; or
the slow-rank policy) plans generation ``g + 1`` with ready standbys in the leaving ranks'
places (each leaving rank is its joiner's source of state), promotes them at once and posts
the ``prepare`` notice to generation ``g`` (phase 1, while training goes on: the joiners build
their groups and model, the other ranks the next generation's version of their groups that
hold a leaving rank); when all of them report ready it posts the ``switch`` notice; the ranks
end the iteration in which they all saw it (phase 2), the leavers hand their state over, and
once every rank has ended that iteration the controller commits the switch (``gen{g}/next``
and ``gen{g+1}/switch``): the leavers exit, the others put the new groups in place. A process
lost before that point calls the migration off — the other processes go on in generation
``g`` and the loss is recovered like any crash — and one lost after it abandons the
migration's unfinished hand-overs or waits for them (see :meth:`Migrations.claim_failure`).
The request gets its second answer (``request/{id}/done``) when training runs on the new
processes, or when the migration fails.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from mover_plugin.contract import (
    SWITCH_CANCEL,
    SWITCH_GO,
    GenerationPlan,
    PlanKind,
    request_done_key,
    successor_key,
    switch_decision_key,
)
from mover_plugin.generations import Membership, Replacement
from mover_plugin.launch.context import Context, Event, EventHandler, Unit
from mover_plugin.launch.recovery import HANDLED, Claim, CrashRecovery
from mover_plugin.launch.summary import Interruption

logger = logging.getLogger(__name__)


@dataclass
class Migration:
    """A planned migration from its acceptance until training runs on the joiners."""

    request_id: str
    plan: list[Replacement]
    old_generation: int
    generation: int
    """The generation the migration forms."""
    interruption: Interruption
    prepared: set[int] = field(default_factory=set)
    """Joiners whose groups and model are built."""
    groups_prepared: set[int] = field(default_factory=set)
    """Ranks that stay whose part of the next generation's groups is built."""
    boundary: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Per rank of the old generation: when it ended its last step there, and that step's
    duration."""
    handed_over: set[int] = field(default_factory=set)
    switch_posted: bool = False
    committed: bool = False
    """Set once every rank of the old generation ended the switch iteration: the point of no
    return, from which the processes switch to :attr:`generation`."""
    deferred: list[Event] = field(default_factory=list)
    """Failures of staying ranks during phase 2, recovered once the hand-over completes."""
    before: tuple[Membership, dict[int, int]] = field(
        default_factory=lambda: (Membership(0, {}), {}))
    """The membership and the ranks' nodes before, restored if the migration is cancelled."""

    @property
    def ranks(self) -> list[int]:
        return [item.rank for item in self.plan]

    def state(self) -> str:
        if not self.switch_posted:
            return "phase 1: joiners and the other ranks preparing the new groups"
        if not self.committed:
            return "phase 2: ending the switch iteration"
        if len(self.handed_over) < len(self.plan):
            return "phase 2: handing the ranks over"
        return "phase 2: waiting for the first step on the new processes"


class Migrations(Unit):
    """Coordinates at most one planned migration at a time."""

    def __init__(self, ctx: Context, recovery: CrashRecovery) -> None:
        self._ctx = ctx
        self._recovery = recovery
        self._migration: Optional[Migration] = None

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"prepared": self._on_prepared, "groups_prepared": self._on_groups_prepared,
                "boundary": self._on_boundary, "switch_cancelled": self._on_switch_cancelled,
                "left": self._on_left, "leaver_exit": self._on_leaver_exit}

    @property
    def current(self) -> Optional[Migration]:
        """The migration in progress, if any."""
        return self._migration

    def status(self) -> list[dict[str, Any]]:
        """The migrations in progress, as ``mover status`` shows them."""
        migration = self._migration
        return [] if migration is None else [{
            "ranks": migration.ranks, "standbys": [item.standby for item in migration.plan],
            "state": migration.state()}]

    def begin(self, request_id: str, plan: list[Replacement],
              fault: Optional[str] = None) -> None:
        """Starts phase 1 of an accepted migration."""
        ctx, now = self._ctx, time.time()
        before = (ctx.job.membership, dict(ctx.job.node_of_rank))
        ctx.job.membership = ctx.job.membership.next_generation(plan)
        old = ctx.plan_generation(GenerationPlan(PlanKind.MIGRATION, ctx.config.world_size,
                                                 replacements=tuple(plan), fault=fault),
                                  link=False)
        interruption = Interruption(kind="migration", rank=plan[0].rank, step=0, how="planned",
                                    injected=False, attempt=ctx.attempt.number,
                                    recovery="standby", generation=ctx.job.generation,
                                    ranks=[item.rank for item in plan])
        interruption.mark("requested", now)
        ctx.summary.interruptions.append(interruption)
        ctx.job.interruption = interruption
        self._migration = Migration(request_id, plan, old, ctx.job.generation, interruption,
                                    before=before)
        ctx.job.leaving_ranks = {item.rank: before[1][item.rank] for item in plan}
        ctx.promote(plan, migration=True)
        ctx.notify(old, "prepare", next=ctx.job.generation)
        for item in plan:
            ctx.record("migration_requested", "migrate", rank=item.rank, when=now,
                       standby=item.standby, node=item.node, pool=len(ctx.attempt.pool))
        logger.info("generation %d (migration): %s", ctx.job.generation,
                    ", ".join(f"rank {i.rank} -> standby {i.standby}" for i in plan))

    def on_resumed(self, item: Interruption) -> None:
        """Training runs again after ``item``: a migration's request is done."""
        if self._migration is not None and self._migration.interruption is item:
            self._end(ok=True)

    def end_of_job(self) -> None:
        """The job ended right after (or before) a switch."""
        if self._migration is not None:
            switched = "switched" in self._migration.interruption.times
            self._end(ok=switched, error=None if switched else
                      "the job ended before the migration completed")

    # -- phase 1 ----------------------------------------------------------------------------

    def _on_prepared(self, event: Event) -> Optional[int]:
        """A promoted standby has its groups and model built."""
        migration = self._migration
        if migration is None or event["generation"] != self._ctx.job.generation:
            return None
        migration.prepared.add(event["rank"])
        self._ctx.record("joiner_prepared", "migrate", rank=event["rank"], when=event["time"])
        self._switch_when_prepared(migration, event["time"])
        return None

    def _on_groups_prepared(self, event: Event) -> Optional[int]:
        """A rank that stays has built its part of the next generation's groups."""
        migration = self._migration
        if migration is None or event["generation"] != self._ctx.job.generation:
            return None
        migration.groups_prepared.add(event["rank"])
        self._ctx.record("groups_prepared", "migrate", rank=event["rank"], when=event["time"],
                         build_s=event["build_s"], rebuilt=event["rebuilt"], kept=event["kept"])
        self._switch_when_prepared(migration, event["time"])
        return None

    def _switch_when_prepared(self, migration: Migration, now: float) -> None:
        """With every joiner and every staying rank prepared, the switch is due (phase 2)."""
        staying = self._ctx.config.world_size - len(migration.plan)
        if (migration.switch_posted or len(migration.prepared) < len(migration.plan)
                or len(migration.groups_prepared) < staying):
            return
        migration.switch_posted = True
        migration.interruption.mark("prepared", now)
        self._ctx.notify(migration.old_generation, "switch")

    # -- phase 2 ----------------------------------------------------------------------------

    def _on_boundary(self, event: Event) -> Optional[int]:
        """A rank of the old generation ended its last step there."""
        migration = self._migration
        if migration is None or event["migration"] != migration.generation:
            return None  # a late report of a migration that was cancelled
        migration.boundary[event["rank"]] = (event["time"], event["step_s"])
        self._ctx.record("boundary", "migrate", generation=event["generation"],
                         rank=event["rank"], when=event["time"], iteration=event["iteration"])
        if len(migration.boundary) == self._ctx.config.world_size:
            last, step_s = max(migration.boundary.values())
            migration.interruption.mark("boundary", last)
            migration.interruption.step = event["iteration"]
            migration.interruption.last_step_before = last
            migration.interruption.step_time_before = step_s
            self._commit_switch(migration)
        return None

    def _commit_switch(self, migration: Migration) -> None:
        """Every rank ended the switch iteration: the point of no return. The old
        generation's processes switch to the migration's (the leavers exit once handed
        over)."""
        migration.committed = True
        self._ctx.store.set(successor_key(migration.old_generation), str(migration.generation))
        self._ctx.store.set(switch_decision_key(migration.generation), SWITCH_GO)
        self._ctx.record("switch_committed", "migrate", generation=migration.generation,
                         ranks=migration.ranks)

    def _on_switch_cancelled(self, event: Event) -> Optional[int]:
        """A rank that had ended the switch iteration goes on in its generation: the
        migration was cancelled before its point of no return."""
        self._ctx.record("switch_cancelled", "migrate", generation=event["generation"],
                         rank=event["rank"], when=event["time"], migration=event["migration"])
        return None

    def _on_left(self, event: Event) -> Optional[int]:
        """A leaving rank handed its state to its joiner."""
        migration = self._migration
        if migration is None or event["migration"] != migration.generation:
            return None  # a hand-over of a migration that was cancelled
        migration.handed_over.add(event["rank"])
        self._ctx.job.leaving_ranks.pop(event["rank"], None)
        self._ctx.record("handed_over", "migrate", generation=event["generation"],
                         rank=event["rank"], when=event["time"],
                         handover_s=event.get("handover_s"), transfer_s=event.get("transfer_s"))
        if len(migration.handed_over) < len(migration.plan):
            return None
        migration.interruption.mark("handed_over", event["time"])
        if not migration.deferred:
            return None
        self._end(ok=True)
        for deferred in migration.deferred:
            outcome = self._recovery.on_failure(deferred)
            if outcome is not None:
                return outcome
        return None

    def _on_leaver_exit(self, event: Event) -> Optional[int]:
        """A process that was handing its rank over exited: harmless once it has, a failure
        of the rank before (or the end of training, if it finished its steps first)."""
        migration = self._migration
        if (migration is not None and event["rank"] in migration.ranks
                and event["rank"] not in migration.handed_over):
            if event["returncode"] != 0:
                return self._recovery.on_failure(event, leaver=True)
            if not migration.boundary:
                self._cancel(f"rank {event['rank']} finished training before the switch")
                return None
        self._ctx.record("leaver_exit", "migrate", rank=event["rank"], when=event["time"],
                         how=event["how"])
        return None

    # -- exits of ranks while a migration is under way (a recovery Coordinator) -------------

    def rank_finished(self, rank: int) -> None:
        if self._migration is not None and not self._migration.boundary:
            self._cancel(f"rank {rank} finished training before the switch")

    def claim_failure(self, event: Event, *, leaver: bool) -> Claim:
        """A process died while a migration was under way: :data:`HANDLED` (the job goes on
        without a recovery now) or the ranks to recover with standbys; None without a
        migration.

        Before the point of no return (phase 1, or phase 2 until every rank has ended the
        switch iteration) the migration is called off: the processes of the old generation go
        on in it — those that ended the switch iteration learn it from the switch decision —
        and a lost rank of theirs is recovered from there, like any crash. After it, the lost
        process's rank is recovered in the migration's generation: at once if its hand-over had
        not completed (the migration is abandoned), or once the hand-overs are done.
        """
        migration = self._migration
        if migration is None:
            return None
        rank, moving = event["rank"], event["rank"] in migration.ranks
        joiner = moving and not leaver
        if not migration.committed:
            return self._lost_before_commit(migration, event, joiner=joiner, leaver=leaver)
        if len(migration.handed_over) == len(migration.plan):
            self._end(ok=True)  # the ranks had moved; this is an ordinary failure
            return [rank]
        if moving:  # a leaver or joiner before its hand-over completed
            self._abandon(migration, f"the {'joiner' if joiner else 'leaver'} of rank {rank} "
                                     f"was lost before the hand-over ({event['how']}); the "
                                     "rank is recovered from a data-parallel twin")
            return [r for r in migration.ranks if r not in migration.handed_over]
        migration.deferred.append(event)  # a staying rank: it had ended the switch iteration
        self._ctx.record("failure_deferred", "migrate", rank=rank, when=event["time"],
                         reason="recovered once the hand-over in progress completes")
        return HANDLED

    def _lost_before_commit(self, migration: Migration, event: Event, *, joiner: bool,
                            leaver: bool) -> Claim:
        rank = event["rank"]
        where = ("in phase 1" if not migration.switch_posted else
                 "in phase 2 before every rank had ended the switch iteration")
        process = "the joiner of " if joiner else "the leaver of " if leaver else ""
        self._cancel(f"{process}rank {rank} was lost {where} ({event['how']})", failed=True)
        if not joiner:
            return [rank]
        self._ctx.record("joiner_lost", "migrate", rank=rank, when=event["time"],
                         how=event["how"])
        return HANDLED

    # -- the end of a migration -------------------------------------------------------------

    def _cancel(self, reason: str, *, failed: bool = False) -> None:
        """Before the switch (training ended, or a process was lost in phase 1): the joiners
        are stopped, the ranks stay, the processes stay in the old generation (the planned one
        is skipped: its namespace is never reused)."""
        migration, ctx = self._migration, self._ctx
        if migration is None:
            return
        # Ranks that ended the switch iteration wait for this decision (none in phase 1).
        ctx.store.set(switch_decision_key(migration.generation), SWITCH_CANCEL)
        for item in migration.plan:
            ctx.command("cancel_promotion", standby=item.standby, rank=item.rank)
        ctx.job.membership, ctx.job.node_of_rank = migration.before
        ctx.restore_generation(migration.old_generation)
        if ctx.job.interruption is migration.interruption:
            ctx.job.interruption = None
        if not failed:
            ctx.summary.interruptions.remove(migration.interruption)
        self._end(ok=False, error=f"cancelled: {reason}")

    def _abandon(self, migration: Migration, reason: str) -> None:
        """Phase 2 failed: the leavers and joiners of ranks not yet handed over are stopped."""
        for item in migration.plan:
            if item.rank not in migration.handed_over:
                self._ctx.command("discard_leaver", rank=item.rank)
                self._ctx.command("cancel_promotion", standby=item.standby, rank=item.rank)
        self._end(ok=False, error=f"abandoned: {reason}")
        logger.warning("migration abandoned: %s", reason)

    def _end(self, *, ok: bool, error: Optional[str] = None) -> None:
        """Answers the migration's request a second time: done, or failed with ``error``."""
        migration, self._migration = self._migration, None
        if migration is None:
            return
        self._ctx.job.leaving_ranks = {}
        outcome: dict[str, Any] = {"ok": ok, "generation": self._ctx.job.generation}
        if ok:
            outcome["downtime_s"] = migration.interruption.downtime_s
        else:
            outcome["error"] = error
        self._ctx.store.set(request_done_key(migration.request_id), json.dumps(outcome))
        self._ctx.record("migration_done" if ok else "migration_failed", "migrate",
                         ranks=migration.ranks, downtime_s=outcome.get("downtime_s"),
                         error=error)
