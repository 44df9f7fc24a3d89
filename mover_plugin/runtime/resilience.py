"""The framework-independent resilience runtime of one training process.

A framework adapter (:mod:`mover_plugin.megatron.resilience`,
:mod:`mover_plugin.deepspeed.resilience`) subclasses :class:`ResilienceRuntime` and fills in
what depends on the framework: which objects hold process groups, how the optimizer update is
gated, what a rank's state is and how a joiner loads it, and how the ranks agree on where to
continue after a crash. Everything else is here:

- **Standby and promotion.** A standby blocks in :meth:`ResilienceRuntime._wait_for_promotion`
  until the controller gives it a global rank; it then takes that rank's place in the next
  generation (``init_process_group`` on the generation's store namespace, with the ``mover``
  backend, whose groups the controller's alarm can abort). The adapter covers the default
  group with the framework's groups (:mod:`mover_plugin.comm.world`), so a joiner's default
  group has no connections of its own and no rank ever rebuilds one.
- **The step.** :meth:`ResilienceRuntime.run_step` runs one training iteration. When a peer is
  lost (a communication error, or the alarm aborting the collective this rank waits in), the
  survivor leaves the step, switches to the next generation — only the groups that contain the
  lost rank, or that some member left in the middle of an operation, are rebuilt
  (:mod:`mover_plugin.comm.delta`), and every cached reference to them is rewritten — and the
  adapter brings it to the iteration all ranks continue from.
- **The commit rule.** The adapter puts :meth:`ResilienceRuntime._commit` (a WORLD all-reduce
  every rank enters only with complete gradients) before the optimizer update. It also carries
  "I saw the controller's switch request" so all ranks learn in the same iteration that a
  planned switch is due.
- **Planned migration.** Phase 1 (a *prepare* notice) builds the next generation's version of
  the groups that contain the leaving rank in a thread of its own while training goes on;
  phase 2, at the end of the agreed iteration, the leaver sends its own state to the joiner
  (:mod:`mover_plugin.runtime.handover`), and every rank waits for the controller's decision:
  once every rank has ended that iteration the switch goes ahead (the others put the prepared
  groups in place, the leaver exits with status 0); if a process was lost before, it is
  cancelled, and all go on in this generation, where the loss is recovered like any crash.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mover_plugin.comm import (
    BACKEND_NAME,
    CollectiveAborted,
    clear_alarm,
    raise_alarm,
    register_backend,
)
from mover_plugin.comm.delta import (
    PreparedDelta,
    agree_on_idle_groups,
    discard_delta,
    install_delta,
    member_groups,
    prepare_delta,
)
from mover_plugin.comm.work import waited_s
from mover_plugin.comm.world import WorldOptions
from mover_plugin.errors import LaunchError
from mover_plugin.layout import ParallelLayout
from mover_plugin.progress import ProgressReporter
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.handover import open_handover, receive_state, send_state
from mover_plugin.runtime.heartbeat import Heartbeat
from mover_plugin.runtime.notices import NoticeWatcher
from mover_plugin.runtime.rewire import rewire, rewire_module_globals
from mover_plugin.runtime.settings import ResilienceSettings

logger = logging.getLogger(__name__)

# Substrings of the errors gloo raises when a peer dies or a collective times out.
_PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out",
                         "timed out", "Broken pipe", "gloo", "Gloo")


def is_peer_failure(error: BaseException) -> bool:
    """True for errors that mean a peer is gone, as opposed to bugs in the training code."""
    if isinstance(error, (CollectiveAborted, dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in
                                                   _PEER_FAILURE_MARKERS)


@dataclass
class StepState:
    """Where this rank is in the iteration it runs: the commit record."""

    iteration: int
    reached_commit: bool = False
    passed_commit: bool = False


def connect_to_controller() -> ControlClient:
    """The control client of a process started by ``mover-launch``; registers the ``mover``
    backend."""
    control = ControlClient.from_env()
    if control is None:
        raise LaunchError("the resilience runtime needs the job to run under 'mover-launch'")
    register_backend()
    return control


class ResilienceRuntime:
    """One process's runtime: generation, rank, the commit gate, switch and state transfer."""

    def __init__(self, settings: ResilienceSettings, control: ControlClient,
                 progress: ProgressReporter) -> None:
        self.settings = settings
        self.control = control
        self.progress = progress
        self.generation = control.generation
        self.rank = int(os.environ.get("RANK", "-1"))
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.joiner_of: Optional[dict[str, Any]] = None
        """For a promoted standby: its replacement record (rank, twin)."""
        self._joining_migration = False
        """For a promoted standby: whether it replaces a leaving rank (else a lost one)."""
        self._fault: Optional[str] = None
        """A fault injected into the migration this process joins (``--inject-migration``)."""
        self._applied = 0
        """Iterations whose optimizer update this rank has applied."""
        self._step: Optional[StepState] = None
        self._heartbeat = Heartbeat(progress, settings.heartbeat_interval_s,
                                    settings.failure_timeout_s)
        progress.measure_busy_time(waited_s)  # for the slow-rank policy
        self._watch: Optional[NoticeWatcher] = None
        self._switch_requested = False
        """Set by the notice watcher when the controller asks for a planned switch."""
        self._switch_agreed = False
        """Set when the commit all-reduce showed that some rank saw the switch request."""
        self._next_groups: Optional[_GroupPreparation] = None
        """A stayer's groups of the next generation, built during a migration's phase 1."""
        self._await_standbys = False
        """Set until the first step of a rank that started with the job."""

    # -- what an adapter provides ---------------------------------------------------------

    def _init_framework_groups(self) -> None:
        """The framework's own groups, right after ``init_process_group`` (if it makes them
        there)."""

    def _group_holders(self) -> tuple[list[Any], list[types.ModuleType]]:
        """The objects and modules whose cached references to groups are rewritten."""
        raise NotImplementedError

    def _capture_snapshot(self) -> dict[str, Any]:
        """What a redone iteration starts from besides the model and optimizer (RNG states,
        the framework's step counters), taken at the start of every step."""
        raise NotImplementedError

    def _restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        raise NotImplementedError

    def _recover(self, plan: dict[str, Any], snapshot: dict[str, Any]) -> int:
        """A survivor's part after a crash, once the groups are switched: returns the
        iteration all ranks continue from (and hands state to a joiner if it is the source)."""
        raise NotImplementedError

    def _join(self) -> int:
        """A joiner's part, once its model is built: gets its state; returns the iteration."""
        raise NotImplementedError

    def _state_tensors(self) -> list[torch.Tensor]:
        """The tensors a leaver sends its joiner (received in place by the joiner)."""
        raise NotImplementedError

    def _state_blob(self) -> dict[str, Any]:
        """Everything else a leaver sends its joiner (besides the snapshot and iteration)."""
        raise NotImplementedError

    def _load_state_blob(self, state: dict[str, Any]) -> None:
        raise NotImplementedError

    def _after_step(self, iteration: int) -> None:
        """Runs at the end of every completed step, before a planned switch."""

    def _teardown_framework(self) -> None:
        """Releases the framework's groups before a leaver exits."""

    def _after_switch(self) -> None:
        """Runs once this rank's groups of the new generation are in place."""

    # -- start-up -------------------------------------------------------------------------

    def _start(self) -> None:
        self._heartbeat.start()

    def _wait_for_promotion(self) -> None:
        self.progress.standby_ready()
        promotion = self.control.wait_for_promotion()
        self.rank, self.generation = promotion["rank"], promotion["generation"]
        self.control.generation = self.progress.generation = self.generation
        plan = self.control.wait_for_plan(self.generation)
        self.joiner_of = next(r for r in plan["replacements"] if r["rank"] == self.rank)
        self._joining_migration = plan.get("kind") == "migration"
        self._fault = plan.get("fault")
        os.environ["RANK"] = str(self.rank)
        logger.warning("standby %s promoted to rank %d in generation %d",
                       self.control.standby_id, self.rank, self.generation)

    def _init_distributed(self, layout: ParallelLayout) -> None:
        """``init_process_group`` for this generation with abortable groups, then the
        framework's groups; the first rank publishes the layout for the controller."""
        self.progress.generation = self.generation
        self._watch = NoticeWatcher.from_env(self.generation, raise_alarm,
                                             self._on_switch_notice, self._on_prepare_notice)
        if self._watch is None:
            raise LaunchError("the resilience runtime needs the job to run under "
                              "'mover-launch' (no notice pipe from its agent)")
        # The others' default group is covered by their other groups: a joiner's needs no
        # connections of its own (mover_plugin.comm.world).
        dist.init_process_group(BACKEND_NAME, store=self.control.generation_store(self.generation),
                                rank=self.rank, world_size=self.world_size,
                                timeout=self._timeout(),
                                pg_options=WorldOptions(connect=self.joiner_of is None))
        self._init_framework_groups()
        if self.rank == 0 and self.joiner_of is None:
            self.control.publish_layout(layout)

    def _on_switch_notice(self) -> None:
        self._switch_requested = True

    def _on_prepare_notice(self, generation: int) -> None:
        self._discard_next_groups()  # of a migration that was called off
        self._next_groups = _GroupPreparation(
            generation, lambda: self._prepare_next_groups(generation))

    def _prepare_next_groups(self, generation: int) -> Optional[PreparedDelta]:
        """Phase 1 of a migration to ``generation`` at a rank of the current generation (in
        a thread of its own): builds that generation's version of this rank's groups that
        contain a leaving rank. A leaving rank builds nothing."""
        plan = self.control.wait_for_plan(generation)
        self._fault = plan.get("fault")
        leaving = {item["rank"] for item in plan["replacements"]}
        if self.rank in leaving:
            return None
        delta = prepare_delta(self.control.generation_store(generation), leaving,
                              timeout=self._timeout())
        self.control.post("groups_prepared", rank=self.rank, generation=generation,
                          time=time.time(), build_s=delta.build_s,
                          rebuilt=len(delta.replacements), kept=len(delta.kept))
        return delta

    def _discard_next_groups(self) -> None:
        """Drops a migration's prepared groups without waiting (a preparation may still be
        waiting for a joiner that was lost)."""
        preparation, self._next_groups = self._next_groups, None
        if preparation is not None:
            preparation.abandon()

    def _timeout(self) -> timedelta:
        return timedelta(seconds=self.settings.collective_timeout_s)

    def _inject_fault(self, fault: str) -> None:
        """Kills this process (SIGKILL) if ``--inject-migration ...:FAULT`` asked for it here."""
        if self._fault == fault:
            logger.warning("rank %d: injected fault %r: killing this process", self.rank, fault)
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def _begin(self, applied: int) -> int:
        """A rank that started with the job begins at ``applied`` completed iterations."""
        self._applied = applied
        self._await_standbys = True
        return applied

    def _first_iteration_of_joiner(self, adopted: bool = False) -> int:
        """A joiner's iteration, with its state from a live rank (or a checkpoint)."""
        started = time.time()
        self._inject_fault("joiner")
        self.control.post("prepared", rank=self.rank, standby=self.control.standby_id,
                          time=started, adopted=adopted)
        target = self._join()
        self.control.post("switched", rank=self.rank, role="joiner", time=time.time(),
                          build_s=time.time() - started, adopted=adopted)
        return target

    def _receive_or_exit(self) -> None:
        """Receives this joiner's state; if the process handing it over is lost, the
        controller gives the rank to another standby and this process exits."""
        try:
            self._receive_state()
        except Exception as error:  # noqa: BLE001 - filtered just below
            if not is_peer_failure(error):
                raise
            logger.warning("rank %d: the process handing the rank over was lost (%s); exiting",
                           self.rank, str(error)[:120])
            self.finish()
            exit_now(status=1)

    def finish(self) -> None:
        """Training is over: the agent stops watching this process's heartbeats, and this
        process stops following the controller's notices."""
        self._heartbeat.stop()
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self._discard_next_groups()  # of a migration cancelled before its switch

    # -- the step -------------------------------------------------------------------------

    def run_step(self, iteration: int, step: Callable[[int], Any]) -> tuple[Any, int]:
        """Runs ``step(iteration)`` until it completes in some generation.

        Returns the step's result (None when the iteration was completed during a switch)
        and the number of iterations completed.
        """
        self.progress.generation = self.generation  # deferred after a planned switch
        if self._await_standbys:
            self._wait_for_standbys()
        snapshot = self._capture_snapshot()
        started = time.time()
        while True:
            self._step = StepState(iteration)
            try:
                result = step(iteration)
                self._after_step(iteration)
                self._step = None
                if self._switch_agreed:
                    self._planned_switch(time.time() - started)
                return result, iteration + 1
            except Exception as error:  # noqa: BLE001 - filtered just below
                if not is_peer_failure(error):
                    raise
                self._leave_step(error)
            target = self._switch_generation(snapshot)
            if target != iteration:
                self._step = None
                return None, target

    def _wait_for_standbys(self) -> None:
        """Training starts protected: its first step waits until the standbys are ready
        (bounded: a standby lost while warming up must not hold the job)."""
        self._await_standbys = False
        if not self.control.wait_for_standbys(self.settings.collective_timeout_s):
            logger.warning("rank %d: starting before every standby is ready", self.rank)

    def _commit(self) -> None:
        """The WORLD all-reduce every rank enters only with complete gradients."""
        assert self._step is not None, "the optimizer was stepped outside run_step"
        self._step.reached_commit = True
        if self._fault is not None and self._fault == f"commit={self.rank}":
            self._die_before_switch_vote()  # an injected fault; never in a plain step
        votes = torch.tensor([1.0, 1.0 if self._switch_requested else 0.0])
        dist.all_reduce(votes)
        self._step.passed_commit = True
        if votes[1] > 0:
            self._switch_agreed = True  # every rank switches at the end of this iteration
            self._inject_fault(f"update={self.rank}")

    def _die_before_switch_vote(self) -> None:
        """The ``commit=S`` fault: this rank waits at the commit for the migration's switch
        notice and dies before voting, so no rank passes the commit of the iteration that was
        to be the switch's (a rank that sees the notice late would vote an iteration after the
        others, past the switch iteration)."""
        deadline = time.monotonic() + self.settings.collective_timeout_s
        while not self._switch_requested and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._switch_requested:
            self._inject_fault(f"commit={self.rank}")

    def _leave_step(self, error: BaseException) -> None:
        cause = "alarm" if isinstance(error, CollectiveAborted) else "peer error"
        self.control.post("left_step", rank=self.rank, cause=cause, time=time.time(),
                          error=str(error)[:200])
        logger.warning("rank %d left iteration %d of generation %d (%s)", self.rank,
                       self._step.iteration if self._step else -1, self.generation, cause)

    # -- generation switch ----------------------------------------------------------------

    def _switch_generation(self, snapshot: dict[str, Any]) -> int:
        """A survivor's switch after a lost rank; returns the iteration all ranks are at."""
        started = time.time()
        self._discard_next_groups()  # a migration under way is called off
        self._advance_generation()
        plan = self.control.wait_for_plan(self.generation)
        replaced = self._rebuild_groups({item["rank"] for item in plan["replacements"]})
        self.progress.generation = self.generation
        target = self._recover(plan, snapshot)
        self.control.post("switched", rank=self.rank, role="survivor", time=time.time(),
                          switch_s=time.time() - started, references=replaced)
        return target

    def _planned_switch(self, step_s: float) -> None:
        """At the end of the iteration every rank agreed on: a leaver hands its state to its
        joiner; then, if the controller commits the switch (every rank ended the iteration),
        the leaver exits and the others move to the next generation with the joiner in its
        place; if it cancels it (a process was lost before), all go on in this one."""
        started = time.time()
        preparation, self._next_groups = self._next_groups, None
        if preparation is None:
            raise LaunchError(f"rank {self.rank}: a planned switch without a migration "
                              "prepared")
        generation = preparation.generation
        self.control.post("boundary", rank=self.rank, iteration=self._applied, time=started,
                          step_s=step_s, migration=generation)
        plan = self.control.wait_for_plan(generation)
        leaving = any(item["rank"] == self.rank for item in plan["replacements"])
        hand_over = self._start_hand_over(generation) if leaving else None
        if not self.control.wait_for_switch(generation):
            # A hand-over still running is left to end on its own: its joiner is stopped.
            preparation.abandon()
            self._switch_requested = self._switch_agreed = False
            self.control.post("switch_cancelled", rank=self.rank, migration=generation)
            logger.warning("rank %d: the migration to generation %d was cancelled; going on in "
                           "generation %d", self.rank, generation, self.generation)
            return
        if hand_over is not None:
            thread, delivered = hand_over
            thread.join()
            self._exit_after_hand_over(generation, delivered.is_set())
        delta = preparation.result()
        self._advance_generation(generation)
        # The step that just ended is reported in the old generation; the next one in this.
        replaced = self._install_groups(delta)
        self.control.post("switched", rank=self.rank, role="stayer", time=time.time(),
                          switch_s=time.time() - started, references=replaced,
                          rebuilt=len(delta.replacements), kept=len(delta.kept))
        self._inject_fault(f"stayer={self.rank}")

    def _advance_generation(self, generation: Optional[int] = None) -> None:
        """Moves to ``generation`` (by default the one the controller names next)."""
        self.generation = (self.control.wait_for_successor(self.generation)
                           if generation is None else generation)
        self.control.generation = self.generation
        # An alarm of the old generation read from now on is ignored, and one being acted on
        # is done before the alarm is cleared for the new generation's groups.
        self._watch.follow(self.generation)
        self._switch_requested = self._switch_agreed = False

    def _rebuild_groups(self, lost: set[int]) -> int:
        """After a crash: rebuilds this generation's groups that contain a lost rank or that
        some member left in the middle of an operation, and keeps the others; returns how many
        cached references to the old ones were rewritten."""
        store = self.control.generation_store(self.generation)
        candidates = {name: entry for name, entry in member_groups().items()
                      if not entry[1].is_default and not lost & set(entry[1].global_ranks)}
        unsettled = agree_on_idle_groups(store, candidates, timeout=self._timeout())
        delta = prepare_delta(store, lost, timeout=self._timeout(), unsettled=unsettled)
        return self._install_groups(delta)

    def _install_groups(self, delta: PreparedDelta) -> int:
        """Puts the next generation's groups in place; returns how many cached references
        to replaced groups were rewritten."""
        clear_alarm()
        replaced = install_delta(delta)
        objects, modules = self._group_holders()
        count = (sum(rewire_module_globals(module, replaced) for module in modules)
                 + rewire(objects, replaced))
        self._after_switch()
        return count

    def _start_hand_over(self, generation: int) -> tuple[threading.Thread, threading.Event]:
        """The leaver's end, in a thread of its own while the main thread waits for the
        controller's decision: this iteration's state goes to the joiner. The thread uses a
        store connection of its own, and a hand-over that cannot complete (its joiner was lost,
        even before connecting) never holds up a cancelled migration. Returns the thread and
        an event it sets once the state was delivered."""
        tensors, blob = self._state_tensors(), self._blob(self._applied)
        control, delivered = self.control.clone(), threading.Event()
        thread = threading.Thread(target=self._hand_over,
                                  args=(control, generation, tensors, blob, delivered),
                                  name="mover-handover", daemon=True)
        thread.start()
        return thread, delivered

    def _hand_over(self, control: ControlClient, generation: int, tensors: list[torch.Tensor],
                   blob: dict[str, Any], delivered: threading.Event) -> None:
        started = time.time()
        try:
            group = open_handover(control.store, generation, self.rank, source=True,
                                  timeout=self._timeout())
            opened = time.time()
            self._inject_fault("leaver")
            send_state(group, tensors, blob)
            group.shutdown()
        except Exception as error:  # noqa: BLE001 - a lost joiner is the controller's to handle
            logger.warning("rank %d: the hand-over to its joiner failed (%s)", self.rank,
                           str(error)[:120])
            return
        delivered.set()
        control.post("left", rank=self.rank, role="leaver", time=time.time(),
                     migration=generation, handover_s=time.time() - started,
                     transfer_s=time.time() - opened)

    def _exit_after_hand_over(self, generation: int, delivered: bool) -> None:
        """The leaver's last act once the switch is committed: exits with status 0, or 1 if
        its state did not reach the joiner (the controller then recovers the rank from a
        data-parallel twin)."""
        logger.warning("rank %d %s to its replacement in generation %d; exiting", self.rank,
                       "handed over" if delivered else "could not hand over", generation)
        self.finish()
        self._teardown_framework()
        dist.destroy_process_group()
        exit_now(status=0 if delivered else 1)

    # -- state transfer -------------------------------------------------------------------

    def _send_state(self, joiner: int, iteration: int) -> None:
        group = open_handover(self.control.store, self.generation, joiner, source=True,
                              timeout=self._timeout())
        send_state(group, self._state_tensors_for(joiner), self._blob(iteration))
        group.shutdown()

    def _blob(self, iteration: int) -> dict[str, Any]:
        return {**self._state_blob(), "snapshot": self._capture_snapshot(),
                "iteration": iteration}

    def _state_tensors_for(self, joiner: int) -> list[torch.Tensor]:
        """The tensors a survivor sends the joiner of a lost rank (by default its own, as a
        data-parallel twin holds the same)."""
        return self._state_tensors()

    def _receive_state(self) -> None:
        group = open_handover(self.control.store, self.generation, self.rank, source=False,
                              timeout=self._timeout())
        state = receive_state(group, self._state_tensors())
        group.shutdown()
        self._load_state_blob(state)
        self._restore_snapshot(state["snapshot"])
        self._applied = state["iteration"]


