"""The resilience runtime of a Megatron-Core training process (``--resilient``).

Under ``mover-launch --policy resilient`` every worker runs its training steps through
:meth:`MegatronResilience.run_step`. When a rank dies, the survivors leave the failed step (a
communication error, or the controller's alarm aborting the collective they wait in), rebuild
the process groups that contain the lost rank (and any other group left in the middle of an
operation) under the next generation's store namespace, keep the others
(:mod:`mover_plugin.comm.delta`), rewrite every cached reference to a rebuilt group in
``parallel_state``, the model, DDP and optimizer, agree on which side of the optimizer update
each of them is, and redo the dropped iteration with the same micro-batches and the RNG states
saved at its start. A standby process, started and warmed up beforehand (every pipeline role
played in a sandbox, :mod:`mover_plugin.megatron.standby`), takes the lost global rank: it
adopts the model it kept from its warm-up when the rank plays that role, or builds the rank's
model with its collectives kept local, receives parameters, optimizer and scheduler state, RNG
states and the iteration from a data-parallel twin, and joins the loop.

**Planned migration.** When an operator moves a rank (``mover migrate``), phase 1 runs while
training goes on: a standby is promoted to the rank, builds its groups and its model, and every
other rank builds, in a thread of its own, the next generation's version of its groups that
contain the leaving rank (a *prepare* notice starts it). When all are ready the controller posts
a *switch* notice. Each rank carries "I saw it" in the commit all-reduce, so all of them learn
in the same iteration that the switch is due, finish that iteration, and switch at its end
(phase 2): the stayers put the prepared groups in place, and the leaver sends its own state to
the joiner (:mod:`mover_plugin.runtime.handover`) and exits with status 0.

**The commit rule.** The optimizer update of an iteration is applied only after a WORLD
all-reduce that every rank enters with complete, reduced and clipped gradients. If any rank
passed that all-reduce, every rank had reached it, so a survivor that had not yet applied the
update applies it during the switch; if none passed it, nobody applied anything and the
iteration is redone. Either way all ranks continue from the same iteration.

Limitations: the optimizer state must be replicated across data-parallel ranks (no
``--use-distributed-optimizer``); a lost rank needs a live data-parallel twin (otherwise the
controller falls back to the restart baseline); every group uses the ``mover`` backend, so
Megatron's extra gloo groups are not created (``--resilient`` implies
``--disable-gloo-process-groups``).
"""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import signal
import sys
import threading
import time
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
from mover_plugin.errors import LaunchError
from mover_plugin.megatron.checkpoint import capture_rng_state, restore_rng_state
from mover_plugin.megatron.standby import (
    StandbyWarmUp,
    TrainingObjects,
    WarmedStandby,
    parallel_layout,
    warm_up,
)
from mover_plugin.progress import ProgressReporter
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.handover import open_handover, receive_state, send_state
from mover_plugin.runtime.heartbeat import Heartbeat
from mover_plugin.runtime.notices import NoticeWatcher
from mover_plugin.runtime.rewire import rewire, rewire_module_globals

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
class _StepState:
    """Where this rank is in the iteration it runs: the commit record."""

    iteration: int
    reached_commit: bool = False
    passed_commit: bool = False


