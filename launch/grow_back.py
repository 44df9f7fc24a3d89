"""Growing back: the controller's unit that returns a shrunk job to its own layout.

After a shrink (:mod:`mover_plugin.launch.recovery`: a rank lost with no standby ready, the
survivors training on pipeline templates) the lost ranks' slots are refilled like those of any
crash (:mod:`mover_plugin.launch.refill`). Once the pool holds a ready standby for every lost
rank, and no interruption is in progress, this unit plans the generation that grows back
(:func:`mover_plugin.shrink.plan_grow`): the job's own layout on all its ranks, each standby in
a lost rank's place, and the moves that bring every rank the layers it lacks, with their Adam
state, from a survivor. It publishes the plan, promotes the standbys, and sends the shrunk
generation a *switch* notice: the survivors agree in the iteration they train (their loss
all-reduce carries who saw it) and switch at its end, an iteration boundary. The summary
records the change as an interruption of kind ``grow`` (from the request to the first step
completed on the job's layout), and the attempt no longer counts as shrunk once every rank
completed that step.

A rank lost while the job grows back restarts the job (the attempt still counts as shrunk).
A survivor that finishes training before any rank switched (the request came in the last
steps) calls the growing back off: the standbys' promotions are cancelled (their agents stop
them), the job stays in its shrunk generation and ends shrunk, and the summary keeps no
interruption for it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Mapping, Optional

from mover_plugin.contract import SWITCH, GenerationPlan, PlanKind
from mover_plugin.generations import Membership, Replacement, plan_return
from mover_plugin.launch.context import Context, Event, EventHandler, Unit
from mover_plugin.launch.recovery import HANDLED, Claim
from mover_plugin.launch.summary import Interruption
from mover_plugin.shrink import plan_grow

logger = logging.getLogger(__name__)

GROWTH = PlanKind.GROW.value
"""The kind (and recovery) of the summary's interruption for growing back."""


class GrowBack(Unit):
    """Also a :class:`~mover_plugin.launch.recovery.Coordinator`: the end of training and the
    exit of a standby it gave up concern it first."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._growing: Optional[_Growing] = None
        """The growing back under way (of the current attempt)."""
        self._abandoned: set[str] = set()
        """The standbys of a growing back that was called off."""

    def handlers(self) -> Mapping[str, EventHandler]:
        return {}  # it hears of ready standbys and resumed training from the other units

    def standby_ready(self, standby: str) -> None:
        self.grow_if_possible()

    def on_resumed(self, item: Interruption) -> None:
        """Training runs again: a grow back is complete, or one may start now."""
        if item.kind == GROWTH:
            self._growing = None
            self._ctx.attempt.shrunk = None
            self._ctx.record("grown", "grow", generation=item.generation,
                             downtime_s=item.downtime_s)
            logger.info("the job runs on its own layout again")
            return
        self.grow_if_possible()

    def grow_if_possible(self) -> Optional[int]:
        """Starts growing back when the job is shrunk, nothing else is under way, and the pool
        has a standby for every lost rank; returns the new generation, or None."""
        ctx = self._ctx
        shrunk = ctx.attempt.shrunk
        if (shrunk is None or ctx.interrupted() or ctx.attempt.ending
                or self._current() is not None):
            return None
        layout, spec = ctx.layout(), ctx.template_spec()
        assert layout is not None and spec is not None, "a shrunk job published both"
        before = _Growing(ctx.attempt.number, ctx.job.generation, ctx.job.membership,
                          dict(ctx.job.node_of_rank))
        plan = plan_return(shrunk.lost, ctx.attempt.pool, ctx.job.node_of_rank)
        if plan is None:
            return None
        job, moves = plan_grow(shrunk, layout, spec)
        ctx.job.membership = ctx.job.membership.next_generation(plan)
        old = ctx.plan_generation(GenerationPlan(
            PlanKind.GROW, ctx.config.world_size, replacements=tuple(plan),
            survivors=shrunk.survivors, moves=tuple(moves), describe=job.describe()))
        now = time.time()
        item = Interruption(kind=GROWTH, rank=plan[0].rank, step=0, how="standby ready",
                            injected=False, attempt=ctx.attempt.number, recovery=GROWTH,
                            generation=ctx.job.generation, ranks=[r.rank for r in plan],
                            plan=job.describe())
        item.mark("requested", now)
        ctx.summary.interruptions.append(item)
        ctx.job.interruption = item
        ctx.promote(plan, migration=False)
        before.plan, before.interruption = plan, item
        self._growing = before
        ctx.notify(old, SWITCH)
        ctx.record("grow", "grow", when=now, ranks=item.ranks,
                   standbys=[r.standby for r in plan], plan=job.describe(), moved=len(moves))
        logger.warning("generation %d: growing back to the job's layout %s (standbys %s)",
                       ctx.job.generation, job.describe(),
                       ", ".join(f"{r.standby} -> rank {r.rank}" for r in plan))
        return ctx.job.generation

    # -- as a coordinator of the crash recovery ---------------------------------------------

    def rank_finished(self, rank: int) -> None:
        """A survivor finished training before any rank switched: the growing back is off
        (once one has switched, all will: the survivors agreed in the same iteration)."""
        growing = self._current()
        if growing is not None and rank not in {item.rank for item in growing.plan} and (
                not self._ctx.generation.switched):
            self._abandon(growing, f"rank {rank} finished training before the switch")

    def claim_failure(self, event: Event, *, leaver: bool) -> Claim:
        """A standby of a growing back that was called off exits: nothing to recover."""
        return HANDLED if event.get("standby") in self._abandoned else None

    def _current(self) -> Optional["_Growing"]:
        """The growing back under way, if it belongs to the current attempt (a restart
        forgets it)."""
        growing = self._growing
        if growing is not None and growing.attempt != self._ctx.attempt.number:
            self._growing = growing = None
        return growing

    def _abandon(self, growing: "_Growing", why: str) -> None:
        """The standbys are stopped, and the job stays in its shrunk generation (the planned
        one is skipped: its namespace is never reused)."""
        ctx = self._ctx
        for item in growing.plan:
            ctx.command("cancel_promotion", standby=item.standby, rank=item.rank)
            self._abandoned.add(item.standby)
        ctx.job.membership, ctx.job.node_of_rank = growing.membership, growing.node_of_rank
        ctx.restore_generation(growing.generation)
        if ctx.job.interruption is growing.interruption:
            ctx.job.interruption = None
        ctx.summary.interruptions.remove(growing.interruption)
        ctx.record("grow_abandoned", "grow", ranks=[item.rank for item in growing.plan],
                   reason=why)
        logger.warning("growing back called off: %s", why)
        self._growing = None


@dataclass
class _Growing:
    """A growing back under way, and what it changed in the controller's view of the job."""

    attempt: int
    generation: int
    """The shrunk generation it leaves."""
    membership: Membership
    node_of_rank: dict[int, int]
    plan: list[Replacement] = field(default_factory=list)
    interruption: Optional[Interruption] = None
