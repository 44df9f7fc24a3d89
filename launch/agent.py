"""The per-host agent: starts the workers of one host, watches them, obeys the controller.

The agent receives the controller's commands (``start``, ``stop``, ``promote``, ``generation``,
``notice``, ``cancel_promotion``, ``discard_leaver``, ``drop``, ``refill``, ``fence``,
``rejoin``, ``wind_down``, ``finish``, ``abort``; a thread waits for each on the store,
:mod:`mover_plugin.launch.inbox`) and posts what it sees (``joined``,
``started``, ``ready``, ``first_step``, ``worker_exit``, ``leaver_exit``, ``injected``,
``migration_due``, ``hung``, ``standby_ready``, ``standby_exit``, ``stopped``, ``node_done``,
``node_busy``; ``steps``: global rank 0's step ends, batched by
:mod:`mover_plugin.launch.step_times`) as events. It notices a
process's exit within one poll period (10 ms), reads each process's progress pipe to deliver
injected failures at the step they name and to see heartbeats (a process silent past the timeout
its heartbeats announce is killed, so that its exit starts the recovery), and stops every
process when the controller goes away (its store closed, or no heartbeat answered for
:data:`CONTROLLER_TIMEOUT_S`). It beats itself too (:mod:`mover_plugin.launch.liveness`), so
that the controller finds its host lost when it falls silent; a host declared lost is
``fence``d: should its agent still hear that, it stops its processes and exits. Started again,
the agent of a lost host joins the running job (it reads only the commands posted after it
joined) and is told to ``rejoin`` as a spare host.

Besides the workers it starts the host's standby processes (same command, its standby id set in
the environment, no rank) and relabels one as a worker when promoted; in a migration the process
it replaces keeps running as a *leaver* until it has handed its state over and exits. Once the
job is ending (``wind_down``: a rank finished training) it stops every process of the attempt
that holds no rank and starts no standby until the next attempt. A spare
host's agent starts only standbys (one per slot, or on the slots the workers of a lost host
leave it after a restart) and reports its host idle until one of them is promoted. Notices to a
generation are written into every local rank's notice pipe (``mover_plugin.runtime.notices``);
what passes between agent and worker is in :mod:`mover_plugin.contract`. The agent reaches the
controller's stores through its host's relay (:mod:`mover_plugin.launch.store_gate`), and so do
its workers: their ``MASTER_ADDR``/``MASTER_PORT`` and control address name the relay's loopback
ports, and the job's secret stays with the agent.

Run as ``python -m mover_plugin.launch.agent`` with its settings as JSON in ``MOVER_AGENT_CONFIG``
(the launcher does this), or in-process through :class:`Agent`.
"""

from __future__ import annotations

import logging
import os
import selectors
import signal
import sys
import time
from typing import Any, Optional

import torch.distributed as dist

from mover_plugin.contract import (
    ALARM,
    EVENTS_MAILBOX,
    NOTICE_FD_ENV,
    STANDBY_ID_ENV,
    command_problem,
    encode_notice,
)
from mover_plugin.devices import VISIBLE_ENV, free_slot, visible_subset
from mover_plugin.launch.agent_config import AgentConfig
from mover_plugin.launch.faults import FaultDelivery
from mover_plugin.launch.inbox import CommandInbox
from mover_plugin.launch.job_secret import launch_secret
from mover_plugin.launch.liveness import AgentBeat
from mover_plugin.launch.local_process import Worker, process_environment
from mover_plugin.launch.slow_ranks import HostBusyTimes
from mover_plugin.launch.step_times import StepBatch
from mover_plugin.launch.store_gate import CONTROL_TARGET, StoreRelay, attempt_target
from mover_plugin.mailbox import Mailbox
from mover_plugin.processes import (
    describe_exit,
    signal_group,
    start_process,
    stop_processes,
)
from mover_plugin.progress import (
    HEARTBEAT,
    READY,
    SCRIPT_END,
    STANDBY_READY,
    STEP_BEGIN,
    STEP_END,
    ProgressEvent,
)

logger = logging.getLogger(__name__)

AGENT_CONFIG_ENV = "MOVER_AGENT_CONFIG"
POLL_PERIOD_S = 0.01
CONTROLLER_TIMEOUT_S = 30.0
"""The controller unreachable this long (no heartbeat answered: a cut network) makes the agent
stop its processes and exit. The control store is served by its own thread in the
controller's process, so a busy controller still answers."""


