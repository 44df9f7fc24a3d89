"""Operator requests: the controller's unit that answers ``mover status`` and ``mover migrate``.

Operator requests arrive in the ``requests`` mailbox; each gets a reply under
``request/{id}/reply``: accepted, or rejected with the reason in one line
(:class:`Rejected`). An accepted migration is handed to the migration coordinator
(:mod:`mover_plugin.launch.migration`), which answers a second time when it is done. The
launcher makes the same request of itself for an injected migration (``--inject-migration``;
it waits for an interruption in progress to end) and for the slow-rank policy
(:mod:`mover_plugin.launch.slow_ranks`), which judges the agents' per-step busy times.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Mapping, Optional

from mover_plugin.contract import request_reply_key
from mover_plugin.generations import Fallback, plan_migration
from mover_plugin.launch.context import Context, Event, EventHandler, Unit
from mover_plugin.launch.migration import Migrations
from mover_plugin.launch.slow_ranks import SlowRankDetector
from mover_plugin.launch.summary import Interruption

logger = logging.getLogger(__name__)

RECENT_EVENTS = 20
"""How many of the latest event-log records ``mover status`` shows."""


class Rejected(Exception):
    """An operator request the controller will not carry out (the message says why)."""


class OperatorRequests(Unit):
    def __init__(self, ctx: Context, migrations: Migrations) -> None:
        self._ctx = ctx
        self._migrations = migrations
        config = ctx.config
        self._slow_ranks: Optional[SlowRankDetector] = None
        if config.slow_rank_factor is not None:
            self._slow_ranks = SlowRankDetector(config.slow_rank_factor, config.slow_rank_steps,
                                                config.world_size)
        self._due_migrations: list[dict[str, Any]] = []
        """Injected migrations whose step came while another interruption was in progress."""

    def handlers(self) -> Mapping[str, EventHandler]:
        return {"busy": self._on_busy, "migration_due": self._on_migration_due}

    def on_request(self, request: dict[str, Any]) -> None:
        """Answers an operator request (``mover status``, ``mover migrate``)."""
        try:
            if request.get("op") == "status":
                reply = self._status()
            elif request.get("op") == "migrate":
                reply = self._start_migration(request)
            else:
                raise Rejected(f"unknown request {request.get('op')!r}; valid: status, migrate")
        except Rejected as error:
            reply = {"ok": False, "error": str(error)}
            if request.get("op") == "migrate":
                self._ctx.record("migration_rejected", "migrate", request=request.get("id"),
                                 reason=str(error))
        self._ctx.store.set(request_reply_key(request["id"]), json.dumps(reply))

    def on_resumed(self, item: Interruption) -> None:
        """Training runs again: an injected migration that waited for it may start."""
        self._start_due_migration()

    def _status(self) -> dict[str, Any]:
        ctx = self._ctx
        return {
            "ok": True,
            "policy": ctx.config.policy,
            "generation": ctx.job.generation,
            "attempt": ctx.attempt.number,
            "world_size": ctx.config.world_size,
            "training": ctx.layout() is not None,
            "membership": {str(rank): {"process": process,
                                       "node": ctx.job.node_of_rank.get(rank)}
                           for rank, process in sorted(ctx.job.membership.members.items())},
            "standbys": dict(ctx.attempt.pool.hosts),
            "standby_target": ctx.attempt.standby_target,
            "refilling": dict(ctx.attempt.refilling),
            "lost_hosts": {str(node): ctx.config.nodes[node].host
                           for node in sorted(ctx.job.lost_nodes - ctx.job.left_nodes)},
            "left_hosts": {str(node): ctx.config.nodes[node].host
                           for node in sorted(ctx.job.left_nodes)},
            "migrations": self._migrations.status(),
            "recent_events": ctx.log.recent(RECENT_EVENTS),
        }

    # -- migrate ----------------------------------------------------------------------------

    def _migration_ranks(self, request: dict[str, Any]) -> list[int]:
        config = self._ctx.config
        world = config.world_size
        if request.get("host") is not None:
            host = request["host"]
            nodes = [node for node in config.nodes if node.host == host]
            if len(nodes) != 1:
                hosts = ", ".join(sorted({node.host for node in config.nodes}))
                raise Rejected(f"host {host!r} is not one host of this job; hosts: {hosts}"
                               if not nodes else f"host {host!r} runs several nodes of this "
                               "job; move its ranks with --rank")
            ranks = sorted(r for r, n in self._ctx.job.node_of_rank.items()
                           if n == nodes[0].node_rank)
            if not ranks:
                raise Rejected(f"host {host!r} holds no rank now (its ranks moved away, or it "
                               "is a spare host): nothing to move")
            return ranks
        ranks = request.get("ranks") or []
        if not ranks:
            raise Rejected("name the ranks to move, or a host")
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
        if bad:
            raise Rejected(f"rank {bad[0]} does not exist; this job has ranks 0..{world - 1}")
        return sorted(set(ranks))

    def _start_migration(self, request: dict[str, Any]) -> dict[str, Any]:
        ctx = self._ctx
        if ctx.config.policy != "resilient":
            raise Rejected("the job runs with --policy restart; migration needs "
                           "--policy resilient (and --resilient in the script)")
        ranks = self._migration_ranks(request)
        self._check_job_can_migrate(ranks)
        plan = plan_migration(ranks, ctx.attempt.pool, ctx.job.node_of_rank,
                              leave_hosts=request.get("host") is not None)
        if isinstance(plan, Fallback):
            raise Rejected(f"no free standby: {plan.reason}; start the job with more "
                           "--standbys or wait for one to be ready")
        self._migrations.begin(request["id"], plan, request.get("fault"))
        return {"ok": True, "ranks": ranks, "standbys": [item.standby for item in plan],
                "generation": ctx.job.generation}

    def _check_job_can_migrate(self, ranks: list[int]) -> None:
        if self._ctx.attempt.ending:
            raise Rejected("the job is ending: a rank finished training")
        current = self._migrations.current
        if current is not None:
            busy = sorted(set(ranks) & set(current.ranks))
            if busy:
                raise Rejected(f"rank(s) {busy} are already being moved; wait until that "
                               "migration is done")
            raise Rejected(f"a migration of rank(s) {current.ranks} is in progress; "
                           "retry when it is done")
        if self._ctx.interrupted():
            raise Rejected("the job is recovering from an interruption; retry when it trains "
                           "again")
        if self._ctx.layout() is None:
            raise Rejected("the job has not started training yet; retry in a moment")
        if self._ctx.attempt.shrunk is not None:
            raise Rejected("the job trains on pipeline templates after losing a rank with no "
                           "standby ready; ranks cannot be moved until it runs its own layout "
                           "again")

    def _on_migration_due(self, event: Event) -> Optional[int]:
        """An injected migration (``--inject-migration``) reached its step; it waits for an
        interruption in progress to end."""
        self._due_migrations.append({"op": "migrate", "ranks": [event["rank"]],
                                     "id": f"injected-r{event['rank']}-s{event['step']}",
                                     "fault": event.get("fault")})
        self._start_due_migration()
        return None

    def _start_due_migration(self) -> None:
        if self._due_migrations and not self._ctx.interrupted():
            self.on_request(self._due_migrations.pop(0))

    # -- the slow-rank policy ---------------------------------------------------------------

    def _on_busy(self, event: Event) -> Optional[int]:
        """One host's busy times of a step: the slow-rank policy (see ``slow_ranks``)."""
        detector = self._slow_ranks
        if detector is None:
            return None
        if (self._migrations.current is not None or self._ctx.interrupted()
                or self._ctx.attempt.shrunk is not None):
            # The job is being changed, or trains on unequal pipelines (whose ranks differ in
            # work by design): judge it again once it runs its own layout.
            detector.reset()
            return None
        slow = detector.observe(event["step"], {int(r): b for r, b in event["ranks"].items()})
        if slow is None:
            return None
        config = self._ctx.config
        self._ctx.record("slow_rank", "migrate", rank=slow.rank, step=slow.step,
                         busy_s=round(slow.busy_s, 6), median_busy_s=round(slow.median_busy_s, 6),
                         factor=config.slow_rank_factor, steps=config.slow_rank_steps)
        logger.warning("rank %d is slow (busy %.3f s per step vs a median of %.3f s for %d "
                       "steps): moving it to a standby", slow.rank, slow.busy_s,
                       slow.median_busy_s, config.slow_rank_steps)
        try:
            self._start_migration({"op": "migrate", "id": f"slow-rank-{slow.rank}-{slow.step}",
                                   "ranks": [slow.rank]})
        except Rejected as error:
            self._ctx.record("slow_rank_kept", "migrate", rank=slow.rank, reason=str(error))
            logger.warning("rank %d stays where it is: %s", slow.rank, error)
        return None
