"""A process's part in a planned migration of its generation.

Phase 1 (a *prepare* notice) builds the next generation's version of the groups that contain
the leaving rank in a thread of its own while training goes on (:class:`GroupPreparation`). The
controller's *switch* notice sets :attr:`MigrationParticipant.switch_requested`; the commit
all-reduce carries it, so every rank learns in the same iteration that the switch is due
(:attr:`MigrationParticipant.switch_agreed`). Phase 2, at the end of that iteration
(:meth:`MigrationParticipant.switch_at_boundary`): the leaver sends its own state to the
joiner (:mod:`mover_plugin.runtime.handover`) while every rank waits for the controller's
decision. Once every rank has ended that iteration the switch goes ahead (the others put the
prepared groups in place, the leaver exits with status 0); if a process was lost before, it is
cancelled, and all go on in this generation, where the loss is recovered like any crash.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Protocol

import torch

from mover_plugin.comm.delta import PreparedDelta, discard_delta, prepare_delta
from mover_plugin.errors import LaunchError
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.faults import FaultInjector
from mover_plugin.runtime.group_switch import GroupSwitcher
from mover_plugin.runtime.handover import open_handover, send_state
from mover_plugin.runtime.ledger import StepLedger
from mover_plugin.runtime.state_transfer import StateTransfer

logger = logging.getLogger(__name__)


class MigrationHost(Protocol):
    """What a migration needs of the process it runs in (the worker's
    :class:`~mover_plugin.runtime.resilience.ResilienceRuntime`): its place, its connection to
    the controller, its groups and state, and the two moves only the runtime makes."""

    rank: int
    generation: int
    control: ControlClient
    faults: FaultInjector
    ledger: StepLedger
    groups: GroupSwitcher
    transfer: StateTransfer

    def timeout(self) -> timedelta: ...

    def leave(self, generation: int, delivered: bool) -> None:
        """The leaver's exit once its state was handed over (never returns)."""

    def advance_generation(self, generation: Optional[int] = None) -> None:
        """Moves the process to ``generation``."""


