"""The job controller: hosts the control-plane store, applies the failure policy, times it.

One controller runs per job, in the ``mover-launch`` process of the first host. It owns the
control-plane TCPStore (which outlives every rank), reads the agents' and workers' events and
posts commands. Each start of the workers is an *attempt*; with the ``restart`` policy each
attempt rendezvouses on a fresh store the controller hosts, and a failed worker makes it stop
every worker and start all again (up to ``max_restarts`` times).

With the ``resilient`` policy the job also has *generations*: generation ``g`` is one
membership of the running workers, and its process groups live under the store prefix
``gen{g}/`` of the control store, so keys of an earlier generation can never satisfy a new
rendezvous. When a worker dies (or is found hung) the controller plans generation ``g + 1``
(``mover_plugin.generations.plan_recovery``): a ready standby takes the lost global rank and
copies a data-parallel twin. It publishes the plan (``gen{g+1}/plan``), sends generation
``g`` an alarm notice (relayed by the agents: survivors leave the failed step), and promotes
the standby.
Without a standby or a twin it falls back to the restart policy, and the event log says why.

A planned migration (``mover migrate``, :mod:`mover_plugin.launch.jobctl`) is a generation
switch the controller starts itself: it plans generation ``g + 1`` with ready standbys in the
leaving ranks' places (each leaving rank is its joiner's source of state), promotes them at
once and posts the ``prepare`` notice to generation ``g`` (phase 1, while training goes on: the
joiners build their groups and model, the other ranks the next generation's version of their
groups that hold a leaving rank); when all of them report ready it posts the ``switch``
notice; the ranks end the iteration in which they all saw it (phase 2), the leavers hand their
state over, and once every rank has ended that iteration the controller commits the switch
(``gen{g}/next`` and ``gen{g+1}/switch``): the leavers exit, the others put the new groups in
place. A process lost before that point calls the migration off — the other processes go on in
generation ``g`` and the loss is recovered like any crash — and one lost after it abandons the
migration's unfinished hand-overs or waits for them (see ``_failure_during_migration``).
Operator requests arrive in the ``requests`` mailbox; each gets a reply (accepted, or rejected
with the reason) and, for a migration, a second one when training runs on the new processes.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import torch.distributed as dist

from mover_plugin.errors import LaunchError
from mover_plugin.generations import (
    Fallback,
    Membership,
    Replacement,
    StandbyPool,
    plan_migration,
    plan_recovery,
)
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.launch.eventlog import EventLog
from mover_plugin.launch.mailbox import Mailbox
from mover_plugin.launch.protocol import (
    CURRENT_GENERATION_KEY,
    LAYOUT_KEY,
    REQUESTS_MAILBOX,
    SWITCH_CANCEL,
    SWITCH_GO,
    plan_key,
    promotion_key,
    request_done_key,
    request_reply_key,
    standbys_ready_key,
    successor_key,
    switch_decision_key,
)
from mover_plugin.launch.slow_ranks import SlowRankDetector
from mover_plugin.launch.summary import Interruption, RunSummary
from mover_plugin.layout import ParallelLayout

logger = logging.getLogger(__name__)

POLL_PERIOD_S = 0.005
REQUEST_POLL_PERIOD_S = 0.05
"""Operator requests wait up to this long: no need to read their mailbox at every poll."""
RECENT_EVENTS = 20
"""How many of the latest event-log records ``mover status`` shows."""


class _Rejected(Exception):
    """An operator request the controller will not carry out (the message says why)."""


@dataclass
class _Migration:
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
    deferred: list[dict[str, Any]] = field(default_factory=list)
    """Failures of staying ranks during phase 2, recovered once the hand-over completes."""
    before: tuple[Membership, dict[int, int]] = field(
        default_factory=lambda: (Membership(0, {}), {}))
    """The membership and the ranks' nodes before, restored if the migration is cancelled."""

    @property
    def ranks(self) -> list[int]:
        return [item.rank for item in self.plan]