def exit_now(status: int = 0) -> None:
    """Ends a process whose rank lives on elsewhere (a leaver, or a joiner whose hand-over
    failed) or that cannot go on. ``atexit`` callbacks run and output is flushed, but the
    interpreter's teardown is skipped: for a training process it takes seconds of CPU that the
    ranks still training on this host can use better."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class _GroupPreparation:
    """Runs a stayer's phase-1 group building for the migration to ``generation`` in a thread
    of its own; :meth:`result` joins it and returns its prepared groups (None at a leaving
    rank), or raises its error; :meth:`abandon` releases them without waiting."""

    def __init__(self, generation: int, build: Callable[[], Optional[PreparedDelta]]) -> None:
        self.generation = generation
        self._build = build
        self._lock = threading.Lock()
        self._abandoned = False
        self._delta: Optional[PreparedDelta] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mover-prepare", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            delta = self._build()
        except BaseException as error:  # noqa: BLE001 - handed to the caller of result()
            self._error = error
            return
        with self._lock:
            if not self._abandoned:
                self._delta = delta
                return
        if delta is not None:
            discard_delta(delta)

    def abandon(self) -> None:
        """The groups will not be used: released now, or by the thread when it finishes."""
        with self._lock:
            self._abandoned = True
            delta, self._delta = self._delta, None
        if delta is not None:
            discard_delta(delta)

    def result(self) -> Optional[PreparedDelta]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._delta