class Agent:
    def __init__(self, config: AgentConfig, store: dist.Store, relay: StoreRelay) -> None:
        """``store``: the controller's store, reached through ``relay``, this host's way
        through the job's gate (its workers get the relay's ports)."""
        self.config = config
        self._store = store
        self._store_relay = relay
        self._inbox = CommandInbox(lambda timeout_s: relay.client(CONTROL_TARGET, timeout_s))
        self._events = Mailbox(store, EVENTS_MAILBOX)
        self._workers: list[Worker] = []
        self._selector = selectors.DefaultSelector()
        self._faults = FaultDelivery(config.injections, config.migrations)
        self._attempt = -1
        self._generation = 0
        self._idle_reported = False
        """This host reported itself done because all its ranks moved away."""
        self._winding_down = False
        """The job is ending (``wind_down`` for the current attempt): no standby starts."""
        self._busy = HostBusyTimes()
        self._step_times = StepBatch(self._post)

    def run(self) -> int:
        """Serves the controller until it says ``finish`` (returns 0) or ``abort`` (1)."""
        node = self.config.node
        beat = AgentBeat(lambda: self._store_relay.client(CONTROL_TARGET, CONTROLLER_TIMEOUT_S),
            node.node_rank, unreachable_after_s=CONTROLLER_TIMEOUT_S,
            on_unreachable=self._controller_unreachable, period_s=self.config.beat_period_s)
        beat.start()
        # Commands from before this agent joined are not its own (a host that comes back
        # joins a running job).
        self._inbox.start()
        self._selector.register(self._inbox.fileno, selectors.EVENT_READ, None)
        self._post("joined", host=node.host, nproc=node.nproc, pid=os.getpid())
        try:
            while True:
                for command in self._inbox.take():
                    exit_code = self._obey(command)
                    if exit_code is not None:
                        return exit_code
                self._read_progress(POLL_PERIOD_S)
                self._check_exits()
                self._step_times.post_if_due()
        except (RuntimeError, ConnectionError) as error:  # the controller's store is gone
            logger.error("node %d lost the controller (%s); stopping its workers", node.node_rank,
                         error)
            return 1
        finally:
            beat.stop()
            self._stop_workers()

    def _controller_unreachable(self, silent_s: float) -> None:
        """Called from the heartbeat's thread when the controller has answered no beat for
        :data:`CONTROLLER_TIMEOUT_S`: the main loop is stuck in a call to its store (a cut
        network leaves a call unanswered, not failed), so this thread stops the processes and
        ends the agent."""
        logger.error("node %d lost the controller (no answer for %.0f s); stopping its workers",
                     self.config.node.node_rank, silent_s)
        stop_processes([w.process for w in list(self._workers) if not w.exited],
                       self.config.stop_grace_s)
        os._exit(1)

    # -- commands -------------------------------------------------------------------------

    def _obey(self, command: dict[str, Any]) -> Optional[int]:
        problem = command_problem(command)
        if problem is not None:
            logger.error("node %d ignores a command it cannot obey: %s",
                         self.config.node.node_rank, problem)
            return None
        op = command["op"]
        if op == "start":
            self._generation = command["generation"]
            placed = command["ranks"].get(str(self.config.node.node_rank))
            self._start_workers(command["attempt"],
                                list(self.config.node.ranks) if placed is None else placed)
        elif op == "arm":
            self._faults.arm()
        elif op == "promote":
            self._promote(command["standby"], command["rank"], command["migration"])
        elif op == "notice":
            self._relay(command)
        elif op == "cancel_promotion":
            self._cancel_promotion(command["standby"], command["rank"])
        elif op == "discard_leaver":
            self._discard_leaver(command["rank"])
        elif op == "drop":
            self._drop(command["ranks"])
        elif op == "refill":
            self._refill(command)
        elif op == "wind_down" and command["attempt"] == self._attempt:
            self._wind_down()
        elif op == "rejoin" and command["node"] == self.config.node.node_rank:
            self._rejoin(command)
        elif op == "generation":
            self._generation = command["generation"]
            for worker in self._workers:
                worker.first_step_reported = worker.ready_reported = False
        elif op == "stop" and command["attempt"] == self._attempt:
            progress = [w.progress_fields() for w in self._workers]
            self._stop_workers()
            self._step_times.post()
            self._post("stopped", workers=progress)
        elif op == "fence" and command["node"] == self.config.node.node_rank:
            logger.error("node %d was declared lost by the controller; stopping its processes",
                         self.config.node.node_rank)
            return 1
        elif op == "finish":
            return 0
        elif op == "abort":
            return 1
        return None

    def _start_workers(self, attempt: int, ranks: list[int]) -> None:
        """Starts ``ranks`` (this host's own, or on a spare host those of a lost host) and
        the standbys: ``--standbys``, or on a spare host one per slot no worker uses."""
        self._stop_workers()
        self._attempt = attempt
        self._winding_down = False
        node = self.config.node
        for local_rank, rank in enumerate(ranks):
            self._spawn(rank, local_rank)
        standbys = self.config.standbys - (len(ranks) if node.spare else 0)
        for index in range(standbys):
            self._spawn_standby(f"a{attempt}.n{node.node_rank}.s{index}")
        self._post("started", pids={w.rank: w.process.pid for w in self._workers
                                    if w.rank is not None})
        if not ranks:
            # No rank here until one of its standbys is promoted (then ``node_busy``).
            self._idle_reported = True
            self._post("node_done", steps_completed=None, workers=[])

    def _rejoin(self, command: dict[str, Any]) -> None:
        """This host is back in the running job as a spare host: it starts the standbys the
        controller named, and no worker."""
        self._attempt = command["attempt"]
        self._generation = command["generation"]
        for standby in command["standbys"]:
            self._spawn_standby(standby)
        self._idle_reported = True
        self._post("node_done", steps_completed=None, workers=[])
        logger.info("node %d is back in the job as a spare host (standbys %s)",
                    self.config.node.node_rank, ", ".join(command["standbys"]))

    def _refill(self, command: dict[str, Any]) -> None:
        """Starts a standby the controller asked of this host to refill the pool."""
        if command["node"] != self.config.node.node_rank or command["attempt"] != self._attempt:
            return
        if self._spawn_standby(command["standby"]):
            logger.info("node %d: started standby %s to refill the pool",
                        self.config.node.node_rank, command["standby"])

    def _spawn_standby(self, standby: str) -> bool:
        """Starts standby ``standby`` on the lowest slot no live process here holds, unless
        the job is ending or every GPU is held; returns whether it did."""
        node = self.config.node.node_rank
        if self._winding_down:
            logger.info("node %d: standby %s not started: the job is ending", node, standby)
            return False
        slot = free_slot((w.slot for w in self._workers if w.alive()), self.config.gpus)
        if slot is None:
            how = f"not started: each of the host's {self.config.gpus} GPUs is held"
            logger.error("node %d: standby %s %s", node, standby, how)
            self._post("standby_exit", standby=standby, returncode=1, how=how)
            return False
        self._spawn(None, slot, standby=standby)
        return True

    def _wind_down(self) -> None:
        """The job is ending: every process here that holds no rank (a standby, ready or
        still starting) is stopped, and no standby starts from now on."""
        self._winding_down = True
        running = self._forget([w for w in self._workers if w.rank is None],
                               self.config.stop_grace_s)
        if running:
            logger.info("node %d: the job is ending; stopped standby(s) %s",
                        self.config.node.node_rank, ", ".join(str(w.standby) for w in running))

    def _spawn(self, rank: Optional[int], slot: int, standby: Optional[str] = None) -> None:
        """Starts a worker (or, with ``standby``, a standby) on ``slot`` with a progress pipe;
        tracks it."""
        read_fd, write_fd = os.pipe()
        notice_read, notice_write = os.pipe()
        env = self._worker_env(rank, slot, self._attempt, write_fd)
        env[NOTICE_FD_ENV] = str(notice_read)
        if standby is not None:
            env[STANDBY_ID_ENV] = standby
        process = start_process(list(self.config.command), env,
                                pass_fds=(write_fd, notice_read))
        os.close(write_fd)
        os.close(notice_read)
        os.set_blocking(read_fd, False)
        os.set_blocking(notice_write, False)
        worker = Worker(rank, self._attempt, process, read_fd, notice_write, standby=standby,
                        slot=slot)
        self._selector.register(read_fd, selectors.EVENT_READ, worker)
        self._workers.append(worker)

    def _promote(self, standby: str, rank: int, migration: bool) -> None:
        # The process that held the rank before is gone (or, in a migration, leaving); the
        # standby holds it from now on.
        for worker in [w for w in self._workers if w.rank == rank and w.standby != standby]:
            if worker.exited:
                self._close_pipe(worker)
                self._workers.remove(worker)
            elif migration:
                worker.leaving = True
        for worker in self._workers:
            if worker.standby == standby:
                worker.rank = rank
                worker.ready_reported = worker.first_step_reported = False
                if self._idle_reported:
                    self._idle_reported = False
                    self._post("node_busy")
                return
        # The standby runs on another host: its agent relabels it. If this host's last rank
        # crashed and now runs elsewhere, nothing is left to train here.
        self._report_idle_without_ranks()

    def _report_idle_without_ranks(self) -> None:
        """Once no process here holds a rank, the host is done (``node_done``) unless one of
        its standbys is promoted later (then ``node_busy``)."""
        if not self._idle_reported and all(w.rank is None for w in self._workers):
            self._idle_reported = True
            self._post("node_done", steps_completed=None, workers=[])

    def _relay(self, command: dict[str, Any]) -> None:
        """Writes a notice into every local rank's notice pipe (each process keeps the ones
        of the generation it is in)."""
        if command["kind"] == ALARM:
            # The step ends read so far include the last one before the failure.
            self._step_times.post()
        line = encode_notice({k: v for k, v in command.items() if k != "op"})
        for worker in self._workers:
            if worker.rank is None or worker.exited or worker.notice_pipe < 0:
                continue
            try:
                os.write(worker.notice_pipe, line)
            except (BlockingIOError, BrokenPipeError):
                pass  # a process that reads no notices is exiting or hung (and will be killed)

    def _cancel_promotion(self, standby: str, rank: int) -> None:
        """A migration that cannot happen any more: the promoted standby is stopped and the
        process that held the rank keeps it."""
        self._forget([w for w in self._workers if w.standby == standby and w.rank == rank],
                     self.config.stop_grace_s)
        for worker in self._workers:
            if worker.rank == rank:
                worker.leaving = False
        self._report_idle_without_ranks()  # a growing back called off on a host it had emptied

    def _discard_leaver(self, rank: int) -> None:
        """A migration that failed in its phase 2: the process leaving ``rank`` is stopped
        (its state is taken from a data-parallel twin instead) and forgotten."""
        self._forget([w for w in self._workers if w.rank == rank and w.leaving], 0.0)

    def _drop(self, ranks: list[int]) -> None:
        """The job shrank without the lost ``ranks``: their exited processes are forgotten
        (the host is done once its other workers finish)."""
        self._forget([w for w in self._workers if w.rank in ranks and w.exited], 0.0)
        self._report_idle_without_ranks()

    def _forget(self, workers: list[Worker], grace_s: float) -> list[Worker]:
        """Stops those of ``workers`` still running (SIGTERM, SIGKILL after ``grace_s``) and
        stops tracking all of them; returns the ones it stopped."""
        running = [w for w in workers if not w.exited]
        stop_processes([w.process for w in running], grace_s)
        for worker in workers:
            self._close_pipe(worker)
            self._workers.remove(worker)
        return running

    def _worker_env(self, rank: Optional[int], slot: int, attempt: int,
                    progress_fd: int) -> dict[str, str]:
        env = process_environment(
            self.config.node, self.config.world_size, rank, slot, attempt, self._generation,
            progress_fd, store_port=self._store_relay.port_for(attempt_target(attempt)),
            control_port=self._store_relay.port_for(CONTROL_TARGET))
        if self.config.node.devices and self.config.gpus:
            env[VISIBLE_ENV] = visible_subset(self.config.node.devices, env)
        return env

    def _stop_workers(self) -> None:
        live = [w for w in self._workers if not w.exited]
        stop_processes([w.process for w in live], self.config.stop_grace_s)
        for worker in self._workers:
            self._close_pipe(worker)
        self._workers = []

    # -- watching -------------------------------------------------------------------------

    def _read_progress(self, timeout: float) -> None:
        """Reads what the processes wrote within ``timeout`` (less when a command arrives)."""
        for key, _ in self._selector.select(timeout):
            if key.data is None:
                continue  # the inbox's wake-up: its commands are taken at the next turn
            worker: Worker = key.data
            try:
                data = os.read(worker.pipe, 65536)
            except BlockingIOError:
                continue
            if not data:  # the worker closed its end: it is exiting
                self._close_pipe(worker)
                continue
            for event in worker.reader.feed(data):
                self._on_progress(worker, event)

    def _on_progress(self, worker: Worker, event: ProgressEvent) -> None:
        worker.last_heard = time.monotonic()
        if event.kind == STEP_BEGIN:
            worker.step_begun = event.step
        if event.kind == STEP_END:
            # Every step end counts for the timeline and the steps completed, also one of the
            # generation a migration is leaving (its ranks train on in it until the switch,
            # or to the end of training if the migration is called off).
            self._step_times.add(worker.rank, event.step, event.time, event.duration_s)
            worker.step_completed = event.step
            worker.last_step_end = event.time
            worker.last_step_duration = event.duration_s
            worker.step_durations.append(event.duration_s)
            worker.mark_cpu(event.step)
        if event.kind == HEARTBEAT:
            # A timeout of 0 ends the watch: the process is shutting down.
            worker.hang_timeout_s = event.duration_s or None
        elif event.kind == STANDBY_READY:
            self._post("standby_ready", standby=worker.standby, time=event.time)
        elif event.kind == SCRIPT_END:
            worker.script_status, worker.script_ended_at = event.step, time.monotonic()
        elif event.generation >= 0 and event.generation < self._generation:
            return  # a report from before the current generation, read late
        elif event.kind == READY and not worker.ready_reported:
            worker.ready_reported = True
            self._post("ready", rank=worker.rank, step=event.step, time=event.time)
        elif event.kind == STEP_BEGIN:
            self._maybe_inject(worker, event.step)
        elif event.kind == STEP_END:
            if not worker.first_step_reported:
                worker.first_step_reported = True
                self._post("first_step", rank=worker.rank, step=event.step, time=event.time,
                           duration=event.duration_s)
            if self.config.report_busy and event.busy_s >= 0 and worker.rank is not None:
                self._report_busy(event.step, worker.rank, event.busy_s)

    def _report_busy(self, step: int, rank: int, busy_s: float) -> None:
        """One ``busy`` event per step for all ranks of this host (slow-rank policy)."""
        training = {w.rank for w in self._workers
                    if w.rank is not None and not w.exited and not w.leaving}
        report = self._busy.add(step, rank, busy_s, training)
        if report is not None:
            self._post("busy", step=step, ranks={str(r): b for r, b in report.items()})

    def _maybe_inject(self, worker: Worker, step: int) -> None:
        if worker.leaving or worker.rank is None:
            return
        for migration in self._faults.migrations_due(worker.rank, step):
            self._post("migration_due", rank=worker.rank, step=step, fault=migration.fault)
        injection = self._faults.injection_due(worker.rank, step)
        if injection is None:
            return
        os.kill(worker.process.pid, injection.signal)
        logger.warning("injected %s into rank %d at step %d", injection.signal_name,
                       worker.rank, step)
        self._post("injected", rank=worker.rank, step=step, signal=injection.signal_name)

    def _check_exits(self) -> None:
        for worker in self._workers:
            if worker.exited:
                continue
            if not worker.reap():
                self._check_heartbeat(worker)
                continue
            self._drain(worker)
            worker.exited = True
            # What the process started and left behind (e.g. a checkpoint writer of
            # Megatron-Core's, spawned with multiprocessing) goes with it: it would hold the
            # job's output open and outlive the job.
            signal_group(worker.process, signal.SIGKILL)
            returncode, how = self._outcome(worker)
            if worker.rank is None:
                self._post("standby_exit", standby=worker.standby, returncode=returncode,
                           how=how)
            elif worker.leaving:
                self._post("leaver_exit", returncode=returncode, how=how,
                           **worker.progress_fields())
            else:
                self._post("worker_exit", returncode=returncode, how=how,
                           **worker.progress_fields())
        ranked = [w for w in self._workers if w.rank is not None and not w.leaving]
        leavers = [w for w in self._workers if w.leaving]
        if not ranked and leavers and all(w.exited for w in leavers):
            # Every rank of this host moved away: nothing left to train unless one of its
            # standbys is promoted later (then ``node_busy`` takes this back).
            self._forget(leavers, 0.0)
            self._idle_reported = True
            self._post("node_done", steps_completed=None, workers=[])
            return
        self._bound_teardowns(ranked)
        if ranked and all(w.exited and self._outcome(w)[0] == 0 for w in ranked):
            steps = min(w.step_completed for w in ranked)
            workers = [w.progress_fields() for w in ranked]
            # The standbys left over: stopped as the controller's wind_down would, which may
            # come after (every rank here can end before the first one's exit reached it).
            self._wind_down()
            self._stop_workers()
            self._step_times.post()
            self._post("node_done", steps_completed=steps, workers=workers)

    @staticmethod
    def _outcome(worker: Worker) -> tuple[int, str]:
        """The exit status a rank's process ended with, and how, for the controller: a
        process whose script ended with status 0 finished its rank, whatever its teardown
        did."""
        returncode = worker.process.returncode
        how = describe_exit(returncode)
        if worker.rank is None or worker.script_status != 0 or returncode == 0:
            return returncode, how
        return 0, f"its script ended with exit code 0; its teardown then ended with {how}"

    def _bound_teardowns(self, ranked: list[Worker]) -> None:
        """Once every rank here ended its script with status 0, the processes still tearing
        down ``--exit-timeout-s`` after the last of them ended are stopped: a teardown that
        hangs (a thread that never ends, a communicator's destructor) must not keep a
        finished job from ending. (No heartbeat watches a process once its training ended.)"""
        tearing_down = [w for w in ranked if not w.exited]
        if not tearing_down or any(w.script_status != 0 for w in tearing_down):
            return
        if any(w.exited and self._outcome(w)[0] != 0 for w in ranked):
            return  # a rank that failed: the controller decides
        last = max(w.script_ended_at for w in tearing_down if w.script_ended_at is not None)
        if time.monotonic() - last < self.config.exit_timeout_s:
            return
        logger.warning("rank(s) %s ended their script %.1f s ago and are still tearing down; "
                       "stopping them", [w.rank for w in tearing_down],
                       time.monotonic() - last)
        stop_processes([w.process for w in tearing_down], 0.0)

    def _check_heartbeat(self, worker: Worker) -> None:
        timeout = worker.hang_timeout_s
        if timeout is None or time.monotonic() - worker.last_heard <= timeout:
            return
        worker.hang_timeout_s = None  # report and kill once
        silent = time.monotonic() - worker.last_heard
        logger.warning("rank %s silent for %.1f s; killing it as hung", worker.rank, silent)
        self._post("hung", rank=worker.rank, standby=worker.standby, silent_s=silent)
        worker.process.kill()

    def _drain(self, worker: Worker) -> None:
        """Reads what the worker wrote before exiting."""
        while worker.pipe >= 0:
            try:
                data = os.read(worker.pipe, 65536)
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            for event in worker.reader.feed(data):
                self._on_progress(worker, event)
        self._close_pipe(worker)

    def _close_pipe(self, worker: Worker) -> None:
        if worker.notice_pipe >= 0:
            os.close(worker.notice_pipe)
            worker.notice_pipe = -1
        if worker.pipe < 0:
            return
        try:
            self._selector.unregister(worker.pipe)
        except (KeyError, ValueError):
            pass
        os.close(worker.pipe)
        worker.pipe = -1

    def _post(self, kind: str, **fields: Any) -> None:
        fields.setdefault("time", time.time())
        self._events.post({"kind": kind, "node": self.config.node.node_rank,
                           "attempt": self._attempt, "generation": self._generation, **fields})


def _leave(*_: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(1)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[mover-agent] %(message)s", stream=sys.stderr)
    config = AgentConfig.from_json(os.environ[AGENT_CONFIG_ENV])
    # The launcher stops its agents with SIGTERM: leave through ``finally`` to stop workers,
    # which a second SIGTERM must not cut short.
    signal.signal(signal.SIGTERM, _leave)
    relay = StoreRelay(launch_secret(starts_every_host=False), config.master_addr,
                       config.master_port)
    return Agent(config, relay.client(CONTROL_TARGET, timeout_s=300), relay).run()


if __name__ == "__main__":
    sys.exit(main())
