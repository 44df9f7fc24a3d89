"""The job controller: hosts the control-plane store, applies the failure policy, times it.

One controller runs per job, in the ``mover-launch`` process of the first host. It owns the
control-plane TCPStore (which outlives every rank), reads the agents' and workers' events and
the operators' requests, and posts commands. Its work is divided among units that share a
:class:`~mover_plugin.launch.context.Context` (the job's settings, store, summary, event log,
and the state of the job, of the current attempt and of the current generation):

* :mod:`~mover_plugin.launch.attempts` — starting the workers (an *attempt*), the standby pool;
* :mod:`~mover_plugin.launch.job_end` — the end of the job: winding it down once a rank
  finished training, ending it once every host's ranks did;
* :mod:`~mover_plugin.launch.timing` — the phases of each interruption;
* :mod:`~mover_plugin.launch.recovery` — crash recovery: a standby in a new generation, the
  survivors on pipeline templates (a shrink), or a restart;
* :mod:`~mover_plugin.launch.grow_back` — a shrunk job back on its own layout once standbys
  are ready;
* :mod:`~mover_plugin.launch.migration` — planned migrations, phase by phase;
* :mod:`~mover_plugin.launch.host_loss` — a host lost with its agent, found by the watch of
  the agents' heartbeats (:mod:`~mover_plugin.launch.liveness`) or, for an agent this process
  started, by its exit;
* :mod:`~mover_plugin.launch.operator_requests` — ``mover status``, ``mover migrate``, injected
  migrations and the slow-rank policy.

Each unit declares the event kinds it handles; the controller merges them into one table
(:func:`handler_table`: no kind handled twice, each one a kind of
:data:`mover_plugin.contract.EVENTS`) and dispatches each valid event of the current attempt
to its handler. An event it cannot act on (an unknown kind, a missing field or one of the
wrong type) is counted in the summary's ``rejected_events`` and logged as ``event_rejected``.
A new kind of recovery is one more unit in :meth:`Controller._units`.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from typing import Any, Mapping, Optional, Sequence

import torch.distributed as dist

from mover_plugin.contract import (
    COMMANDS_MAILBOX,
    EVENTS,
    EVENTS_MAILBOX,
    REQUESTS_MAILBOX,
    event_problem,
)
from mover_plugin.errors import LaunchError
from mover_plugin.launch.attempts import Attempts
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.launch.context import Context, EventHandler, Unit
from mover_plugin.launch.eventlog import EventLog
from mover_plugin.launch.grow_back import GrowBack
from mover_plugin.launch.host_loss import HostLoss
from mover_plugin.launch.job_end import JobEnd
from mover_plugin.launch.liveness import AgentWatch
from mover_plugin.launch.migration import Migrations
from mover_plugin.launch.operator_requests import OperatorRequests
from mover_plugin.launch.recovery import CrashRecovery
from mover_plugin.launch.refill import StandbyRefill
from mover_plugin.launch.step_times import StepTimeline
from mover_plugin.launch.store_gate import StoreGate
from mover_plugin.launch.summary import RunSummary
from mover_plugin.launch.timing import InterruptionTiming
from mover_plugin.mailbox import Mailbox
from mover_plugin.processes import describe_exit, signal_group

logger = logging.getLogger(__name__)

POLL_PERIOD_S = 0.005
REQUEST_POLL_PERIOD_S = 0.05
"""Operator requests wait up to this long: no need to read their mailbox at every poll."""


def handler_table(units: Sequence[Unit]) -> tuple[dict[str, EventHandler], frozenset[str]]:
    """Every unit's handlers in one table, and the kinds dispatched whatever their attempt.
    Raises ValueError when two units claim a kind, or one claims a kind the contract lacks."""
    table: dict[str, EventHandler] = {}
    owner: dict[str, str] = {}
    for unit in units:
        name = type(unit).__name__
        handlers = unit.handlers()
        for kind, handler in handlers.items():
            if kind not in EVENTS:
                raise ValueError(f"{name} handles {kind!r}, which is no event kind of the "
                                 "contract (mover_plugin.contract.EVENTS)")
            if kind in table:
                raise ValueError(f"event kind {kind!r} is claimed by {owner[kind]} and {name}")
            table[kind], owner[kind] = handler, name
        if not unit.ANY_ATTEMPT <= set(handlers):
            raise ValueError(f"{name} takes {sorted(unit.ANY_ATTEMPT - set(handlers))} of any "
                             "attempt without handling them")
    return table, frozenset().union(*(unit.ANY_ATTEMPT for unit in units))


class Controller:
    def __init__(
        self,
        config: LaunchConfig,
        store: dist.Store,
        local_agents: Optional[Mapping[int, subprocess.Popen]] = None,
        gate: Optional[StoreGate] = None,
    ) -> None:
        """``local_agents``: the agent processes this process started, by node; ``gate``:
        the job's port, which the attempts' stores are opened on and whose refused
        connections go into the event log."""
        self.config = config
        self.summary = RunSummary(config.policy, config.world_size, list(config.command),
                                  started_at=time.time())
        self.log = EventLog(config.event_log_path)
        self._ctx = Context(config, store, self.summary, self.log,
                            Mailbox(store, COMMANDS_MAILBOX), gate)
        self._events = Mailbox(store, EVENTS_MAILBOX)
        self._requests = Mailbox(store, REQUESTS_MAILBOX)
        self._local_agents = dict(local_agents or {})
        self._agents = AgentWatch(store, self._ctx.job.nodes, config.agent_timeout_s)
        self._last_requests_poll = 0.0
        self._attempts = Attempts(self._ctx)
        self._job_end = JobEnd(self._ctx)
        self._timing = InterruptionTiming(self._ctx)
        self._recovery = CrashRecovery(self._ctx, self._timing, self._attempts)
        self._migrations = Migrations(self._ctx, self._recovery)
        self._operator = OperatorRequests(self._ctx, self._migrations)
        self._step_timeline = StepTimeline(self._ctx)
        self._refill = StandbyRefill(self._ctx)
        self._grow_back = GrowBack(self._ctx)
        self._host_loss = HostLoss(self._ctx, self._recovery, self._attempts, self._job_end,
                                   self._step_timeline, self._agents)
        self._wire()
        self._handler_of, self._any_attempt = handler_table(self._units())

    def _units(self) -> list[Unit]:
        return [self._attempts, self._timing, self._recovery, self._migrations, self._operator,
                self._step_timeline, self._refill, self._host_loss, self._grow_back,
                self._job_end]

    def _wire(self) -> None:
        # A failure during a migration is the migration's to judge first; the end of training
        # during a growing back calls it off. Then the job winds down.
        self._recovery.add_coordinator(self._migrations)
        self._recovery.add_coordinator(self._grow_back)
        self._recovery.when_rank_finished(self._job_end.rank_finished)
        # Once training runs again, a migration's request is done (first), and an injected
        # migration that waited may start.
        self._timing.when_resumed(self._migrations.on_resumed)
        self._timing.when_resumed(self._operator.on_resumed)
        # The pool refills once training runs again after a recovery in place.
        self._recovery.when_slots_freed(self._refill.freed)
        self._timing.when_resumed(self._refill.on_resumed)
        self._attempts.when_standby_ready(self._refill.standby_ready)
        # A shrunk job grows back once a standby is ready for every lost rank.
        self._attempts.when_standby_ready(self._grow_back.standby_ready)
        self._timing.when_resumed(self._grow_back.on_resumed)
        self._attempts.when_standby_lost(self._refill.standby_lost)
        self._attempts.when_ready_standby_exits(self._refill.replace_exited)
        # A host loss takes its last step before the failure from rank 0's step ends.
        self._step_timeline.when_reported(self._timing.on_steps)

    def run(self) -> int:
        """Runs the job to its end; returns the launcher's exit code (0: every worker exited 0)."""
        exit_code = 1
        try:
            self.start()
            exit_code = self._serve()
        finally:
            self.finish(exit_code)
        return exit_code

    def start(self) -> None:
        """Waits for every host's agent, then starts the first attempt."""
        self._agents.prepare()
        self._wait_for_agents()
        self._agents.start()
        self._attempts.start(0)

    def poll_once(self) -> Optional[int]:
        """One iteration of the serve loop: acts on the events posted since the last one (and
        on the operators' requests, every :data:`REQUEST_POLL_PERIOD_S`); returns the
        launcher's exit code once the job has ended. The commands it sends are posted
        together at its end (:meth:`~mover_plugin.launch.context.Context.one_turn`)."""
        with self._ctx.one_turn():
            return self._poll()

    def _poll(self) -> Optional[int]:
        for event in self._events.poll():
            exit_code = self._handle(event)
            if exit_code is not None:
                return exit_code
        if time.monotonic() - self._last_requests_poll >= REQUEST_POLL_PERIOD_S:
            self._last_requests_poll = time.monotonic()
            for request in self._requests.poll():
                self._operator.on_request(request)
        self._refill.start_due()
        self._log_refusals()
        return self._check_agents()

    def _log_refusals(self) -> None:
        if self._ctx.gate is None:
            return
        for peer, why in self._ctx.gate.take_refusals():
            self.summary.refused_connections += 1
            self._ctx.record("connection_refused", "job", peer=peer, reason=why)

    def finish(self, exit_code: int) -> None:
        """Ends the job: a migration still in progress fails or completes, the agents finish
        (or abort), the summary and the event log are closed."""
        self._migrations.end_of_job()
        self._ctx.command("finish" if exit_code == 0 else "abort")
        self.summary.finished_at = time.time()
        self.summary.exit_code = exit_code
        self._ctx.record("job_end", "job", exit_code=exit_code)
        self.log.close()

    def _wait_for_agents(self) -> None:
        joined: set[int] = set()
        nodes = self._ctx.job.nodes
        deadline = time.monotonic() + self.config.join_timeout_s
        while joined != nodes:
            for event in self._events.poll():
                if event_problem(event) is None and event["kind"] == "joined":
                    joined.add(event["node"])
                    logger.info("agent of node %d (%s) joined", event["node"], event["host"])
            for node, agent in self._local_agents.items():
                if agent.poll() is not None:
                    raise LaunchError(f"the agent of node {node} (pid {agent.pid}) exited with "
                                      f"{agent.returncode} before the job started")
            if time.monotonic() > deadline:
                missing = sorted(nodes - joined)
                raise LaunchError(
                    f"agents of nodes {missing} did not join within {self.config.join_timeout_s}s"
                    f" (start 'mover-launch --node-rank N' on those hosts)"
                )
            time.sleep(POLL_PERIOD_S)

    def _serve(self) -> int:
        while True:
            exit_code = self.poll_once()
            if exit_code is not None:
                return exit_code
            time.sleep(POLL_PERIOD_S)

    def _check_agents(self) -> Optional[int]:
        """Takes out of the job each host whose agent exited (one this process started) or
        stopped beating; returns the launcher's exit code when that ends the job."""
        lost = [(node, f"its agent exited ({describe_exit(agent.returncode)})", None)
                for node, agent in self._local_agents.items()
                if node in self._ctx.job.nodes and agent.poll() is not None]
        lost += [(node, f"no heartbeat from its agent for {silent:.1f} s", seen)
                 for node, silent, seen in self._agents.lost()
                 if node not in {item[0] for item in lost}]
        for node, how, last_seen in lost:
            self._agents.forget(node)
            agent = self._local_agents.pop(node, None)  # one that comes back is not ours
            if agent is not None:
                signal_group(agent, signal.SIGKILL)  # silent but maybe alive: fenced for sure
            exit_code = self._host_loss.lost(node, how, last_seen)
            if exit_code is not None:
                return exit_code
        return None

    def _handle(self, event: Any) -> Optional[int]:
        problem = event_problem(event)
        if problem is not None:
            self.summary.rejected_events += 1
            logger.warning("ignored an event the controller cannot act on: %s", problem)
            self._ctx.record("event_rejected", "job", reason=problem)
            return None
        kind = event["kind"]
        if event.get("node") in self._ctx.job.lost_nodes and kind != "joined":
            return None  # a host taken out of the job: what it says no longer counts
        if kind not in self._any_attempt and event["attempt"] != self._ctx.attempt.number:
            return None  # a late report about workers of a previous attempt
        handler = self._handler_of.get(kind)
        return handler(event) if handler else None

    @property
    def handlers(self) -> Mapping[str, EventHandler]:
        """The handler of each event kind the controller acts on while the job runs (the
        agents' first ``joined`` is read before, by :meth:`start`; a later one is a lost host
        coming back)."""
        return self._handler_of
