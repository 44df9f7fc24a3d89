"""The job controller: hosts the control-plane store, applies the failure policy, times it.

One controller runs per job, in the ``mover-launch`` process of the first host. It owns the
control-plane TCPStore (which outlives every rank), hosts a fresh rendezvous store for each
*attempt* of the workers (so keys of a previous attempt can never satisfy a new rendezvous),
reads the agents' events and posts commands. With the ``restart`` policy a failed worker
makes it stop every worker and start all again, up to ``max_restarts`` times.
"""

from __future__ import annotations

import logging
import subprocess
import time
from typing import Any, Optional

import torch.distributed as dist

from mover_plugin.errors import LaunchError
from mover_plugin.launch.config import LaunchConfig
from mover_plugin.launch.mailbox import Mailbox
from mover_plugin.launch.summary import Interruption, RunSummary

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
        self._commands = Mailbox(store, "commands")
        self._events = Mailbox(store, "events")
        self._local_agents = local_agents or []
        self._nodes = {node.node_rank for node in config.nodes}
        self._attempt = -1
        self._attempt_store: Optional[dist.TCPStore] = None
        self._reset_attempt_state()
        self._interruption: Optional[Interruption] = None
        self._injected: dict[tuple[int, int], dict[str, Any]] = {}

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
        previous, self._attempt_store = self._attempt_store, dist.TCPStore(
            self.config.master_addr, 0, is_master=True, wait_for_workers=False
        )
        del previous  # the old attempt's workers are gone; its store can close
        self._commands.post(
            {"op": "start", "attempt": attempt, "store_port": self._attempt_store.port}
        )
        logger.info("attempt %d: starting %d workers", attempt, self.config.world_size)

    def _reset_attempt_state(self) -> None:
        self._failed = False
        self._stopped: dict[int, list[dict[str, Any]]] = {}
        self._started: dict[int, float] = {}
        self._ready: dict[int, float] = {}
        self._first_step: dict[int, float] = {}
        self._done: dict[int, int] = {}

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
        if event["attempt"] != self._attempt:
            return None  # a late report about workers of a previous attempt
        handler = getattr(self, f"_on_{kind}", None)
        return handler(event) if handler else None

    def _on_worker_exit(self, event: dict[str, Any]) -> Optional[int]:
        if event["returncode"] == 0:
            return None
        if self._failed:
            logger.info("rank %d also exited (%s)", event["rank"], event["how"])
            return None
        self._failed = True
        self._interruption = self._record_failure(event)
        logger.warning("rank %d failed at step %d (%s)", event["rank"], event["step_begun"],
                       event["how"])
        if self.summary.restarts >= self.config.max_restarts:
            logger.error("no restart left (--max-restarts %d); stopping the job",
                         self.config.max_restarts)
            return 1
        self._commands.post({"op": "stop", "attempt": self._attempt})
        return None

    def _record_failure(self, event: dict[str, Any]) -> Interruption:
        injected = self._injected.get((event["rank"], event["attempt"]))
        interruption = Interruption(
            kind="failure",
            rank=event["rank"],
            step=event["step_begun"],
            how=event["how"],
            injected=injected is not None,
            attempt=event["attempt"],
        )
        interruption.mark("failed", injected["time"] if injected else event["time"])
        interruption.mark("detected", event["time"])
        self._note_last_step(interruption, [event])
        self.summary.interruptions.append(interruption)
        return interruption

    @staticmethod
    def _note_last_step(interruption: Interruption, workers: list[dict[str, Any]]) -> None:
        for worker in workers:
            end = worker.get("last_step_end")
            if end is not None and (interruption.last_step_before is None
                                    or end > interruption.last_step_before):
                interruption.last_step_before = end
                interruption.step_time_before = worker.get("last_step_duration")

    def _on_stopped(self, event: dict[str, Any]) -> Optional[int]:
        self._stopped[event["node"]] = event["workers"]
        if self._interruption is not None:
            self._note_last_step(self._interruption, event["workers"])
        if set(self._stopped) != self._nodes:
            return None
        if self._interruption is not None:
            self._interruption.mark("stopped", time.time())
        self.summary.restarts += 1
        self._start_attempt(self._attempt + 1)
        return None

    def _on_started(self, event: dict[str, Any]) -> Optional[int]:
        self._started[event["node"]] = event["time"]
        if set(self._started) == self._nodes and self._interruption is not None:
            self._interruption.mark("started", max(self._started.values()))
        return None

    def _on_ready(self, event: dict[str, Any]) -> Optional[int]:
        self._ready[event["rank"]] = event["time"]
        if len(self._ready) == self.config.world_size and self._interruption is not None:
            self._interruption.mark("recovered", max(self._ready.values()))
        return None

    def _on_first_step(self, event: dict[str, Any]) -> Optional[int]:
        self._first_step[event["rank"]] = event["time"]
        if len(self._first_step) == self.config.world_size and self._interruption is not None:
            self._interruption.mark("first_step_completed", max(self._first_step.values()))
            logger.info("training resumed; downtime %.3f s", self._interruption.downtime_s or 0.0)
            self._interruption = None
        return None

    def _on_node_done(self, event: dict[str, Any]) -> Optional[int]:
        self._done[event["node"]] = event["steps_completed"]
        if set(self._done) != self._nodes:
            return None
        self.summary.steps_completed = min(self._done.values())
        return 0