class MigrationParticipant:
    """One process's state in the migrations of the generation it is in."""

    def __init__(self, runtime: MigrationHost) -> None:
        self._runtime = runtime
        self.switch_requested = False
        """Set by the notice watcher when the controller asks for the planned switch."""
        self.switch_agreed = False
        """Set when the commit all-reduce showed that some rank saw the switch request."""
        self._next_groups: Optional[GroupPreparation] = None
        """A stayer's groups of the next generation, built during phase 1."""

    # -- notices (in the watcher's thread: nothing here blocks) ----------------------------

    def on_switch_notice(self) -> None:
        self.switch_requested = True

    def on_prepare_notice(self, generation: int) -> None:
        self.discard()  # of a migration that was called off
        self._next_groups = GroupPreparation(
            generation, lambda: self._prepare_next_groups(generation))

    def agree(self) -> None:
        """The commit all-reduce of this iteration showed that some rank saw the switch
        request: every rank switches at its boundary."""
        self.switch_agreed = True

    def reset_switch(self) -> None:
        """A new generation starts with no switch requested."""
        self.switch_requested = self.switch_agreed = False

    def discard(self) -> None:
        """Drops a migration's prepared groups without waiting (a preparation may still be
        waiting for a joiner that was lost)."""
        preparation, self._next_groups = self._next_groups, None
        if preparation is not None:
            preparation.abandon()

    # -- phase 1 ---------------------------------------------------------------------------

    def _prepare_next_groups(self, generation: int) -> Optional[PreparedDelta]:
        """Builds ``generation``'s version of this rank's groups that contain a leaving rank
        (in a thread of its own). A leaving rank builds nothing."""
        runtime = self._runtime
        plan = runtime.control.wait_for_plan(generation)
        runtime.faults.arm(plan.fault)
        leaving = plan.replaced_ranks
        if runtime.rank in leaving:
            return None
        delta = prepare_delta(runtime.control.generation_store(generation), leaving,
                              timeout=runtime.timeout())
        runtime.control.post("groups_prepared", rank=runtime.rank, generation=generation,
                             time=time.time(), build_s=delta.build_s,
                             rebuilt=len(delta.replacements), kept=len(delta.kept))
        return delta

    # -- phase 2 ---------------------------------------------------------------------------

    def switch_at_boundary(self, step_s: float) -> None:
        """At the end of the iteration every rank agreed on: a leaver hands its state to its
        joiner; then, if the controller commits the switch (every rank ended the iteration),
        the leaver exits and the others move to the next generation with the joiner in its
        place; if it cancels it (a process was lost before), all go on in this one."""
        runtime, started = self._runtime, time.time()
        preparation, self._next_groups = self._next_groups, None
        if preparation is None:
            raise LaunchError(f"rank {runtime.rank}: a planned switch without a migration "
                              "prepared")
        generation = preparation.generation
        runtime.control.post("boundary", rank=runtime.rank, iteration=runtime.ledger.applied,
                             time=started, step_s=step_s, migration=generation)
        plan = runtime.control.wait_for_plan(generation)
        leaving = runtime.rank in plan.replaced_ranks
        hand_over = self._start_hand_over(generation) if leaving else None
        if not runtime.control.wait_for_switch(generation):
            # A hand-over still running is left to end on its own: its joiner is stopped.
            preparation.abandon()
            self.reset_switch()
            runtime.control.post("switch_cancelled", rank=runtime.rank, migration=generation)
            logger.warning("rank %d: the migration to generation %d was cancelled; going on in "
                           "generation %d", runtime.rank, generation, runtime.generation)
            return
        if hand_over is not None:
            thread, delivered = hand_over
            thread.join()
            runtime.leave(generation, delivered.is_set())
        delta = preparation.result()
        runtime.advance_generation(generation)
        # The step that just ended is reported in the old generation; the next one in this.
        replaced = runtime.groups.install(delta)
        runtime.control.post("switched", rank=runtime.rank, role="stayer", time=time.time(),
                             switch_s=time.time() - started, references=replaced,
                             rebuilt=len(delta.replacements), kept=len(delta.kept))
        runtime.faults.at(f"stayer={runtime.rank}", runtime.rank)

    def _start_hand_over(self, generation: int) -> tuple[threading.Thread, threading.Event]:
        """The leaver's end, in a thread of its own while the main thread waits for the
        controller's decision: this iteration's state goes to the joiner. The thread uses a
        store connection of its own, and a hand-over that cannot complete (its joiner was lost,
        even before connecting) never holds up a cancelled migration. Returns the thread and
        an event it sets once the state was delivered."""
        tensors, blob = self._runtime.transfer.outgoing()
        control, delivered = self._runtime.control.clone(), threading.Event()
        thread = threading.Thread(target=self._hand_over,
                                  args=(control, generation, tensors, blob, delivered),
                                  name="mover-handover", daemon=True)
        thread.start()
        return thread, delivered

    def _hand_over(self, control: ControlClient, generation: int, tensors: list[torch.Tensor],
                   blob: dict[str, Any], delivered: threading.Event) -> None:
        runtime, started = self._runtime, time.time()
        try:
            group = open_handover(control.store, generation, runtime.rank, source=True,
                                  timeout=runtime.timeout())
            opened = time.time()
            runtime.faults.at("leaver", runtime.rank)
            send_state(group, tensors, blob)
            group.shutdown()
        except Exception as error:  # noqa: BLE001 - a lost joiner is the controller's to handle
            logger.warning("rank %d: the hand-over to its joiner failed (%s)", runtime.rank,
                           str(error)[:120])
            return
        delivered.set()
        control.post("left", rank=runtime.rank, role="leaver", time=time.time(),
                     migration=generation, handover_s=time.time() - started,
                     transfer_s=time.time() - opened)


class GroupPreparation:
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
