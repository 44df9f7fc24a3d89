"""The framework-independent resilience runtime of one training process.

A framework adapter (:mod:`mover_plugin.megatron.resilience`,
:mod:`mover_plugin.deepspeed.resilience`) implements the small protocol of
:mod:`mover_plugin.runtime.adapter` — which objects hold process groups, what a rank's state
is and how a joiner loads it, how the ranks agree on where to continue after a crash — and
hands itself to a :class:`ResilienceRuntime`, which holds everything else:

- **Standby and promotion.** A standby blocks in :meth:`ResilienceRuntime.wait_for_promotion`
  until the controller gives it a global rank; it then takes that rank's place in the next
  generation (``init_process_group`` on the generation's store namespace, with the ``mover``
  backend, whose groups the controller's alarm can abort). The adapter covers the default
  group with the framework's groups (:mod:`mover_plugin.comm.world`), so a joiner's default
  group has no connections of its own and no rank ever rebuilds one.
- **The step.** :meth:`ResilienceRuntime.run_step` runs one training iteration. When a peer is
  lost (the controller's alarm aborts the collective this rank waits in, or arrives just after a
  communication error; an error with no alarm is the training code's own and is re-raised,
  :mod:`mover_plugin.runtime.exits`), the survivor leaves the step, switches to the next
  generation — only the groups that contain the lost rank, or that some member left in the
  middle of an operation, are rebuilt (:mod:`mover_plugin.comm.delta`), and every cached
  reference to them is rewritten (:mod:`mover_plugin.runtime.group_switch`) — and the adapter
  brings it to the iteration all ranks continue from; the runtime then sends each joiner its
  state from the live rank the adapter names (:mod:`mover_plugin.runtime.state_transfer`). An
  iteration that spans several calls of the training script (a DeepSpeed data-parallel engine's
  ``forward``, ``backward`` and ``step``) runs through the parts of ``run_step`` instead:
  :meth:`~ResilienceRuntime.open_step`, :meth:`~ResilienceRuntime.recover_in_step` for a
  failed call, and :meth:`~ResilienceRuntime.close_step`.
- **The commit rule.** The adapter puts :meth:`ResilienceRuntime.commit` (a WORLD all-reduce
  every rank enters only with complete gradients) before the optimizer update. It also carries
  "I saw the controller's switch request" so all ranks learn in the same iteration that a
  planned switch is due.
- **No standby ready**: the controller may plan a *shrink* instead
  (:mod:`mover_plugin.shrink`), and the job grows back once standbys are ready again:
  :mod:`mover_plugin.runtime.template_switch`; on pipeline templates every iteration runs
  the adapter's step (:meth:`ResilienceRuntime.train_with`).
- **Where the process is** — a standby, joining, starting, on the job's layout, on pipeline
  templates, growing back — is one explicit :class:`Mode`.
- **Planned migration**: :mod:`mover_plugin.runtime.migration`. **Injected faults** for its
  tests: :mod:`mover_plugin.runtime.faults`.
"""

from __future__ import annotations

import enum
import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mover_plugin.comm import CollectiveAborted, clear_alarm, raise_alarm, register_backend
from mover_plugin.comm.cancel import cancel_when, raise_if_cancelled
from mover_plugin.comm.work import waited_s
from mover_plugin.contract import GenerationPlan, PlanKind
from mover_plugin.errors import LaunchError
from mover_plugin.generations import Replacement
from mover_plugin.layout import ParallelLayout
from mover_plugin.progress import ProgressReporter
from mover_plugin.runtime.adapter import Continuation, FrameworkAdapter, Transfer
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.exits import (
    describe_error,
    device_ready_or_exit,
    exit_now,
    is_lost_peer,
)
from mover_plugin.runtime.faults import FaultInjector
from mover_plugin.runtime.group_switch import GroupSwitcher
from mover_plugin.runtime.heartbeat import Heartbeat
from mover_plugin.runtime.ledger import StepLedger
from mover_plugin.runtime.migration import MigrationParticipant
from mover_plugin.runtime.notices import NoticeWatcher
from mover_plugin.runtime.settings import ResilienceSettings
from mover_plugin.runtime.state_transfer import StateTransfer
from mover_plugin.runtime.template_switch import TemplateSwitch

