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
copies a data-parallel twin. It publishes the plan (``gen{g+1}/plan``), raises generation
``g``'s alarm (``gen{g}/alarm``: survivors leave the failed step), and promotes the standby.
Without a standby or a twin it falls back to the restart policy, and the event log says why.
"""

from __future__ import annotations

import json
import logging
import statistics
import subprocess
import time
from typing import Any, Optional

import torch.distributed as dist

from mover_plugin.errors import LaunchError
from mover_plugin.generations import Fallback, Membership, StandbyPool, plan_recovery
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.launch.eventlog import EventLog
from mover_plugin.launch.mailbox import Mailbox
from mover_plugin.launch.protocol import (
    CURRENT_GENERATION_KEY,
    LAYOUT_KEY,
    alarm_key,
    plan_key,
    promotion_key,
)
from mover_plugin.launch.summary import Interruption, RunSummary
from mover_plugin.layout import ParallelLayout

logger = logging.getLogger(__name__)

POLL_PERIOD_S = 0.005


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
        self._local_agents = local_agents or []
        self._nodes = {node.node_rank for node in config.nodes}
        self._node_of_rank = {r: n.node_rank for n in config.nodes for r in n.ranks}
        self._attempt = -1
        self._generation = -1
        self._membership = Membership(0, {})
        self._pool = StandbyPool()
        self._attempt_store: Optional[dist.TCPStore] = None
        self._reset_attempt_state()
        self._interruption: Optional[Interruption] = None
        self._injected: dict[tuple[int, int], dict[str, Any]] = {}
        self._hung: set[int] = set()
        self._armed = False
        self._left: dict[int, dict[int, float]] = {}
        """Per generation: when each survivor left its failed step (it may report before the
        agent reports the failure)."""

    def run(self) -> int:
        """Runs the job to its end; returns the launcher's exit code (0: every worker exited 0)."""
        exit_code = 1
        try:
            self._wait_for_agents()
            self._start_attempt(0)
            exit_code = self._serve()
        finally:
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
        self._begin_generation(self._generation + 1)
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
        self._store.set(CURRENT_GENERATION_KEY, str(generation))
        self._ready: dict[int, float] = {}
        self._first_step: dict[int, float] = {}
        self._switched: dict[int, float] = {}

    def _reset_attempt_state(self) -> None:
        self._failed = False
        self._stopped: dict[int, list[dict[str, Any]]] = {}
        self._started: dict[int, float] = {}
        self._done: dict[int, int] = {}
        self._finished_workers: list[dict[str, Any]] = []

    def _serve(self) -> int:
        while True:
            for event in self._events.poll():
                exit_code = self._handle(event)
                if exit_code is not None:
                    return exit_code
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

    def _on_failure(self, event: dict[str, Any]) -> Optional[int]:
        rank = event["rank"]
        interruption = self._record_failure(event)
        self.log.write("worker_failed", "detect", generation=self._generation, rank=rank,
                       when=event["time"], how=event["how"], step=event["step_begun"])
        logger.warning("rank %d failed at step %d (%s)", rank, event["step_begun"], event["how"])
        if self.config.policy == "resilient":
            plan = plan_recovery([rank], self._layout(), self._pool, self._node_of_rank)
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

    def _switch_generation(self, plan: list, interruption: Interruption) -> None:
        old = self._generation
        self._membership = self._membership.next_generation(plan)
        self._begin_generation(old + 1)
        record = {"generation": self._generation, "world_size": self.config.world_size,
                  "replacements": [vars(item) for item in plan]}
        self._store.set(plan_key(self._generation), json.dumps(record))
        self._store.set(alarm_key(old), json.dumps({"reason": f"rank {interruption.rank} lost"}))
        for item in plan:
            self._store.set(promotion_key(item.standby),
                            json.dumps({"rank": item.rank, "generation": self._generation}))
            self._commands.post({"op": "promote", "standby": item.standby, "rank": item.rank})
        self._commands.post({"op": "generation", "generation": self._generation})
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

    def _arm_injections_when_provisioned(self) -> None:
        """Injected failures fire once every standby of the job is ready (at once without)."""
        if self._armed or len(self._pool) < self.config.standbys * len(self._nodes):
            return
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
        if item.recovery != "standby":
            return
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
        self.log.write("switched", "switch", generation=event["generation"],
                       rank=event["rank"], when=event["time"], role=event.get("role"))
        if len(self._switched) == self.config.world_size and self._interruption is not None:
            self._interruption.mark("switched", max(self._switched.values()))
        return None

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
        return None

    def _on_node_done(self, event: dict[str, Any]) -> Optional[int]:
        self._done[event["node"]] = event["steps_completed"]
        self._finished_workers.extend(event["workers"])
        if set(self._done) != self._nodes:
            return None
        self.summary.steps_completed = min(self._done.values())
        workers = self._finished_workers
        rss = [w["peak_rss_mb"] for w in workers if w["peak_rss_mb"] is not None]
        steps = [w["median_step_s"] for w in workers if w["median_step_s"] is not None]
        self.summary.worker_peak_rss_mb = max(rss) if rss else None
        self.summary.median_step_time_s = statistics.median(steps) if steps else None
        return 0
