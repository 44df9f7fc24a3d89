"""Attempts and the standby pool: the controller's unit that starts the workers.

Each start of the workers is an *attempt*. Each attempt begins a new generation and rendezvouses on
a fresh store the controller hosts, so keys of a failed attempt can never confuse the next. The
agents start each host's standby processes with its workers; this unit keeps the pool of the ready
ones (and tells its listeners of each standby ready or lost), and once every standby of the attempt
is ready (at once without standbys) tells the workers they may train and arms the injected failures.
The end of an attempt is :mod:`mover_plugin.launch.job_end`'s.
"""

from __future__ import annotations

import logging
from typing import Callable, Mapping, Optional

from mover_plugin.contract import standbys_ready_key
from mover_plugin.generations import Membership, StandbyPool
from mover_plugin.launch.context import AttemptState, Context, Event, EventHandler, Unit

logger = logging.getLogger(__name__)


StandbyListener = Callable[[str], None]
"""Called with a standby's id."""
ExitListener = Callable[[str, int], None]
"""Called with the id of a ready standby whose process exited, and its node."""


class Attempts(Unit):
    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._armed = False
        self._on_ready: list[StandbyListener] = []
        self._on_lost: list[StandbyListener] = []
        self._on_exit: list[ExitListener] = []

    def when_standby_ready(self, listener: StandbyListener) -> None:
        self._on_ready.append(listener)

    def when_standby_lost(self, listener: StandbyListener) -> None:
        """``listener`` hears of every standby that exited while not holding a rank."""
        self._on_lost.append(listener)

    def when_ready_standby_exits(self, listener: ExitListener) -> None:
        """``listener`` hears of every ready standby whose own process exited (killed, or
        hung and killed by its agent) on a host still in the job."""
        self._on_exit.append(listener)

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"standby_ready": self._on_standby_ready,
                "standby_warmed": self._on_standby_warmed, "peer_copy": self._on_peer_copy,
                "standby_exit": self._on_standby_exit}

    def start(self, attempt: int) -> Optional[int]:
        """Starts every worker (and standby) afresh as attempt ``attempt``; returns the
        launcher's exit code when the ranks cannot all be placed on the hosts left."""
        ctx = self._ctx
        placement = self.placement()
        if placement is None:
            return self.cannot_place()
        previous, ctx.attempt = ctx.attempt, AttemptState(
            number=attempt,
            host_standbys={node: self._standbys_of(node, placement) for node in ctx.job.nodes},
            pool=StandbyPool(spare_nodes=frozenset(
                n.node_rank for n in ctx.config.nodes if n.spare)))
        ctx.job.node_of_rank = {rank: node for node, ranks in placement.items() for rank in ranks}
        ctx.begin_generation(ctx.job.last_generation + 1)
        ctx.job.membership = Membership(ctx.job.generation, {r: f"a{attempt}.r{r}" for r in
                                                             range(ctx.config.world_size)})
        ctx.attempt.store = ctx.host_attempt_store(attempt)
        del previous  # the old attempt's workers are gone; its store can close
        # Each host runs its own ranks unless the command names others for it (a spare host
        # taking a lost host's): thousands of hosts each read the command.
        ctx.command("start", attempt=attempt, generation=ctx.job.generation,
                    ranks={str(node): ranks for node, ranks in placement.items()
                           if ranks != list(ctx.config.nodes[node].ranks)})
        self._arm_when_provisioned()
        ctx.record("attempt_start", "job", attempt=attempt)
        logger.info("attempt %d: starting %d workers", attempt, ctx.config.world_size)
        return None

    def placement(self) -> Optional[dict[int, list[int]]]:
        """The ranks each host in the job runs as workers at the next start: its own, and the
        ranks of each lost host on one spare host with as many slots (in node order); None
        when a lost host's ranks fit on no spare host left."""
        ctx = self._ctx
        placement = {node.node_rank: list(node.ranks) for node in ctx.config.nodes
                     if node.node_rank in ctx.job.nodes}
        free_spares = [node for node in ctx.config.nodes
                       if node.spare and node.node_rank in ctx.job.nodes]
        for lost in sorted(ctx.job.lost_nodes):
            ranks = list(ctx.config.nodes[lost].ranks)
            if not ranks:
                continue
            spare = next((n for n in free_spares if n.spare_slots >= len(ranks)), None)
            if spare is None:
                return None
            free_spares.remove(spare)
            placement[spare.node_rank] = ranks
        return placement

    def cannot_place(self) -> int:
        """Ends the job: the ranks of a lost host fit on no host left (exit code 1)."""
        ctx = self._ctx
        lost = sorted(ctx.job.lost_nodes)
        reason = (f"the ranks of lost host(s) {lost} fit on no spare host left; the job "
                  "cannot start again without them (start it again on hosts that are up)")
        ctx.record("job_unplaceable", "restart", reason=reason)
        logger.error("%s", reason)
        return 1

    def _standbys_of(self, node: int, placement: dict[int, list[int]]) -> int:
        """The standbys ``node``'s agent starts: a spare host one per slot it does not use
        for workers, a worker host ``--standbys``."""
        config = self._ctx.config
        spec = config.nodes[node]
        return config.standbys_of(spec) - (len(placement.get(node, [])) if spec.spare else 0)

    def drop_node(self, node: int, how: str = "its host was lost") -> None:
        """``node`` was lost with its agent (or left the job, ``how``): its standbys leave the
        pool (and its share of the target), the waits for every host stop waiting for it (the
        job may have ended: see :meth:`mover_plugin.launch.job_end.JobEnd.check`)."""
        ctx = self._ctx
        attempt = ctx.attempt
        attempt.host_standbys.pop(node, None)
        gone = [s for s, where in attempt.pool.hosts.items() if where == node]
        gone += [s for s, where in attempt.refilling.items() if where == node]
        for standby in gone:
            attempt.pool.remove(standby)
            ctx.record("standby_lost", "pool", standby=standby, how=how,
                       pool=len(attempt.pool), was_ready=standby not in attempt.refilling)
            for listener in self._on_lost:
                listener(standby)
        for waiting in (attempt.done, attempt.stopped, attempt.started):
            waiting.pop(node, None)
        self._arm_when_provisioned()

    def add_spare_host(self, node: int, standbys: int) -> list[str]:
        """``node``, back in the job after it was lost, serves as a spare host with
        ``standbys`` standbys; returns their ids (``a{attempt}.n{node}.j{index}``, the index
        counting every standby started for a host that came back in this attempt)."""
        attempt = self._ctx.attempt
        first = attempt.rejoin_standbys
        attempt.rejoin_standbys += standbys
        attempt.host_standbys[node] = standbys
        attempt.pool.spare_nodes = attempt.pool.spare_nodes | {node}
        return [f"a{attempt.number}.n{node}.j{first + index}" for index in range(standbys)]

    def _arm_when_provisioned(self) -> None:
        """Once every standby of the attempt is ready (at once without): the workers may
        start training, and injected failures are armed."""
        ctx = self._ctx
        if len(ctx.attempt.pool) < ctx.attempt.standby_target:
            return
        ctx.store.set(standbys_ready_key(ctx.attempt.number), "1")
        if not self._armed:
            self._armed = True
            ctx.command("arm")

    # -- the standby pool -------------------------------------------------------------------

    def _on_standby_ready(self, event: Event) -> Optional[int]:
        if self._ctx.attempt.ending:
            return None  # its agent stops it: the job needs no standby any more
        pool = self._ctx.attempt.pool
        pool.add(event["standby"], event["node"])
        self._ctx.record("standby_ready", "pool", when=event["time"],
                         standby=event["standby"], pool=len(pool))
        for listener in self._on_ready:
            listener(event["standby"])
        self._arm_when_provisioned()
        return None

    def _on_standby_warmed(self, event: Event) -> Optional[int]:
        """A standby played every pipeline role in its sandbox (it reports ready next)."""
        report = {key: value for key, value in event.items()
                  if key not in ("kind", "attempt", "time", "generation")}
        self._ctx.record("standby_warmed", "pool", when=event["time"], **report)
        return None

    def _on_peer_copy(self, event: Event) -> Optional[int]:
        """A worker's host memory for the copy of a peer's optimizer shard, and the time its
        training thread spent in the copy over how many exchanges, at its end."""
        self._ctx.record("peer_copy", "job", when=event["time"], rank=event["rank"],
                         bytes=event["bytes"], critical_s=event["critical_s"],
                         exchanges=event["exchanges"])
        return None

    def _on_standby_exit(self, event: Event) -> Optional[int]:
        pool = self._ctx.attempt.pool
        node = pool.hosts.get(event["standby"])
        removed = pool.remove(event["standby"])
        self._ctx.record("standby_lost", "pool", when=event["time"], standby=event["standby"],
                         how=event["how"], pool=len(pool), was_ready=removed)
        logger.warning("standby %s exited (%s); %d standby(s) left", event["standby"],
                       event["how"], len(pool))
        for listener in self._on_lost:
            listener(event["standby"])
        if node is not None:
            for exit_listener in self._on_exit:
                exit_listener(event["standby"], node)
        return None
