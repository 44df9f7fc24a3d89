"""A standby pool that refills: the controller's unit that keeps the standby count at target.

The standby counts (``--standbys`` per worker host, one per slot of a spare host) are targets,
not a one-off supply. A crash recovered in place frees the lost worker's slot on its host
while a standby (on that host or another) becomes a worker: ``--refill-delay-s`` (default 30)
after training runs again — so that the new process, which starts Python and imports the
framework, competes neither with the recovery nor with the first steps after it — the
controller asks the agent of the host with the freed slot to start one standby there
(``refill`` command, with the standby's id), as long as the pool, counting the standbys already
starting, is below its target. The new standby joins the pool when it reports ready, like one
started with the attempt; the run summary records each refill (when it was asked for, when it
was ready, or that it was lost before), and the event log has ``standby_refill``.

A ready standby whose process exits (killed, or hung and killed by its agent) is replaced the
same way: ``--refill-delay-s`` after its exit, its host starts one standby in its place. A
refill that exits before it is ready is not replaced again: a host whose standbys cannot start
would otherwise start one every delay for the rest of the job.

A slot on a host that was lost since (:mod:`mover_plugin.launch.host_loss`) is refilled by
no one. A planned migration refills nothing: the slot it frees is on the host being drained
(or on the rank's slow host). A restart starts every standby afresh, so refills in flight are
forgotten. Once a rank finished training the job is ending
(:mod:`mover_plugin.launch.job_end`): no refill starts, and those still starting are stopped.

The target is the count of standby slots, kept per host (``host_standbys``): a promoted
standby's slot holds a worker from then on (one fewer on its host); a crash recovered in place
gives one back on the lost rank's host, which the refill fills; a migration gives none back; a
slot left empty (a refill lost before it was ready, a standby lost on a host whose workers are
done) leaves it; a lost host takes its own with it, and a host that joins adds its own. So
``mover status``'s pool reaches its target whenever nothing is starting.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping

from mover_plugin.launch.context import AttemptPhase, Context, EventHandler, Unit
from mover_plugin.launch.summary import Interruption, Refill

logger = logging.getLogger(__name__)


class StandbyRefill(Unit):
    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._rooms: list[int] = []
        """Nodes with a slot freed by a crash, waiting for training to resume."""
        self._due: list[tuple[float, int]] = []
        """(monotonic time, node) of the refills to start."""
        self._attempt = -1

    def handlers(self) -> Mapping[str, EventHandler]:
        return {}  # the pool's events are the attempts unit's; it tells this one

    def freed(self, nodes: list[int]) -> None:
        """A crash recovery freed one slot on each of ``nodes`` (one entry per lost rank): the
        pool's target counts a standby there again (a lost host's slots went with it)."""
        self._forget_other_attempts()
        standbys = self._ctx.attempt.host_standbys
        for node in nodes:
            if node not in self._ctx.job.lost_nodes and node in standbys:
                standbys[node] += 1
        self._rooms.extend(nodes)

    def on_resumed(self, item: Interruption) -> None:
        """Training runs again: the refills for the slots freed are due after the delay."""
        self._forget_other_attempts()
        due = time.monotonic() + self._ctx.config.refill_delay_s
        self._due.extend((due, node) for node in self._rooms)
        self._rooms.clear()
        self.start_due()

    def replace_exited(self, standby: str, node: int) -> None:
        """The ready standby ``standby`` on ``node`` exited: its replacement is due after the
        delay; not while the attempt stops for a restart, nor on a host whose workers are
        done."""
        attempt = self._ctx.attempt
        if attempt.phase is not AttemptPhase.TRAINING:
            return  # a restart starts every standby afresh; an ending job needs none
        if node in attempt.done:
            attempt.shrink_standby_slots(node)
            return
        self._forget_other_attempts()
        self._due.append((time.monotonic() + self._ctx.config.refill_delay_s, node))
        self.start_due()

    def start_due(self) -> None:
        """Starts the standbys due by now that bring the pool back to its target (the
        controller calls this at every poll); none once the job is ending."""
        if not self._due or self._due[0][0] > time.monotonic():
            return
        self._forget_other_attempts()
        ctx = self._ctx
        attempt = ctx.attempt
        if attempt.ending:
            self._due.clear()
            return
        now_monotonic = time.monotonic()
        while self._due and self._due[0][0] <= now_monotonic:
            _, node = self._due.pop(0)
            if node in ctx.job.lost_nodes:
                continue  # the slot went with its host
            if len(attempt.pool) + len(attempt.refilling) >= ctx.attempt.standby_target:
                continue
            standby = f"a{attempt.number}.n{node}.r{attempt.refills_started}"
            attempt.refills_started += 1
            attempt.refilling[standby] = node
            now = time.time()
            ctx.summary.refills.append(Refill(standby=standby, node=node, requested_at=now))
            ctx.command("refill", attempt=attempt.number, node=node, standby=standby)
            ctx.record("standby_refill", "pool", when=now, standby=standby, node=node,
                       pool=len(attempt.pool))
            logger.info("refilling the standby pool: standby %s on node %d", standby, node)

    def standby_ready(self, standby: str) -> None:
        """A standby reported ready; if it is a refill, the refill is done."""
        if self._ctx.attempt.refilling.pop(standby, None) is not None:
            self._refill(standby).ready_at = time.time()

    def standby_lost(self, standby: str) -> None:
        """A standby exited; a refill that never got ready is over, and not started again."""
        node = self._ctx.attempt.refilling.pop(standby, None)
        if node is not None:
            self._refill(standby).lost_at = time.time()
            self._ctx.attempt.shrink_standby_slots(node)

    def _refill(self, standby: str) -> Refill:
        return next(r for r in reversed(self._ctx.summary.refills) if r.standby == standby)

    def _forget_other_attempts(self) -> None:
        if self._attempt != self._ctx.attempt.number:
            self._attempt = self._ctx.attempt.number
            self._rooms.clear()
            self._due.clear()