class MegatronResilience:
    """One process's runtime: generation, rank, the commit gate, switch and state transfer."""

    def __init__(self, args: argparse.Namespace, control: ControlClient,
                 progress: ProgressReporter) -> None:
        self.args = args
        self.settings = args.resilience
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
        self._step: Optional[_StepState] = None
        self._parallel_kwargs: dict[str, Any] = {}
        self._model: Any = None
        self._optimizer: Any = None
        self._scheduler: Any = None
        self._apply_update: Callable[[], bool] = lambda: True
        """The optimizer's own update, without the commit gate (set by :meth:`attach`)."""
        self._heartbeat = Heartbeat(progress, self.settings.heartbeat_interval_s,
                                    self.settings.failure_timeout_s)
        progress.measure_busy_time(waited_s)  # for the slow-rank policy
        self._watch: Optional[NoticeWatcher] = None
        self._switch_requested = False
        """Set by the notice watcher when the controller asks for a planned switch."""
        self._switch_agreed = False
        """Set when the commit all-reduce showed that some rank saw the switch request."""
        self._next_groups: Optional[_GroupPreparation] = None
        """A stayer's groups of the next generation, built during a migration's phase 1."""
        self._warmed: Optional[WarmedStandby] = None
        """A standby's model of the role it kept from its warm-up in the sandbox."""
        self._adopted = False
        """Whether this joiner trains with the model it warmed up (rather than a new one)."""
        self._await_standbys = False
        """Set until the first step of a rank that started with the job."""

    # -- start-up -------------------------------------------------------------------------

    @classmethod
    def start(cls, args: argparse.Namespace,
              warm: Optional[StandbyWarmUp] = None) -> Optional["MegatronResilience"]:
        """None without ``--resilient``. A standby warms up with ``warm`` (when given, see
        :mod:`mover_plugin.megatron.standby`) and then blocks here until it is promoted."""
        if not getattr(args, "resilient", False):
            return None
        control = ControlClient.from_env()
        if control is None:
            raise LaunchError("--resilient needs the job to run under 'mover-launch'")
        register_backend()
        runtime = cls(args, control, ProgressReporter.from_env())
        runtime._heartbeat.start()
        if control.standby_id is not None:
            if warm is not None and runtime.settings.standby_shadow_iterations > 0:
                runtime._warm_up(warm)
            runtime._wait_for_promotion()
        return runtime

    def _warm_up(self, warm: StandbyWarmUp) -> None:
        self._warmed = warm_up(warm, self.world_size, self.settings.standby_shadow_iterations)
        if self._warmed is not None:
            self.control.post("standby_warmed", standby=self.control.standby_id,
                              time=time.time(), **self._warmed.report)

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

    def initialize_distributed(self, **parallel_kwargs: Any) -> None:
        """``init_process_group`` and Megatron's ``initialize_model_parallel`` for this
        generation, with abortable groups."""
        self._parallel_kwargs = dict(parallel_kwargs)
        self.progress.generation = self.generation
        self._watch = NoticeWatcher.from_env(self.generation, raise_alarm,
                                             self._on_switch_notice, self._on_prepare_notice)
        if self._watch is None:
            raise LaunchError("--resilient needs the job to run under 'mover-launch' (no notice "
                              "pipe from its agent)")
        self._init_groups()
        if self.rank == 0 and self.joiner_of is None:
            self.control.publish_layout(parallel_layout(self.world_size, parallel_kwargs))

    def _init_groups(self) -> None:
        from megatron.core import parallel_state

        timeout = timedelta(seconds=self.settings.collective_timeout_s)
        dist.init_process_group(BACKEND_NAME, store=self.control.generation_store(self.generation),
                                rank=self.rank, world_size=self.world_size, timeout=timeout)
        if self._parallel_kwargs.get("create_gloo_process_groups", True):
            raise LaunchError("--resilient needs initialize_model_parallel("
                              "create_gloo_process_groups=False): plain gloo groups can be "
                              "neither left nor replaced")
        parallel_state.initialize_model_parallel(**self._parallel_kwargs)

    def _on_switch_notice(self) -> None:
        self._switch_requested = True

    def _on_prepare_notice(self) -> None:
        current = self.generation
        self._discard_next_groups()  # of a migration that was called off
        self._next_groups = _GroupPreparation(lambda: self._prepare_next_groups(current))

    def _prepare_next_groups(self, current: int) -> Optional[PreparedDelta]:
        """Phase 1 of a migration at a rank of the current generation (in a thread of its
        own): builds the next generation's version of this rank's groups that contain a
        leaving rank. A leaving rank builds nothing."""
        generation = self.control.wait_for_successor(current)
        plan = self.control.wait_for_plan(generation)
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

    def build_model(self, build: Callable[[], TrainingObjects]) -> TrainingObjects:
        """This rank's (model, optimizer, scheduler), from ``build()`` after
        :meth:`initialize_distributed`. A promoted standby adopts the model it warmed up when
        its role is this rank's, and otherwise builds with its collectives kept local (their
        results are overwritten by the state it receives from its twin)."""
        if self.joiner_of is None:
            return build()
        warmed, self._warmed = self._warmed, None
        if warmed is not None:
            objects = warmed.adopt(self.rank,
                                   parallel_layout(self.world_size, self._parallel_kwargs))
            del warmed
            if objects is not None:
                self._adopted = True
                return objects
        from mover_plugin.patches import apply_patches

        with apply_patches("local-collectives"):
            return build()

    def attach(self, model: Any, optimizer: Any, scheduler: Any) -> None:
        """Registers the training objects and puts the commit gate before every update."""
        self._model, self._optimizer, self._scheduler = model, optimizer, scheduler
        update = optimizer.step_with_ready_grads

        def gated_update() -> bool:
            self._commit()
            applied = update()
            self._applied = self._step.iteration + 1 if self._step else self._applied + 1
            return applied

        optimizer.step_with_ready_grads = gated_update
        self._apply_update = update

    def first_iteration(self, load: Callable[[], int]) -> int:
        """The iteration to start from: a joiner's comes from its twin, others ``load()``."""
        if self.joiner_of is None:
            self._applied = load()
            self._await_standbys = True
            return self._applied
        started = time.time()
        self._inject_fault("joiner")
        self.control.post("prepared", rank=self.rank, standby=self.control.standby_id,
                          time=started, adopted=self._adopted)
        # After a crash the survivors agree on the iteration with the joiner; in a migration
        # the iteration comes with the leaver's state.
        target = None if self._joining_migration else self._agree_on_iteration(contribute=False)
        try:
            self._receive_state()
        except Exception as error:  # noqa: BLE001 - filtered just below
            if not is_peer_failure(error):
                raise
            # The controller gives the rank to another standby; this process is discarded.
            logger.warning("rank %d: the process handing the rank over was lost (%s); exiting",
                           self.rank, str(error)[:120])
            self.finish()
            _exit_now(status=1)
        target = self._applied if target is None else target
        self.control.post("switched", rank=self.rank, role="joiner", time=time.time(),
                          build_s=time.time() - started, adopted=self._adopted)
        return target

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
        snapshot = capture_rng_state()
        started = time.time()
        while True:
            self._step = _StepState(iteration)
            try:
                result = step(iteration)
                self._step = None
                if self._switch_agreed:
                    self._planned_switch(time.time() - started)
                return result, iteration + 1
            except Exception as error:  # noqa: BLE001 - filtered just below
                if not is_peer_failure(error):
                    raise
                self._leave_step(error)
            target = self._switch_generation(snapshot)
            if target > iteration:
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
        votes = torch.tensor([1.0, 1.0 if self._switch_requested else 0.0])
        dist.all_reduce(votes)
        self._step.passed_commit = True
        if votes[1] > 0:
            self._switch_agreed = True  # every rank switches at the end of this iteration

    def _leave_step(self, error: BaseException) -> None:
        cause = "alarm" if isinstance(error, CollectiveAborted) else "peer error"
        self.control.post("left_step", rank=self.rank, cause=cause, time=time.time(),
                          error=str(error)[:200])
        logger.warning("rank %d left iteration %d of generation %d (%s)", self.rank,
                       self._step.iteration if self._step else -1, self.generation, cause)

    # -- generation switch (survivors) ----------------------------------------------------

    def _switch_generation(self, snapshot: dict[str, Any]) -> int:
        """A survivor's switch after a lost rank; returns the iteration all ranks are at."""
        started = time.time()
        self._discard_next_groups()  # a migration under way is called off
        self._advance_generation()
        plan = self.control.wait_for_plan(self.generation)
        replaced = self._rebuild_groups({item["rank"] for item in plan["replacements"]})
        self.progress.generation = self.generation
        target = self._agree_on_iteration(contribute=True)
        self._settle_iteration(target, snapshot)
        for item in plan["replacements"]:
            if item["twin"] == self.rank:
                self._send_state(item["rank"], target)
        self.control.post("switched", rank=self.rank, role="survivor", time=time.time(),
                          switch_s=time.time() - started, references=replaced)
        return target

    def _planned_switch(self, step_s: float) -> None:
        """At the end of the iteration every rank agreed on: the leaver hands its rank over
        and exits; the others move to the next generation with the joiner in its place."""
        started = time.time()
        self.control.post("boundary", rank=self.rank, iteration=self._applied, time=started,
                          step_s=step_s)
        plan = self.control.wait_for_plan(self.control.wait_for_successor(self.generation))
        self._fault = plan.get("fault")
        if any(item["rank"] == self.rank for item in plan["replacements"]):
            self._hand_over(plan["generation"])
        preparation, self._next_groups = self._next_groups, None
        if preparation is None:
            raise LaunchError(f"rank {self.rank}: switch to generation {plan['generation']} "
                              "without its groups prepared")
        delta = preparation.result()
        self._advance_generation()
        # The step that just ended is reported in the old generation; the next one in this.
        replaced = self._install_groups(delta)
        self.control.post("switched", rank=self.rank, role="stayer", time=time.time(),
                          switch_s=time.time() - started, references=replaced,
                          rebuilt=len(delta.replacements), kept=len(delta.kept))
        self._inject_fault(f"stayer={self.rank}")

    def _advance_generation(self) -> None:
        self.generation = self.control.wait_for_successor(self.generation)
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
        to replaced groups were rewritten (``parallel_state``, model, DDP, optimizer)."""
        from megatron.core import parallel_state

        clear_alarm()
        replaced = install_delta(delta)
        return (rewire_module_globals(parallel_state, replaced)
                + rewire([self._model, self._optimizer, self._scheduler], replaced))

    def _hand_over(self, generation: int) -> None:
        """The leaver's end: its state goes to the joiner, then the process exits."""
        from megatron.core import parallel_state

        started = time.time()
        group = open_handover(self.control.store, generation, self.rank, source=True,
                              timeout=timedelta(seconds=self.settings.collective_timeout_s))
        opened = time.time()
        self._inject_fault("leaver")
        send_state(group, self._state_tensors(), self._state_blob(self._applied))
        group.shutdown()
        self.control.post("left", rank=self.rank, role="leaver", time=time.time(),
                          handover_s=time.time() - started, transfer_s=time.time() - opened)
        logger.warning("rank %d handed over to its replacement in generation %d; exiting",
                       self.rank, generation)
        self.finish()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        _exit_now()

    def _agree_on_iteration(self, *, contribute: bool) -> int:
        """All ranks of the new generation learn the iteration everyone will be at.

        A rank of the previous generation contributes its commit record (a survivor
        interrupted inside ``run_step``, or a stayer at a planned boundary); a joiner, which
        has none, contributes nothing."""
        step = self._step
        mine = None
        if contribute:
            mine = {"applied": self._applied, "passed": step is not None and step.passed_commit}
        records: list[Any] = [None] * self.world_size
        dist.all_gather_object(records, mine)
        return max(r["applied"] + (1 if r["passed"] else 0) for r in records if r is not None)

    def _settle_iteration(self, target: int, snapshot: dict[str, Any]) -> None:
        """Brings this survivor to ``target`` completed iterations."""
        step = self._step
        if self._applied == target - 1 and step is not None and step.reached_commit:
            # Some rank passed the commit: every rank's gradients were complete.
            self._apply_update()
            self._scheduler.step(increment=self.args.global_batch_size)
            self._applied = target
        if self._applied != target:
            raise LaunchError(
                f"rank {self.rank} completed {self._applied} iterations but the job is at "
                f"{target}; it cannot catch up"
            )
        if step is not None and step.iteration == target:
            # The interrupted iteration is dropped and will be redone from its start.
            restore_rng_state(snapshot)

    # -- state transfer -------------------------------------------------------------------

    def _state_tensors(self) -> list[torch.Tensor]:
        return [tensor.data for _, tensor in
                sorted(self._model.module.state_dict(keep_vars=True).items())
                if isinstance(tensor, torch.Tensor)]

    def _state_blob(self, iteration: int) -> dict[str, Any]:
        return {"optimizer": self._optimizer.state_dict(),
                "scheduler": self._scheduler.state_dict(),
                "rng": capture_rng_state(), "iteration": iteration}

    def _send_state(self, joiner: int, target: int) -> None:
        group = open_handover(self.control.store, self.generation, joiner, source=True,
                              timeout=timedelta(seconds=self.settings.collective_timeout_s))
        send_state(group, self._state_tensors(), self._state_blob(target))
        group.shutdown()

    def _receive_state(self) -> None:
        group = open_handover(self.control.store, self.generation, self.rank, source=False,
                              timeout=timedelta(seconds=self.settings.collective_timeout_s))
        state = receive_state(group, self._state_tensors())
        group.shutdown()
        self._optimizer.load_state_dict(state["optimizer"])
        self._scheduler.load_state_dict(state["scheduler"])
        restore_rng_state(state["rng"])
        self._applied = state["iteration"]


def _exit_now(status: int = 0) -> None:
    """Ends a process whose rank lives on elsewhere (a leaver, or a joiner whose hand-over
    failed). ``atexit`` callbacks run and output is flushed, but the interpreter's teardown is
    skipped: for a training process it takes seconds of CPU that the ranks still training on
    this host can use better."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class _GroupPreparation:
    """Runs a stayer's phase-1 group building in a thread of its own; :meth:`result` joins it
    and returns its prepared groups (None at a leaving rank), or raises its error;
    :meth:`abandon` releases them without waiting."""

    def __init__(self, build: Callable[[], Optional[PreparedDelta]]) -> None:
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