class Controller:
    def __init__(
        self,
        config: LaunchConfig,
        store: dist.Store,
        local_agents: Optional[list[subprocess.Popen]] = None,
    ) -> None:
        self.config = config
        self.summary = RunSummary(config.policy, config.world_size, list(config.command),
                                  started_at=time.time())
        self.log = EventLog(config.event_log_path)
        self._store = store
        self._commands = Mailbox(store, "commands")
        self._events = Mailbox(store, "events")
        self._requests = Mailbox(store, REQUESTS_MAILBOX)
        self._local_agents = local_agents or []
        self._nodes = {node.node_rank for node in config.nodes}
        self._node_of_rank = {r: n.node_rank for n in config.nodes for r in n.ranks}
        self._attempt = -1
        self._generation = -1
        self._last_generation = -1
        """The highest generation number planned so far (a cancelled one is never reused)."""
        self._membership = Membership(0, {})
        self._pool = StandbyPool()
        self._slow_ranks: Optional[SlowRankDetector] = None
        if config.slow_rank_factor is not None:
            self._slow_ranks = SlowRankDetector(config.slow_rank_factor, config.slow_rank_steps,
                                                config.world_size)
        self._attempt_store: Optional[dist.TCPStore] = None
        self._reset_attempt_state()
        self._interruption: Optional[Interruption] = None
        self._injected: dict[tuple[int, int], dict[str, Any]] = {}
        self._hung: set[int] = set()
        self._armed = False
        self._left: dict[int, dict[int, float]] = {}
        """Per generation: when each survivor left its failed step (it may report before the
        agent reports the failure)."""
        self._migration: Optional[_Migration] = None
        self._due_migrations: list[dict[str, Any]] = []
        """Injected migrations whose step came while another interruption was in progress."""

    def run(self) -> int:
        """Runs the job to its end; returns the launcher's exit code (0: every worker exited 0)."""
        exit_code = 1
        try:
            self._wait_for_agents()
            self._start_attempt(0)
            exit_code = self._serve()
        finally:
            if self._migration is not None:  # the job ended right after (or before) a switch
                switched = "switched" in self._migration.interruption.times
                self._end_migration(ok=switched, error=None if switched else
                                    "the job ended before the migration completed")
            self._commands.post({"op": "finish" if exit_code == 0 else "abort"})
            self.summary.finished_at = time.time()
            self.summary.exit_code = exit_code
            self.log.write("job_end", "job", generation=self._generation, exit_code=exit_code)
            self.log.close()
        return exit_code

    # -- lifecycle ------------------------------------------------------------------------

    def _wait_for_agents(self) -> None:
        joined: set[int] = set()
        deadline = time.monotonic() + self.config.join_timeout_s
        while joined != self._nodes:
            for event in self._events.poll():
                if event["kind"] == "joined":
                    joined.add(event["node"])
                    logger.info("agent of node %d (%s) joined", event["node"], event["host"])
            self._check_local_agents()
            if time.monotonic() > deadline:
                missing = sorted(self._nodes - joined)
                raise LaunchError(
                    f"agents of nodes {missing} did not join within {self.config.join_timeout_s}s"
                    f" (start 'mover-launch --node-rank N' on those hosts)"
                )
            time.sleep(POLL_PERIOD_S)

    def _start_attempt(self, attempt: int) -> None:
        self._attempt = attempt
        self._reset_attempt_state()
        self._begin_generation(self._last_generation + 1)
        self._membership = Membership(self._generation, {r: f"a{attempt}.r{r}" for r in
                                                         range(self.config.world_size)})
        self._pool = StandbyPool()
        previous, self._attempt_store = self._attempt_store, dist.TCPStore(
            self.config.master_addr, 0, is_master=True, wait_for_workers=False
        )
        del previous  # the old attempt's workers are gone; its store can close
        self._commands.post({"op": "start", "attempt": attempt, "generation": self._generation,
                             "store_port": self._attempt_store.port})
        self._arm_injections_when_provisioned()
        self.log.write("attempt_start", "job", generation=self._generation, attempt=attempt)
        logger.info("attempt %d: starting %d workers", attempt, self.config.world_size)

    def _begin_generation(self, generation: int) -> None:
        self._generation = generation
        self._last_generation = max(self._last_generation, generation)
        self._store.set(CURRENT_GENERATION_KEY, str(generation))
        self._ready: dict[int, float] = {}
        self._first_step: dict[int, float] = {}
        self._switched: dict[int, float] = {}

    def _plan_generation(self, record: dict[str, Any], *, link: bool = True) -> int:
        """Starts the generation after the current one with ``record`` as its plan, and
        (with ``link``; a migration does it at its point of no return) tells the current one's
        processes which generation follows theirs."""
        old, new = self._generation, self._last_generation + 1
        self._begin_generation(new)
        self._store.set(plan_key(new), json.dumps({"generation": new, **record}))
        if link:
            self._store.set(successor_key(old), str(new))
        return old

    def _reset_attempt_state(self) -> None:
        self._failed = False
        self._stopped: dict[int, list[dict[str, Any]]] = {}
        self._started: dict[int, float] = {}
        self._done: dict[int, int] = {}
        self._finished_workers: list[dict[str, Any]] = []

    def _serve(self) -> int:
        last_requests_poll = 0.0
        while True:
            for event in self._events.poll():
                exit_code = self._handle(event)
                if exit_code is not None:
                    return exit_code
            if time.monotonic() - last_requests_poll >= REQUEST_POLL_PERIOD_S:
                last_requests_poll = time.monotonic()
                for request in self._requests.poll():
                    self._on_request(request)
            self._check_local_agents()
            time.sleep(POLL_PERIOD_S)

    def _check_local_agents(self) -> None:
        for agent in self._local_agents:
            if agent.poll() is not None:
                raise LaunchError(f"a local agent (pid {agent.pid}) exited with {agent.returncode}")

    # -- events ---------------------------------------------------------------------------

    def _handle(self, event: dict[str, Any]) -> Optional[int]:
        kind = event["kind"]
        if kind == "injected":
            self._injected[(event["rank"], event["attempt"])] = event
            return None
        if event.get("attempt", self._attempt) != self._attempt:
            return None  # a late report about workers of a previous attempt
        handler = getattr(self, f"_on_{kind}", None)
        return handler(event) if handler else None

    def _on_worker_exit(self, event: dict[str, Any]) -> Optional[int]:
        if event["returncode"] == 0:
            if self._migration is not None and not self._migration.boundary:
                self._cancel_migration(f"rank {event['rank']} finished training before the "
                                       "switch")
            return None
        if event.get("standby") is not None and (
                self._membership.members.get(event["rank"]) != event["standby"]):
            # A joiner stopped after its migration failed, exiting before it was reaped.
            self.log.write("discarded_exit", "migrate", generation=self._generation,
                           rank=event["rank"], standby=event["standby"], how=event["how"])
            return None
        if self._failed:  # a restart of this attempt is under way already
            logger.info("rank %d also exited (%s)", event["rank"], event["how"])
            return None
        return self._on_failure(event)

    def _on_hung(self, event: dict[str, Any]) -> Optional[int]:
        self.log.write("hung", "detect", generation=self._generation, rank=event["rank"],
                       when=event["time"], silent_s=event["silent_s"])
        self._hung.add(event["rank"])
        return None

    def _on_failure(self, event: dict[str, Any], *, leaver: bool = False) -> Optional[int]:
        rank = event["rank"]
        lost = [rank]
        if self._migration is not None:
            outcome = self._failure_during_migration(event, leaver)
            if outcome == "handled":
                return None
            lost = outcome
        interruption = self._record_failure(event)
        self.log.write("worker_failed", "detect", generation=self._generation, rank=rank,
                       when=event["time"], how=event["how"], step=event["step_begun"],
                       leaver=leaver or None)
        logger.warning("rank %d failed at step %d (%s)", rank, event["step_begun"], event["how"])
        if self.config.policy == "resilient":
            plan = plan_recovery(lost, self._layout(), self._pool, self._node_of_rank)
            if not isinstance(plan, Fallback):
                self._switch_generation(plan, interruption)
                return None
            self.log.write("fallback", "fallback", generation=self._generation, rank=rank,
                           reason=plan.reason)
            logger.warning("falling back to a restart: %s", plan.reason)
        interruption.recovery = "restart"
        self._failed = True
        if self.summary.restarts >= self.config.max_restarts:
            logger.error("no restart left (--max-restarts %d); stopping the job",
                         self.config.max_restarts)
            return 1
        self._commands.post({"op": "stop", "attempt": self._attempt})
        return None

    def _failure_during_migration(self, event: dict[str, Any], leaver: bool) -> "str | list[int]":
        """A process died while a migration was under way. Returns ``"handled"`` (the job goes
        on without a recovery now) or the ranks to recover with standbys.

        Before the point of no return (phase 1, or phase 2 until every rank has ended the
        switch iteration) the migration is called off: the processes of the old generation go
        on in it — those that ended the switch iteration learn it from the switch decision —
        and a lost rank of theirs is recovered from there, like any crash. After it, the lost
        process's rank is recovered in the migration's generation: at once if its hand-over had
        not completed (the migration is abandoned), or once the hand-overs are done.
        """
        migration = self._migration
        rank, moving = event["rank"], event["rank"] in migration.ranks
        joiner = moving and not leaver
        if not migration.committed:
            where = ("in phase 1" if not migration.switch_posted else
                     "in phase 2 before every rank had ended the switch iteration")
            process = "the joiner of " if joiner else "the leaver of " if leaver else ""
            self._cancel_migration(f"{process}rank {rank} was lost {where} ({event['how']})",
                                   failed=True)
            if joiner:
                self.log.write("joiner_lost", "migrate", generation=self._generation,
                               rank=rank, when=event["time"], how=event["how"])
                return "handled"
            return [rank]
        if len(migration.handed_over) == len(migration.plan):
            self._end_migration(ok=True)  # the ranks had moved; this is an ordinary failure
            return [rank]
        if moving:  # a leaver or joiner before its hand-over completed
            self._abandon_migration(f"the {'joiner' if joiner else 'leaver'} of rank {rank} "
                                    f"was lost before the hand-over ({event['how']}); the "
                                    "rank is recovered from a data-parallel twin")
            return [r for r in migration.ranks if r not in migration.handed_over]
        migration.deferred.append(event)  # a staying rank: it had ended the switch iteration
        self.log.write("failure_deferred", "migrate", generation=self._generation,
                       rank=rank, when=event["time"],
                       reason="recovered once the hand-over in progress completes")
        return "handled"

    def _abandon_migration(self, reason: str) -> None:
        """Phase 2 failed: the leavers and joiners of ranks not yet handed over are stopped."""
        migration = self._migration
        for item in migration.plan:
            if item.rank not in migration.handed_over:
                self._commands.post({"op": "discard_leaver", "rank": item.rank})
                self._commands.post({"op": "cancel_promotion", "standby": item.standby,
                                     "rank": item.rank})
        self._end_migration(ok=False, error=f"abandoned: {reason}")
        logger.warning("migration abandoned: %s", reason)

    def _switch_generation(self, plan: list, interruption: Interruption) -> None:
        self._membership = self._membership.next_generation(plan)
        old = self._plan_generation({"world_size": self.config.world_size,
                                     "replacements": [vars(item) for item in plan]})
        self._notify(old, "alarm", reason=f"rank {interruption.rank} lost")
        self._promote(plan, migration=False)
        now = time.time()
        interruption.recovery = "standby"
        interruption.generation = self._generation
        interruption.mark("alarm", now)
        self._note_left(interruption)
        for item in plan:
            self.log.write("promote", "switch", generation=self._generation, rank=item.rank,
                           when=now, standby=item.standby, twin=item.twin)
        logger.info("generation %d: %s", self._generation,
                    ", ".join(f"rank {i.rank} <- standby {i.standby} (twin {i.twin})"
                              for i in plan))

    def _notify(self, generation: int, kind: str, **fields: Any) -> None:
        """A notice to generation ``generation``'s processes (the agents relay it)."""
        self._commands.post({"op": "notice", "generation": generation, "kind": kind, **fields})

    def _promote(self, plan: list[Replacement], *, migration: bool) -> None:
        """Hands each planned rank to its standby (the agents relabel the processes) and moves
        the agents to the new generation."""
        for item in plan:
            self._store.set(promotion_key(item.standby),
                            json.dumps({"rank": item.rank, "generation": self._generation,
                                        "migration": migration}))
            self._commands.post({"op": "promote", "standby": item.standby, "rank": item.rank,
                                 "migration": migration})
            self._node_of_rank[item.rank] = item.node
        self._commands.post({"op": "generation", "generation": self._generation})

    def _layout(self) -> Optional[ParallelLayout]:
        if not self._store.check([LAYOUT_KEY]):
            return None
        raw = json.loads(self._store.get(LAYOUT_KEY))
        return ParallelLayout(tp=raw["tp"], pp=raw["pp"], dp=raw["dp"])

    def _record_failure(self, event: dict[str, Any]) -> Interruption:
        injected = self._injected.pop((event["rank"], event["attempt"]), None)
        hung = event["rank"] in self._hung
        self._hung.discard(event["rank"])  # a later failure of this rank is its replacement's
        interruption = Interruption(
            kind="hang" if hung else "failure",
            rank=event["rank"],
            step=event["step_begun"],
            how=event["how"],
            injected=injected is not None,
            attempt=event["attempt"],
            generation=self._generation,
        )
        interruption.mark("failed", injected["time"] if injected else event["time"])
        interruption.mark("detected", event["time"])
        self._note_last_step(interruption, [event])
        self.summary.interruptions.append(interruption)
        self._interruption = interruption
        return interruption

    @staticmethod
    def _note_last_step(interruption: Interruption, workers: list[dict[str, Any]]) -> None:
        for worker in workers:
            end = worker.get("last_step_end")
            if end is not None and (interruption.last_step_before is None
                                    or end > interruption.last_step_before):
                interruption.last_step_before = end
                interruption.step_time_before = worker.get("last_step_duration")

    # resilient policy: standby pool and the workers' own reports

    def _on_standby_ready(self, event: dict[str, Any]) -> Optional[int]:
        self._pool.add(event["standby"], event["node"])
        self.log.write("standby_ready", "pool", generation=self._generation,
                       when=event["time"], standby=event["standby"], pool=len(self._pool))
        self._arm_injections_when_provisioned()
        return None

    def _on_standby_warmed(self, event: dict[str, Any]) -> Optional[int]:
        """A standby played every pipeline role in its sandbox (it reports ready next)."""
        report = {key: value for key, value in event.items()
                  if key not in ("kind", "attempt", "time", "generation")}
        self.log.write("standby_warmed", "pool", generation=self._generation,
                       when=event["time"], **report)
        return None

    def _arm_injections_when_provisioned(self) -> None:
        """Once every standby of the attempt is ready (at once without): the workers may
        start training, and injected failures are armed."""
        if len(self._pool) < self.config.standbys * len(self._nodes):
            return
        self._store.set(standbys_ready_key(self._attempt), "1")
        if not self._armed:
            self._armed = True
            self._commands.post({"op": "arm"})

    def _on_standby_exit(self, event: dict[str, Any]) -> Optional[int]:
        removed = self._pool.remove(event["standby"])
        self.log.write("standby_lost", "pool", generation=self._generation, when=event["time"],
                       standby=event["standby"], how=event["how"], pool=len(self._pool),
                       was_ready=removed)
        logger.warning("standby %s exited (%s); %d standby(s) left", event["standby"],
                       event["how"], len(self._pool))
        return None

    def _on_left_step(self, event: dict[str, Any]) -> Optional[int]:
        """A survivor left the failed step of generation ``event['generation']``."""
        self.log.write("left_step", "switch", generation=event["generation"],
                       rank=event["rank"], when=event["time"], cause=event.get("cause"))
        self._left.setdefault(event["generation"], {})[event["rank"]] = event["time"]
        if self._interruption is not None:
            self._note_left(self._interruption)
        return None

    def _note_left(self, item: Interruption) -> None:
        """Copies the survivors' leave times of the interrupted generation into ``item``."""
        if item.recovery != "standby" or "failed" not in item.times:
            return  # not a crash (a migration's ranks can also leave a step, see below)
        failed = item.times["failed"]
        item.left_s = {rank: when - failed
                       for rank, when in self._left.get(item.generation - 1, {}).items()}
        if len(item.left_s) == self.config.world_size - 1:
            item.mark("left", failed + max(item.left_s.values()))

    def _on_switched(self, event: dict[str, Any]) -> Optional[int]:
        """A rank (survivor or replacement) runs in the new generation."""
        if event["generation"] != self._generation:
            return None
        self._switched[event["rank"]] = event["time"]
        extra = {key: event[key] for key in ("adopted", "rebuilt", "kept") if key in event}
        self.log.write("switched", "switch", generation=event["generation"],
                       rank=event["rank"], when=event["time"], role=event.get("role"), **extra)
        if len(self._switched) == self.config.world_size and self._interruption is not None:
            self._interruption.mark("switched", max(self._switched.values()))
        return None

    def _on_rolled_back(self, event: dict[str, Any]) -> Optional[int]:
        """After a crash the ranks could not continue in place (a DeepSpeed job whose lost
        optimizer shard no live rank holds): each rolled back to the last checkpoint."""
        self.log.write("rolled_back", "switch", generation=event["generation"],
                       rank=event["rank"], when=event["time"], iteration=event["iteration"],
                       reason=event["reason"], load_s=event["load_s"])
        if self._interruption is not None and self._interruption.rolled_back_to is None:
            self._interruption.rolled_back_to = event["iteration"]
            logger.info("rolled back to the checkpoint of step %d: %s", event["iteration"],
                        event["reason"])
        return None

    # planned migration

    def _on_busy(self, event: dict[str, Any]) -> Optional[int]:
        """One host's busy times of a step: the slow-rank policy (see ``slow_ranks``)."""
        detector = self._slow_ranks
        if detector is None:
            return None
        if self._migration is not None or self._interruption is not None or self._failed:
            detector.reset()  # the job is being changed: judge it again afterwards
            return None
        slow = detector.observe(event["step"], {int(r): b for r, b in event["ranks"].items()})
        if slow is None:
            return None
        self.log.write("slow_rank", "migrate", generation=self._generation, rank=slow.rank,
                       step=slow.step, busy_s=round(slow.busy_s, 6),
                       median_busy_s=round(slow.median_busy_s, 6),
                       factor=self.config.slow_rank_factor, steps=self.config.slow_rank_steps)
        logger.warning("rank %d is slow (busy %.3f s per step vs a median of %.3f s for %d "
                       "steps): moving it to a standby", slow.rank, slow.busy_s,
                       slow.median_busy_s, self.config.slow_rank_steps)
        try:
            self._start_migration({"op": "migrate", "id": f"slow-rank-{slow.rank}-{slow.step}",
                                   "ranks": [slow.rank]})
        except _Rejected as error:
            self.log.write("slow_rank_kept", "migrate", generation=self._generation,
                           rank=slow.rank, reason=str(error))
            logger.warning("rank %d stays where it is: %s", slow.rank, error)
        return None

    def _on_request(self, request: dict[str, Any]) -> None:
        """Answers an operator request (``mover status``, ``mover migrate``)."""
        try:
            if request.get("op") == "status":
                reply = self._status()
            elif request.get("op") == "migrate":
                reply = self._start_migration(request)
            else:
                raise _Rejected(f"unknown request {request.get('op')!r}; valid: status, migrate")
        except _Rejected as error:
            reply = {"ok": False, "error": str(error)}
            if request.get("op") == "migrate":
                self.log.write("migration_rejected", "migrate", generation=self._generation,
                               request=request.get("id"), reason=str(error))
        self._store.set(request_reply_key(request["id"]), json.dumps(reply))

    def _status(self) -> dict[str, Any]:
        return {
            "ok": True,
            "policy": self.config.policy,
            "generation": self._generation,
            "attempt": self._attempt,
            "world_size": self.config.world_size,
            "training": self._layout() is not None,
            "membership": {str(rank): {"process": process,
                                       "node": self._node_of_rank.get(rank)}
                           for rank, process in sorted(self._membership.members.items())},
            "standbys": dict(self._pool.hosts),
            "migrations": [] if self._migration is None else [{
                "ranks": self._migration.ranks,
                "standbys": [item.standby for item in self._migration.plan],
                "state": self._migration_state(self._migration)}],
            "recent_events": self.log.recent(RECENT_EVENTS),
        }

    def _migration_ranks(self, request: dict[str, Any]) -> list[int]:
        world = self.config.world_size
        if request.get("host") is not None:
            host = request["host"]
            nodes = [node for node in self.config.nodes if node.host == host]
            if len(nodes) != 1:
                hosts = ", ".join(sorted({node.host for node in self.config.nodes}))
                raise _Rejected(f"host {host!r} is not one host of this job; hosts: {hosts}"
                                if not nodes else f"host {host!r} runs several nodes of this "
                                "job; move its ranks with --rank")
            return sorted(r for r, n in self._node_of_rank.items() if n == nodes[0].node_rank)
        ranks = request.get("ranks") or []
        if not ranks:
            raise _Rejected("name the ranks to move, or a host")
        bad = [r for r in ranks if not isinstance(r, int) or not 0 <= r < world]
        if bad:
            raise _Rejected(f"rank {bad[0]} does not exist; this job has ranks 0..{world - 1}")
        return sorted(set(ranks))

    def _start_migration(self, request: dict[str, Any]) -> dict[str, Any]:
        if self.config.policy != "resilient":
            raise _Rejected("the job runs with --policy restart; migration needs "
                            "--policy resilient (and --resilient in the script)")
        ranks = self._migration_ranks(request)
        if self._migration is not None:
            busy = sorted(set(ranks) & set(self._migration.ranks))
            if busy:
                raise _Rejected(f"rank(s) {busy} are already being moved; wait until that "
                                "migration is done")
            raise _Rejected(f"a migration of rank(s) {self._migration.ranks} is in progress; "
                            "retry when it is done")
        if self._interruption is not None or self._failed:
            raise _Rejected("the job is recovering from an interruption; retry when it trains "
                            "again")
        if self._layout() is None:
            raise _Rejected("the job has not started training yet; retry in a moment")
        plan = plan_migration(ranks, self._pool, self._node_of_rank,
                              leave_hosts=request.get("host") is not None)
        if isinstance(plan, Fallback):
            raise _Rejected(f"no free standby: {plan.reason}; start the job with more "
                            "--standbys or wait for one to be ready")
        self._begin_migration(request["id"], plan, request.get("fault"))
        return {"ok": True, "ranks": ranks, "standbys": [item.standby for item in plan],
                "generation": self._generation}

    def _begin_migration(self, request_id: str, plan: list[Replacement],
                         fault: Optional[str] = None) -> None:
        now = time.time()
        before = (self._membership, dict(self._node_of_rank))
        self._membership = self._membership.next_generation(plan)
        old = self._plan_generation({"world_size": self.config.world_size, "kind": "migration",
                                     "replacements": [vars(item) for item in plan],
                                     "fault": fault}, link=False)
        interruption = Interruption(kind="migration", rank=plan[0].rank, step=0, how="planned",
                                    injected=False, attempt=self._attempt, recovery="standby",
                                    generation=self._generation)
        interruption.mark("requested", now)
        self.summary.interruptions.append(interruption)
        self._interruption = interruption
        self._migration = _Migration(request_id, plan, old, self._generation, interruption,
                                     before=before)
        self._promote(plan, migration=True)
        self._notify(old, "prepare", next=self._generation)
        for item in plan:
            self.log.write("migration_requested", "migrate", generation=self._generation,
                           rank=item.rank, when=now, standby=item.standby, node=item.node)
        logger.info("generation %d (migration): %s", self._generation,
                    ", ".join(f"rank {i.rank} -> standby {i.standby}" for i in plan))

    @staticmethod
    def _migration_state(migration: _Migration) -> str:
        if not migration.switch_posted:
            return "phase 1: joiners and the other ranks preparing the new groups"
        if not migration.committed:
            return "phase 2: ending the switch iteration"
        if len(migration.handed_over) < len(migration.plan):
            return "phase 2: handing the ranks over"
        return "phase 2: waiting for the first step on the new processes"

    def _on_prepared(self, event: dict[str, Any]) -> Optional[int]:
        """A promoted standby has its groups and model built."""
        migration = self._migration
        if migration is None or event["generation"] != self._generation:
            return None
        migration.prepared.add(event["rank"])
        self.log.write("joiner_prepared", "migrate", generation=self._generation,
                       rank=event["rank"], when=event["time"])
        self._switch_when_prepared(event["time"])
        return None

    def _on_groups_prepared(self, event: dict[str, Any]) -> Optional[int]:
        """A rank that stays has built its part of the next generation's groups."""
        migration = self._migration
        if migration is None or event["generation"] != self._generation:
            return None
        migration.groups_prepared.add(event["rank"])
        self.log.write("groups_prepared", "migrate", generation=self._generation,
                       rank=event["rank"], when=event["time"], build_s=event["build_s"],
                       rebuilt=event["rebuilt"], kept=event["kept"])
        self._switch_when_prepared(event["time"])
        return None

    def _switch_when_prepared(self, now: float) -> None:
        """With every joiner and every staying rank prepared, the switch is due (phase 2)."""
        migration = self._migration
        staying = self.config.world_size - len(migration.plan)
        if (migration.switch_posted or len(migration.prepared) < len(migration.plan)
                or len(migration.groups_prepared) < staying):
            return
        migration.switch_posted = True
        migration.interruption.mark("prepared", now)
        self._notify(migration.old_generation, "switch")

    def _on_boundary(self, event: dict[str, Any]) -> Optional[int]:
        """A rank of the old generation ended its last step there."""
        migration = self._migration
        if migration is None or event["migration"] != migration.generation:
            return None  # a late report of a migration that was cancelled
        migration.boundary[event["rank"]] = (event["time"], event["step_s"])
        self.log.write("boundary", "migrate", generation=event["generation"], rank=event["rank"],
                       when=event["time"], iteration=event["iteration"])
        if len(migration.boundary) == self.config.world_size:
            last, step_s = max(migration.boundary.values())
            migration.interruption.mark("boundary", last)
            migration.interruption.step = event["iteration"]
            migration.interruption.last_step_before = last
            migration.interruption.step_time_before = step_s
            self._commit_switch()
        return None

    def _commit_switch(self) -> None:
        """Every rank ended the switch iteration: the point of no return. The old
        generation's processes switch to the migration's (the leavers exit once handed
        over)."""
        migration = self._migration
        migration.committed = True
        self._store.set(successor_key(migration.old_generation), str(migration.generation))
        self._store.set(switch_decision_key(migration.generation), SWITCH_GO)
        self.log.write("switch_committed", "migrate", generation=migration.generation,
                       ranks=migration.ranks)

    def _on_switch_cancelled(self, event: dict[str, Any]) -> Optional[int]:
        """A rank that had ended the switch iteration goes on in its generation: the
        migration was cancelled before its point of no return."""
        self.log.write("switch_cancelled", "migrate", generation=event["generation"],
                       rank=event["rank"], when=event["time"], migration=event["migration"])
        return None

    def _on_left(self, event: dict[str, Any]) -> Optional[int]:
        """A leaving rank handed its state to its joiner."""
        migration = self._migration
        if migration is None or event["migration"] != migration.generation:
            return None  # a hand-over of a migration that was cancelled
        migration.handed_over.add(event["rank"])
        self.log.write("handed_over", "migrate", generation=event["generation"],
                       rank=event["rank"], when=event["time"], handover_s=event.get("handover_s"),
                       transfer_s=event.get("transfer_s"))
        if len(migration.handed_over) == len(migration.plan):
            migration.interruption.mark("handed_over", event["time"])
            if migration.deferred:
                self._end_migration(ok=True)
                for deferred in migration.deferred:
                    outcome = self._on_failure(deferred)
                    if outcome is not None:
                        return outcome
        return None

    def _on_leaver_exit(self, event: dict[str, Any]) -> Optional[int]:
        """A process that was handing its rank over exited: harmless once it has, a failure
        of the rank before (or the end of training, if it finished its steps first)."""
        migration = self._migration
        if (migration is not None and event["rank"] in migration.ranks
                and event["rank"] not in migration.handed_over):
            if event["returncode"] != 0:
                return self._on_failure(event, leaver=True)
            if not migration.boundary:
                self._cancel_migration(f"rank {event['rank']} finished training before the "
                                       "switch")
                return None
        self.log.write("leaver_exit", "migrate", generation=self._generation, rank=event["rank"],
                       when=event["time"], how=event["how"])
        return None

    def _cancel_migration(self, reason: str, *, failed: bool = False) -> None:
        """Before the switch (training ended, or a process was lost in phase 1): the joiners
        are stopped, the ranks stay, the processes stay in the old generation (the planned one
        is skipped: its namespace is never reused)."""
        migration = self._migration
        if migration is None:
            return
        # Ranks that ended the switch iteration wait for this decision (none in phase 1).
        self._store.set(switch_decision_key(migration.generation), SWITCH_CANCEL)
        for item in migration.plan:
            self._commands.post({"op": "cancel_promotion", "standby": item.standby,
                                 "rank": item.rank})
        self._membership, self._node_of_rank = migration.before
        self._generation = migration.old_generation
        self._store.set(CURRENT_GENERATION_KEY, str(self._generation))
        self._commands.post({"op": "generation", "generation": self._generation})
        if self._interruption is migration.interruption:
            self._interruption = None
        if not failed:
            self.summary.interruptions.remove(migration.interruption)
        self._end_migration(ok=False, error=f"cancelled: {reason}")

    def _on_migration_due(self, event: dict[str, Any]) -> Optional[int]:
        """An injected migration (``--inject-migration``) reached its step; it waits for an
        interruption in progress to end."""
        self._due_migrations.append({"op": "migrate", "ranks": [event["rank"]],
                                     "id": f"injected-r{event['rank']}-s{event['step']}",
                                     "fault": event.get("fault")})
        self._start_due_migration()
        return None

    def _start_due_migration(self) -> None:
        if self._due_migrations and self._interruption is None and not self._failed:
            self._on_request(self._due_migrations.pop(0))

    def _end_migration(self, *, ok: bool, error: Optional[str] = None) -> None:
        migration, self._migration = self._migration, None
        if migration is None:
            return
        item = migration.interruption
        outcome: dict[str, Any] = {"ok": ok, "generation": self._generation}
        if ok:
            outcome["downtime_s"] = item.downtime_s
            self._notify(migration.old_generation, "retire")
        else:
            outcome["error"] = error
        self._store.set(request_done_key(migration.request_id), json.dumps(outcome))
        self.log.write("migration_done" if ok else "migration_failed", "migrate",
                       generation=self._generation, ranks=migration.ranks,
                       downtime_s=outcome.get("downtime_s"), error=error)

    # restart policy and the first steps after any interruption

    def _on_stopped(self, event: dict[str, Any]) -> Optional[int]:
        self._stopped[event["node"]] = event["workers"]
        if self._interruption is not None:
            self._note_last_step(self._interruption, event["workers"])
        if set(self._stopped) != self._nodes:
            return None
        if self._interruption is not None:
            self._interruption.mark("stopped", time.time())
        self.summary.restarts += 1
        self.log.write("restart", "restart", generation=self._generation)
        self._start_attempt(self._attempt + 1)
        return None

    def _on_started(self, event: dict[str, Any]) -> Optional[int]:
        self._started[event["node"]] = event["time"]
        if set(self._started) == self._nodes and self._interruption is not None:
            self._interruption.mark("started", max(self._started.values()))
        return None

    def _on_ready(self, event: dict[str, Any]) -> Optional[int]:
        if event.get("generation", self._generation) != self._generation:
            return None
        self._ready[event["rank"]] = event["time"]
        self.log.write("worker_ready", "job", generation=self._generation, rank=event["rank"],
                       when=event["time"])
        if len(self._ready) == self.config.world_size and self._interruption is not None:
            self._interruption.mark("recovered", max(self._ready.values()))
        return None

    def _on_first_step(self, event: dict[str, Any]) -> Optional[int]:
        if event.get("generation", self._generation) != self._generation:
            return None
        self._first_step[event["rank"]] = event["time"]
        if len(self._first_step) == self.config.world_size and self._interruption is not None:
            item, self._interruption = self._interruption, None
            item.mark("first_step_completed", max(self._first_step.values()))
            self.log.write("resumed", "resume", generation=self._generation,
                           when=item.times["first_step_completed"], downtime_s=item.downtime_s)
            logger.info("training resumed; downtime %.3f s", item.downtime_s or 0.0)
            if self._migration is not None and self._migration.interruption is item:
                self._end_migration(ok=True)
            self._start_due_migration()
        return None

    def _on_node_busy(self, event: dict[str, Any]) -> Optional[int]:
        """A host whose ranks had all moved away got one again (a standby promoted there)."""
        self._done.pop(event["node"], None)
        return None

    def _on_node_done(self, event: dict[str, Any]) -> Optional[int]:
        self._done[event["node"]] = event["steps_completed"]
        self._finished_workers.extend(event["workers"])
        if set(self._done) != self._nodes:
            return None
        self.summary.steps_completed = min(
            (steps for steps in self._done.values() if steps is not None), default=None)
        workers = self._finished_workers
        rss = [w["peak_rss_mb"] for w in workers if w["peak_rss_mb"] is not None]
        steps = [w["median_step_s"] for w in workers if w["median_step_s"] is not None]
        self.summary.worker_peak_rss_mb = max(rss) if rss else None
        self.summary.median_step_time_s = statistics.median(steps) if steps else None
        cpu = [w["cpu_per_step_s"] for w in workers if w.get("cpu_per_step_s") is not None]
        self.summary.median_cpu_per_step_s = statistics.median(cpu) if cpu else None
        return 0
