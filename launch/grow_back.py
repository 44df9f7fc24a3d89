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
A survivor that finishes training before the switch (the request came in the last steps)
calls the growing back off: the standbys' promotions are cancelled (their agents stop them),
and the job ends shrunk.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Optional

from mover_plugin.contract import SWITCH
from mover_plugin.generations import Replacement
from mover_plugin.launch.context import Context, Event, EventHandler, Unit
from mover_plugin.launch.recovery import HANDLED, Claim
from mover_plugin.launch.summary import Interruption
from mover_plugin.shrink import GROW, plan_grow

logger = logging.getLogger(__name__)

GROWTH = "grow"
"""The kind (and recovery) of the summary's interruption for growing back."""


class GrowBack(Unit):
    """Also a :class:`~mover_plugin.launch.recovery.Coordinator`: the end of training and the
    exit of a standby it gave up concern it first."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._growing: list[Replacement] = []
        """The standbys of the growing back under way."""
        self._abandoned: set[str] = set()
        """The standbys of a growing back that was called off."""

    def handlers(self) -> Mapping[str, EventHandler]:
        return {}  # it hears of ready standbys and resumed training from the other units

    def standby_ready(self, standby: str) -> None:
        self.grow_if_possible()

    def on_resumed(self, item: Interruption) -> None:
        """Training runs again: a grow back is complete, or one may start now."""
        if item.kind == GROWTH:
            self._growing = []
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
        if shrunk is None or ctx.interrupted() or len(ctx.attempt.pool) < len(shrunk["lost"]):
            return None
        layout, spec = ctx.layout(), ctx.template_spec()
        assert layout is not None and spec is not None, "a shrunk job published both"
        job, moves = plan_grow(shrunk, layout, spec)
        plan = []
        for rank in shrunk["lost"]:
            taken = ctx.attempt.pool.take(avoid_node=None)
            assert taken is not None
            plan.append(Replacement(rank, taken[0], twin=-1, node=taken[1]))
        ctx.job.membership = ctx.job.membership.next_generation(plan)
        old = ctx.plan_generation({"kind": GROW, "world_size": ctx.config.world_size,
                                   "replacements": [vars(item) for item in plan],
                                   "survivors": shrunk["survivors"],
                                   "moves": [list(move) for move in moves],
                                   "describe": job.describe()})
        now = time.time()
        item = Interruption(kind=GROWTH, rank=plan[0].rank, step=0, how="standby ready",
                            injected=False, attempt=ctx.attempt.number, recovery=GROWTH,
                            generation=ctx.job.generation, ranks=[r.rank for r in plan],
                            plan=job.describe())
        item.mark("requested", now)
        ctx.summary.interruptions.append(item)
        ctx.job.interruption = item
        ctx.promote(plan, migration=False)
        self._growing = plan
        ctx.notify(old, SWITCH)
        ctx.record("grow", "grow", when=now, ranks=item.ranks,
                   standbys=[r.standby for r in plan], plan=job.describe(), moved=len(moves))
        logger.warning("generation %d: growing back to the job's layout %s (standbys %s)",
                       ctx.job.generation, job.describe(),
                       ", ".join(f"{r.standby} -> rank {r.rank}" for r in plan))
        return ctx.job.generation

    # -- as a coordinator of the crash recovery ---------------------------------------------

    def rank_finished(self, rank: int) -> None:
        """A survivor that finished training will not switch: the growing back is off."""
        if self._growing and rank not in {item.rank for item in self._growing}:
            self._abandon(f"rank {rank} finished training before the switch")

    def claim_failure(self, event: Event, *, leaver: bool) -> Claim:
        """A standby of a growing back that was called off exits: nothing to recover."""
        return HANDLED if event.get("standby") in self._abandoned else None

    def _abandon(self, why: str) -> None:
        ctx = self._ctx
        for item in self._growing:
            ctx.post({"op": "cancel_promotion", "standby": item.standby, "rank": item.rank})
            self._abandoned.add(item.standby)
        ctx.record("grow_abandoned", "grow", ranks=[item.rank for item in self._growing],
                   reason=why)
        logger.warning("growing back called off: %s", why)
        self._growing = []
        ctx.job.interruption = None