logger = logging.getLogger(__name__)


class Mode(enum.Enum):
    """Where this process is in the job; the runtime's procedures follow from it."""

    STANDBY = "standby"
    """Started as a standby; not promoted to a rank yet."""
    JOINING = "joining"
    """Promoted to a rank (:attr:`ResilienceRuntime.joiner_of`); trains once it has its
    state."""
    STARTING = "starting"
    """Started with the job; its first step waits until the standbys are ready."""
    ON_JOB_LAYOUT = "on the job's layout"
    """Training on the job's own groups."""
    ON_TEMPLATES = "on pipeline templates"
    """Shrunk: training on pipeline templates with the adapter's step."""
    GROWING_BACK = "growing back"
    """On pipeline templates, and the survivors agreed to grow back at the next step."""


class SwitchPoint(enum.Enum):
    """Where a planned switch agreed on in an iteration happens."""

    END_OF_ITERATION = "at the end of that iteration"
    NEXT_STEP = "at the start of the next step"


class ResilienceRuntime:
    """One process's runtime: generation, rank, the commit gate, switch and state transfer."""

    def __init__(self, settings: ResilienceSettings, control: ControlClient,
                 progress: ProgressReporter, adapter: FrameworkAdapter,
                 faults: Optional[FaultInjector] = None) -> None:
        self.settings = settings
        self.control = control
        self.progress = progress
        self.adapter = adapter
        self.faults = faults or FaultInjector()
        self.generation = control.generation
        self.rank = int(os.environ.get("RANK", "-1"))
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.ledger = StepLedger()
        self.groups = GroupSwitcher(control, adapter, self.timeout)
        self.transfer = StateTransfer(control, adapter, self.ledger, self.timeout)
        self.migration = MigrationParticipant(self)
        self.shrinking = TemplateSwitch(self.groups, adapter)
        self.mode = Mode.STANDBY if control.standby_id is not None else Mode.STARTING
        self.joiner_of: Optional[Replacement] = None
        """For a promoted standby: its replacement (rank, twin)."""
        self._joined: Optional[GenerationPlan] = None
        """For a promoted standby: the plan of the generation it was promoted into (its kind
        says whether it replaces a lost rank, a leaving one, or grows a shrunk job back)."""
        self._received_bytes = 0
        """For a standby promoted to grow a shrunk job back: the state it received."""
        self._heartbeat = Heartbeat(progress, settings.heartbeat_interval_s,
                                    settings.failure_timeout_s)
        progress.measure_busy_time(waited_s)  # for the slow-rank policy
        self._watch: Optional[NoticeWatcher] = None
        self._switch_point = SwitchPoint.END_OF_ITERATION
        """Where a planned switch agreed on in an iteration happens (see
        :meth:`switch_at_next_step`)."""
        self._last_step_s = 0.0
        self._last_step_end = 0.0
        self._own_step: Optional[Callable[[int], Any]] = None
        """The adapter's step that replaces the script's on pipeline templates
        (:meth:`train_with`)."""

    def switch_at_next_step(self) -> None:
        """A planned switch agreed on in an iteration happens at the start of the next
        :meth:`run_step`, not at the end of that iteration: for a training loop that runs
        collectives of its own between two steps, such as Megatron-LM's logging, which the
        leaver, not the joiner, must take part in."""
        self._switch_point = SwitchPoint.NEXT_STEP

    def grow_back_at_next_step(self) -> None:
        """The survivors on pipeline templates agreed, in the iteration that just ran, to grow
        back: the job's own layout is rebuilt at the start of the next :meth:`run_step`."""
        assert self.mode is Mode.ON_TEMPLATES, self.mode
        self.mode = Mode.GROWING_BACK

    @classmethod
    def connect(cls, settings: ResilienceSettings,
                adapter: FrameworkAdapter) -> "ResilienceRuntime":
        """The runtime of a process started by ``mover-launch`` (registers the ``mover``
        backend and starts the heartbeats)."""
        control = ControlClient.from_env()
        if control is None:
            raise LaunchError("the resilience runtime needs the job to run under 'mover-launch'")
        register_backend()
        runtime = cls(settings, control, ProgressReporter.from_env(), adapter)
        runtime._heartbeat.start()
        return runtime

    @property
    def is_standby(self) -> bool:
        """Whether this process was started as a standby (promoted or not)."""
        return self.control.standby_id is not None

    def timeout(self) -> timedelta:
        return timedelta(seconds=self.settings.collective_timeout_s)

    # -- start-up -------------------------------------------------------------------------

    def wait_for_promotion(self) -> None:
        """A standby reports ready and blocks until the controller gives it a rank."""
        self.progress.standby_ready()
        promotion = self.control.wait_for_promotion()
        self.rank, self.generation = promotion["rank"], promotion["generation"]
        self.control.generation = self.progress.generation = self.generation
        plan = self.control.wait_for_plan(self.generation)
        self.joiner_of = plan.replacement_of(self.rank)
        if self.joiner_of is None:
            raise LaunchError(f"standby {self.control.standby_id} was promoted to rank "
                              f"{self.rank}, which generation {self.generation} does not replace")
        self._joined = plan
        self.mode = Mode.JOINING
        self.faults.arm(plan.fault)
        os.environ["RANK"] = str(self.rank)
        logger.warning("standby %s promoted to rank %d in generation %d",
                       self.control.standby_id, self.rank, self.generation)

    def init_distributed(self, layout: Optional[ParallelLayout]) -> None:
        """``init_process_group`` for this generation with abortable groups, then the
        framework's groups; the first rank publishes the layout for the controller (None: the
        adapter publishes it once the framework has made its groups)."""
        self.progress.generation = self.generation
        self._watch = NoticeWatcher.from_env(self.generation, raise_alarm,
                                             self.migration.on_switch_notice,
                                             self.migration.on_prepare_notice)
        if self._watch is None:
            raise LaunchError("the resilience runtime needs the job to run under "
                              "'mover-launch' (no notice pipe from its agent)")
        if self.mode is not Mode.JOINING:
            self._init_groups()
            if self.rank == 0 and layout is not None:
                self.control.publish_layout(layout)
            return
        while True:
            try:
                with cancel_when(self._superseded):
                    self._init_groups()
                return
            except Exception as error:  # noqa: BLE001 - filtered just below
                self._switch_again_or_raise("building its groups", error)
                self.groups.tear_down()
            self._follow_as_joiner()

    def _init_groups(self) -> None:
        # The others' default group is covered by their other groups: a joiner's needs no
        # connections of its own (mover_plugin.comm.world).
        self.groups.init_world(self.generation, self.rank, self.world_size,
                               connect=self.mode is not Mode.JOINING)

    def begin(self, applied: int) -> int:
        """A rank that started with the job begins at ``applied`` completed iterations."""
        self.ledger.applied = applied
        self.mode = Mode.STARTING
        return applied

    def join(self, adopted: bool = False) -> int:
        """A joiner's first iteration, with its state from a live rank (or a checkpoint)."""
        started = time.time()
        self.faults.at("joiner", self.rank)
        self.control.post("prepared", rank=self.rank, standby=self.control.standby_id,
                          time=started, adopted=adopted)
        target = self._continue_as_joiner()
        self.mode = Mode.ON_JOB_LAYOUT
        self.control.post("switched", rank=self.rank, role="joiner", time=time.time(),
                          build_s=time.time() - started, adopted=adopted,
                          received_bytes=self._received_bytes)
        return target

    def _continue_as_joiner(self) -> int:
        """In a migration the state and iteration come from the leaver; after a crash the
        ranks agree on the iteration first, with the joiner. A crash's switch superseded by
        the next generation (another rank lost meanwhile) is joined again in that one."""
        joined = self._joined.kind if self._joined is not None else PlanKind.CRASH
        if joined is PlanKind.MIGRATION:
            self._receive_or_exit(Transfer.HANDOVER_RECEIVED)
            return self.ledger.applied
        if joined is PlanKind.GROW:
            assert self._joined is not None
            continuation = self.shrinking.join(self._joined)
            self._received_bytes = continuation.received_bytes
            return continuation.iteration
        plan: Optional[GenerationPlan] = None
        while True:
            try:
                with cancel_when(self._superseded):
                    return self._join_in(plan)
            except Exception as error:  # noqa: BLE001 - filtered just below
                self._switch_again_or_raise("joining", error)
            plan = self._follow_as_joiner()

    def _join_in(self, plan: Optional[GenerationPlan]) -> int:
        """A joiner's part of a crash's switch: (rejoining, with the new generation's
        ``plan``) its groups rebuilt, then the iteration agreed and its state received."""
        if plan is not None:
            self.groups.rebuild_after_crash(self.generation, self.world_size, plan)
        # An alarm that came before this generation's groups existed did not abort them.
        raise_if_cancelled()
        continuation = self.adapter.continue_as_joiner()
        if not continuation.rolled_back:
            self.transfer.receive(self.generation, self.rank, Transfer.COPY_RECEIVED)
        return continuation.iteration

    def _follow_as_joiner(self) -> GenerationPlan:
        """After the switch this joiner took part in was superseded: moves to the next
        generation and returns its plan, which gives this process its rank again (otherwise
        the controller gave up the switch, and the process exits)."""
        self.advance_generation()
        plan = self.control.wait_for_plan(self.generation)
        replacement = self._replacement_in(plan)
        if replacement is None:
            logger.error("rank %d: generation %d does not keep this process in its place; "
                         "exiting", self.rank, self.generation)
            self.finish()
            exit_now(status=1)
        self.joiner_of = replacement
        self.progress.generation = self.generation
        clear_alarm()  # the superseded generation's alarm; its groups are gone or replaced
        return plan

    def _replacement_in(self, plan: GenerationPlan) -> Optional[Replacement]:
        """This process's replacement in ``plan`` (a promoted standby carried over from a
        switch still under way), or None."""
        replacement = plan.replacement_of(self.rank)
        if replacement is None or replacement.standby != self.control.standby_id:
            return None
        return replacement

    def _superseded(self) -> Optional[str]:
        """The cancel check of a switch (:mod:`mover_plugin.comm.cancel`): why the generation
        being switched to is no longer wanted — the controller planned the next one because
        another rank was lost meanwhile — or None."""
        if self.control.has_successor(self.generation):
            return f"generation {self.generation} was superseded"
        return None

    def _switch_again_or_raise(self, doing: str, error: BaseException) -> None:
        """After ``error`` while switching to (or joining) this generation: returns if the
        controller planned the next one (another rank was lost; the switch starts again
        there), and re-raises ``error`` if it is this process's own or no next generation
        comes within the collective timeout."""
        self._raise_unless_lost_peer(error)
        if not self.control.successor_within(self.generation,
                                             self.settings.collective_timeout_s):
            raise error
        logger.warning("rank %d: generation %d ended while %s (%s: %s); switching again",
                       self.rank, self.generation, doing, type(error).__name__,
                       str(error)[:160])

    def _receive_or_exit(self, transfer: Transfer) -> None:
        """Receives this joiner's state; if the process handing it over is lost, the
        controller gives the rank to another standby and this process exits."""
        try:
            self.transfer.receive(self.generation, self.rank, transfer)
        except Exception as error:  # noqa: BLE001 - filtered just below
            self._raise_unless_lost_peer(error)
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
        self.migration.discard()  # of a migration cancelled before its switch

    def leave(self, generation: int, delivered: bool) -> None:
        """A leaver's last act once the switch to ``generation`` is committed: exits with
        status 0, or 1 if its state did not reach the joiner (the controller then recovers the
        rank from a data-parallel twin)."""
        logger.warning("rank %d %s to its replacement in generation %d; exiting", self.rank,
                       "handed over" if delivered else "could not hand over", generation)
        self.finish()
        self.adapter.teardown()
        dist.destroy_process_group()
        exit_now(status=0 if delivered else 1)

    # -- the step -------------------------------------------------------------------------

    def run_step(self, iteration: int, step: Callable[[int], Any]) -> tuple[Any, int]:
        """Runs ``step(iteration)`` until it completes in some generation.

        Returns the step's result (None when the iteration was completed during a switch,
        or when every rank rolled back to a checkpoint) and the number of iterations
        completed.
        """
        snapshot, started = self.open_step()
        while True:
            self.ledger.begin(iteration)
            try:
                result = self._step_for_mode(step)(iteration)
                self.close_step(iteration, started)
                return result, iteration + 1
            except Exception as error:  # noqa: BLE001 - filtered in recover_in_step
                continuation = self.recover_in_step(error, snapshot)
            if continuation.rolled_back or continuation.iteration != iteration:
                self.ledger.end()
                return None, continuation.iteration

    def open_step(self) -> tuple[dict[str, Any], float]:
        """What comes before an iteration's first attempt (called by :meth:`run_step`, or by
        an adapter whose iteration spans several calls of the training script): a switch
        agreed on before it, then the snapshot a redo starts from. Returns the snapshot and
        the time the iteration began."""
        if self.mode is Mode.GROWING_BACK:
            self._grow_back()
        if self.migration.switch_agreed and self._switch_point is SwitchPoint.NEXT_STEP:
            self.migration.switch_at_boundary(self._last_step_s)
        self.progress.generation = self.generation  # deferred after a planned switch
        if self.mode is Mode.STARTING:
            self._wait_for_standbys()
        return self.adapter.capture_snapshot(), time.time()

    def close_step(self, iteration: int, started: float) -> None:
        """What follows an iteration's successful attempt (the adapter's per-step work, then
        the planned switch if it is due at this boundary)."""
        self.adapter.after_step(iteration)
        self.ledger.end()
        self._last_step_end = time.time()
        self._last_step_s = self._last_step_end - started
        if self.migration.switch_agreed and self._switch_point is SwitchPoint.END_OF_ITERATION:
            self.migration.switch_at_boundary(self._last_step_s)

    def recover_in_step(self, error: BaseException, snapshot: dict[str, Any]) -> Continuation:
        """A failed attempt at an iteration: re-raises ``error`` unless a peer was lost;
        otherwise switches to the next generation and returns where all ranks continue (the
        adapter restored ``snapshot`` if the iteration is to be redone)."""
        self._raise_unless_lost_peer(error)
        self._leave_step(error)
        device_ready_or_exit(self.rank, "the switch")
        return self._switch_generation(snapshot)

    def train_with(self, step: Callable[[int], Any]) -> None:
        """The job shrank onto pipeline templates: every iteration runs the adapter's
        ``step`` instead of the script's until the job grows back."""
        self._own_step = step
        self.mode = Mode.ON_TEMPLATES

    def _step_for_mode(self, step: Callable[[int], Any]) -> Callable[[int], Any]:
        """The script's ``step``, or on pipeline templates the adapter's."""
        if self.mode is Mode.ON_TEMPLATES:
            assert self._own_step is not None
            return self._own_step
        return step

    @property
    def switch_requested(self) -> bool:
        """Whether the controller asked this generation to switch at an iteration boundary."""
        return self.migration.switch_requested

    def recover_between_steps(self, error: BaseException) -> int:
        """For a peer lost while this rank ran the training loop's own collectives between
        two steps (Megatron-LM's logging): the same switch as inside a step, from a completed
        iteration (nothing is redone). Re-raises an error that is not a lost peer; returns
        the iteration all ranks are at."""
        return self.recover_in_step(error, {}).iteration

    def _raise_unless_lost_peer(self, error: BaseException) -> None:
        """Returns if ``error`` comes from a lost peer, as the controller's alarm tells
        (:func:`~mover_plugin.runtime.exits.is_lost_peer`); otherwise reports it to the
        controller as an error of this rank's own, so that the job follows its policy instead
        of replacing the rank, and re-raises it."""
        grace_s = self.settings.failure_timeout_s
        if is_lost_peer(error, grace_s):
            return
        logger.error("rank %d: %s: no alarm within %.1f s, so not a lost peer; the error is "
                     "the training code's own", self.rank, type(error).__name__, grace_s)
        self.control.post("worker_error", rank=self.rank, **describe_error(error))
        raise error

    def _wait_for_standbys(self) -> None:
        """Training starts protected: its first step waits until the standbys are ready
        (bounded: a standby lost while warming up must not hold the job)."""
        self.mode = Mode.ON_JOB_LAYOUT
        if not self.control.wait_for_standbys(self.settings.collective_timeout_s):
            logger.warning("rank %d: starting before every standby is ready", self.rank)

    def commit(self) -> None:
        """The WORLD all-reduce every rank enters only with complete gradients. On the job's
        layout it also carries the vote on a planned switch (on pipeline templates the loss
        all-reduce carries the vote on growing back)."""
        step = self.ledger.step
        assert step is not None, "the optimizer was stepped outside run_step"
        step.reached_commit = True
        migration = self.migration
        device_ready_or_exit(self.rank, "the commit vote")
        self.faults.before_vote(self.rank, lambda: migration.switch_requested,
                                self.settings.collective_timeout_s)
        switch = migration.switch_requested and self.mode not in (Mode.ON_TEMPLATES,
                                                                  Mode.GROWING_BACK)
        votes = torch.tensor([1.0, 1.0 if switch else 0.0])
        dist.all_reduce(votes)
        step.passed_commit = True
        if votes[1] > 0:
            migration.agree()
            self.faults.at(f"update={self.rank}", self.rank)

    def roll_back(self, why: str, load: Callable[[], Optional[int]], *,
                  inexact: Optional[str] = None) -> Continuation:
        """Every rank's part of a rollback in place (the process is kept): ``load()`` puts the
        last checkpoint back into the model and optimizer and returns its iteration, or None
        when there is none, and then this process exits with status 1 (the launcher sees it at
        once and falls back to restarting the job). ``inexact``: why the training after it
        may differ from the run without the interruption (the event carries it)."""
        started = time.time()
        device_ready_or_exit(self.rank, "the rollback")
        iteration = load()
        if iteration is None:
            logger.error("rank %d: cannot continue in place (%s) and there is no checkpoint "
                         "to roll back to; exiting", self.rank, why)
            self.finish()
            exit_now(status=1)
        self.ledger.applied = iteration
        self.control.post("rolled_back", rank=self.rank, iteration=iteration, reason=why,
                          load_s=time.time() - started, inexact=inexact, time=time.time())
        logger.warning("rank %d rolled back to the checkpoint of iteration %d: %s%s", self.rank,
                       iteration, why, "" if inexact is None else f"; inexact: {inexact}")
        return Continuation(iteration, rolled_back=True)

    def _leave_step(self, error: BaseException) -> None:
        cause = "alarm" if isinstance(error, CollectiveAborted) else "peer error"
        self.control.post("left_step", rank=self.rank, cause=cause, time=time.time(),
                          error=str(error)[:200])
        step = self.ledger.step
        logger.warning("rank %d left iteration %d of generation %d (%s)", self.rank,
                       step.iteration if step else -1, self.generation, cause)

    # -- generation switch ----------------------------------------------------------------

    def _switch_generation(self, snapshot: dict[str, Any]) -> Continuation:
        """A survivor's switch after a lost rank; returns where all ranks continue. When
        another rank is lost before the switch completes, the controller plans the next
        generation and the switch starts again in that one."""
        started = time.time()
        self.migration.discard()  # a migration under way is called off
        while True:
            self.advance_generation()
            plan = self.control.wait_for_plan(self.generation)
            self.progress.generation = self.generation
            try:
                with cancel_when(self._superseded):
                    if plan.kind is PlanKind.SHRINK:
                        self.world_size = plan.world_size
                        continuation = self.shrinking.shrink(self.generation, self.rank, plan,
                                                             snapshot)
                        replaced = 0
                    elif self._replacement_in(plan) is not None:
                        return self._rejoin(plan, started)
                    else:
                        continuation, replaced = self._survive_in(plan, snapshot)
                break
            except Exception as error:  # noqa: BLE001 - filtered just below
                self._switch_again_or_raise("switching", error)
        self.control.post("switched", rank=self.rank, role="survivor", time=time.time(),
                          switch_s=time.time() - started, references=replaced,
                          received_bytes=continuation.received_bytes)
        return continuation

    def _survive_in(self, plan: GenerationPlan,
                    snapshot: dict[str, Any]) -> tuple[Continuation, int]:
        """A survivor's part of a switch: its groups rebuilt where ``plan`` needs, the
        iteration agreed, each of its joiners sent its state. Returns where all ranks continue
        and how many cached references to groups were rewritten."""
        replaced = self.groups.rebuild_after_crash(self.generation, self.world_size, plan)
        continuation = self.adapter.continue_after_crash(plan, snapshot)
        for lost, sender in continuation.senders.items():
            if sender == self.rank:
                self.transfer.send(self.generation, lost, continuation.iteration)
        return continuation, replaced

    def _grow_back(self) -> None:
        """A survivor's switch from pipeline templates back to the job's own layout
        (:meth:`TemplateSwitch.grow_back <mover_plugin.runtime.template_switch.TemplateSwitch.
        grow_back>`), at the start of the step after the one in which the survivors agreed on
        it (the script logs that one from the survivors' world)."""
        ended, step_s = self._last_step_end, self._last_step_s
        self.advance_generation()
        plan = self.control.wait_for_plan(self.generation)
        self.progress.generation = self.generation
        self.world_size = plan.world_size
        grown = self.shrinking.grow_back(self.generation, self.rank, plan)
        self._own_step = None
        self.mode = Mode.ON_JOB_LAYOUT
        self.control.post("switched", rank=self.rank, role="survivor", time=time.time(),
                          switch_s=time.time() - ended, references=grown.references,
                          boundary_end=ended, boundary_step_s=step_s,
                          boundary_step=self.ledger.applied,
                          received_bytes=grown.received_bytes)
        logger.warning("rank %d runs on the job's own layout again (generation %d)", self.rank,
                       self.generation)

    def _rejoin(self, plan: GenerationPlan, started: float) -> Continuation:
        """A promoted standby that was still a joiner when the controller planned ``plan``
        (it may not have its state yet) joins again: its state comes from a twin once more."""
        iteration = self._join_in(plan)
        self.control.post("switched", rank=self.rank, role="joiner", time=time.time(),
                          build_s=time.time() - started, adopted=False)
        return Continuation(iteration)

    def advance_generation(self, generation: Optional[int] = None) -> None:
        """Moves to ``generation`` (by default the one the controller names next)."""
        self.generation = (self.control.wait_for_successor(self.generation)
                           if generation is None else generation)
        self.control.generation = self.generation
        # An alarm of the old generation read from now on is ignored, and one being acted on
        # is done before the alarm is cleared for the new generation's groups.
        self._watch.follow(self.generation)
        self.migration.reset_switch()
