"""The resilience runtime inside Megatron-LM's own training loop (``megatron.training``).

:class:`MegatronLMResilience` is the Megatron-Core adapter
(:class:`~mover_plugin.megatron.resilience.MegatronResilience`) driven from Megatron-LM's hook
points (:mod:`mover_plugin.patches.megatron_lm_hooks`) instead of a script's own calls. The
drop-in (:mod:`mover_plugin.megatron.training_loop`) creates it when a job runs with
``--resilient``, and forwards to it:

- ``_initialize_distributed``: a standby waits here for its promotion; then
  ``init_process_group`` with the ``mover`` backend on the generation's store, and Megatron-LM's
  own model-parallel set-up on top of it (without its extra gloo groups, which could be
  neither left nor replaced). A joiner's collectives stay local from here until its first
  iteration (``local-collectives``): its start-up's WORLD collectives (start-time all-reduces,
  barriers, the optimizer's all-gather, the data loaders' broadcast) have no partner in a
  running job, and their results are overwritten by the state it receives.
- ``setup_model_and_optimizer``: the commit gate goes before the optimizer update; a joiner
  builds without loading the checkpoint.
- ``build_train_valid_test_data_iterators``: a joiner first receives its state and its place
  in the data (iteration, consumed samples) from a data-parallel twin, so that its data
  iterators start where the job is.
- ``train_step``: every iteration runs through the runtime's ``run_step``. A failed iteration
  is redone with the same micro-batches (:class:`MicroBatchReplay`), the RNG states saved at
  its start, the rerun state machine's iteration counter rewound and the timers it started
  stopped.

With the distributed optimizer a crash either continues in place (the shard's peer copy,
:mod:`mover_plugin.megatron.resilience`) or rolls every rank back to Megatron-LM's last
checkpoint (``--load``), processes kept: each loads it with Megatron-LM's own
``load_checkpoint``, the running ranks leave ``train()`` (:class:`RolledBack`) and the drop-in
builds their data iterators again from the checkpoint's counters and enters ``train()`` anew,
while the joiner goes on through ``pretrain`` from its data iterators as a started process does.

A standby warms up before it waits, with Megatron-LM's own model set-up and ``train_step`` in
the sandbox (:mod:`mover_plugin.megatron.lm_standby`), and adopts the objects of the lost
rank's role where they fit, as a Megatron-Core script's standby does.

With no standby ready the job shrinks onto pipeline templates (once a rank's data iterators
exist it can: :meth:`MegatronLMResilience.after_data_iterators`), with what the script gave
``pretrain`` (:mod:`mover_plugin.megatron.templates.megatron_lm`); each ``train_step`` then trains the
rank's stage and returns what Megatron-LM's would. When it grows back, a survivor's training
data iterator starts again where the job is, and the joining standbys get Megatron-LM's
counters with the schedule.

With virtual pipeline stages each rank holds several model chunks: the drop-in builds their
data iterators as ``pretrain`` does (one per chunk), the state sent to a joiner covers every
chunk, and a redone iteration replays each chunk's micro-batches. With ``--overlap-grad-reduce`` and
``--overlap-param-gather`` the reductions and gathers an interrupted iteration left in flight
are dropped before the redo, and a joiner's first iteration gathers the parameters as the
others' do (:mod:`mover_plugin.megatron.ddp_syncs`).

Not yet on this path: DataLoader worker processes' effect on detection (``--num-workers 0``
keeps it fast).
"""

from __future__ import annotations

import argparse
import logging
import os
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from mover_plugin.comm.world import cover_world
from mover_plugin.errors import LaunchError
from mover_plugin.megatron.checkpoint import restore_rng_state
from mover_plugin.megatron.ddp_syncs import JoinerGathers
from mover_plugin.megatron.distributed_optimizer import ensure_shard_state
from mover_plugin.megatron.lm_counters import counters, data_flags, load_loop_state
from mover_plugin.megatron.lm_standby import (
    PretrainCall,
    lm_warm_up,
    megatron_state_kept,
    without_checkpoint,
)
from mover_plugin.megatron.templates.megatron_lm import (
    MegatronLMLoop,
    lm_stage_recipe,
    lm_template_refusals,
)
from mover_plugin.megatron.templates.shrunk import template_refusals
from mover_plugin.megatron.resilience import MegatronResilience
from mover_plugin.megatron.moe import clear_moe_metrics
from mover_plugin.runtime.adapter import Transfer
from mover_plugin.runtime.handover import module_state_tensors
from mover_plugin.runtime.replay import ReplayableIterator
from mover_plugin.runtime.settings import ResilienceSettings

logger = logging.getLogger(__name__)



class MicroBatchReplay:
    """Makes the data iterators of ``train_step`` replayable (one :class:`ReplayableIterator`
    inside each Megatron ``RerunDataIterator``; a list of them with virtual pipeline stages;
    None where a rank reads no data)."""

    def __init__(self) -> None:
        self._iterators: list[ReplayableIterator] = []

    def begin(self, data_iterator: Any) -> None:
        self._iterators = [self._replayable(d) for d in _as_list(data_iterator)]
        for iterator in self._iterators:
            iterator.begin()

    def rewind(self) -> None:
        for iterator in self._iterators:
            iterator.rewind()

    @staticmethod
    def _replayable(data_iterator: Any) -> ReplayableIterator:
        inner = getattr(data_iterator, "iterable", None)
        if inner is None:
            raise LaunchError(f"--resilient: the data iterator {type(data_iterator).__name__} "
                              "is not Megatron's RerunDataIterator; its micro-batches cannot "
                              "be replayed when an iteration is redone")
        if not isinstance(inner, ReplayableIterator):
            inner = data_iterator.iterable = ReplayableIterator(inner)
        return inner


def _as_list(data_iterator: Any) -> list[Any]:
    if data_iterator is None:
        return []
    if isinstance(data_iterator, list):
        return [d for d in data_iterator if d is not None]
    return [data_iterator]


@dataclass
class StepStart:
    """What a rank knew at the start of its current iteration."""

    iteration: int
    counters: dict[str, int]
    rerun_iteration: int
    """The rerun state machine's iteration counter (it counts every attempt)."""
    started_timers: frozenset[str]


class RolledBack(Exception):
    """Raised out of Megatron-LM's ``train()`` at a running rank once every rank rolled back
    to the checkpoint of ``iteration``: the drop-in enters ``train()`` again from there."""

    def __init__(self, iteration: int) -> None:
        super().__init__(f"rolled back to the checkpoint of iteration {iteration}")
        self.iteration = iteration


class MegatronLMResilience(MegatronResilience):
    """The Megatron-Core adapter, entered from Megatron-LM's hook points (module docstring)."""

    def __init__(self, args: argparse.Namespace,
                 pretrain: Optional[PretrainCall] = None) -> None:
        """``pretrain``: what the script gave Megatron-LM's ``pretrain`` (a standby warms up
        with it; None: it stays cold)."""
        # From the flags, not kept in args: Megatron-LM pickles args into its checkpoints,
        # which must load where mover_plugin is not installed.
        super().__init__(args, ResilienceSettings.from_args(args),
                         loop=MegatronLMLoop(args, self._restart_training_data),
                         reload=self._load_checkpoint)
        self._pretrain = pretrain
        self._initialize: Callable[[], Any] = lambda: None
        self._local: Any = None
        """A joiner's ``local-collectives`` patches, applied until its first iteration."""
        self._joined_rng: Optional[dict[str, Any]] = None
        """A joiner's RNG states received from its twin, put back at its first iteration."""
        self._replay = MicroBatchReplay()
        self._step: Optional[StepStart] = None
        self._training = False
        self._rolled_back = False
        """Set by a rollback until this rank leaves the point it was at."""
        self._held_by_loop: list[Any] = []
        """Objects of Megatron-LM's loop that cache process groups (its checkpointing context,
        whose save strategy keeps the group it parallelizes over)."""
        self.joined_in_place = False
        """A joiner that took its rank in the running loop (not after a rollback, where every
        rank enters ``train()`` anew)."""
        self._train_dataset: Any = None
        """Megatron-LM's training dataset on this rank (None where it builds none)."""
        self._data_iterator: Any = None
        """The training data iterator of the current ``train_step``."""
        # Megatron-LM logs (with collectives) between two train_steps: the leaver of a
        # migration logs the iteration it completed, the joiner starts at the next one.
        self.runtime.switch_at_next_step()
        # The shard copy's exchange overlaps Megatron-LM's own work between two steps.
        self.copy_between_steps = True

    @property
    def is_joiner(self) -> bool:
        return self.runtime.joiner_of is not None

    # -- Megatron-LM's hook points -------------------------------------------------------

    def start_distributed(self, initialize: Callable[[], Any]) -> None:
        """``_initialize_distributed`` under the runtime: a standby warms up and waits for its
        rank; then the generation's default group and Megatron-LM's own groups
        (``initialize()``)."""
        runtime, args = self.runtime, self.args
        self._initialize = initialize
        self._parallel_kwargs = {
            "tensor_model_parallel_size": args.tensor_model_parallel_size,
            "pipeline_model_parallel_size": args.pipeline_model_parallel_size,
            "expert_model_parallel_size": args.expert_model_parallel_size,
            "expert_tensor_parallel_size": args.expert_tensor_parallel_size,
            "create_gloo_process_groups": False,
        }
        self._experts_in_shard = bool(args.use_distributed_optimizer)
        if runtime.is_standby:
            self._warm_up_in_sandbox()
            runtime.wait_for_promotion()
        args.rank = runtime.rank
        runtime.init_distributed(self.job_layout())
        if self.is_joiner:
            self._local = _local_collectives()

    def _warm_up_in_sandbox(self) -> None:
        if self._pretrain is None:
            logger.info("the script did not enter Megatron-LM's pretrain(): the standby stays "
                        "cold")
            return
        if self.runtime.settings.standby_shadow_iterations <= 0:
            return
        with megatron_state_kept(self.args):
            self._warm_up(lm_warm_up(self.args, self._pretrain, self._initialize,
                                     self._parallel_kwargs))

    def setup(self, setup: Callable[[], Any]) -> Any:
        """``setup_model_and_optimizer`` (a joiner adopts its warmed-up role's objects, or
        builds without the checkpoint), then the commit gate; a rank that started with the
        job begins at the loaded iteration."""
        if not self.is_joiner:
            model, optimizer, scheduler = setup()
        elif (adopted := self.adopt_warmed()) is not None:
            model, optimizer, scheduler = adopted
            # What Megatron-LM's set-up writes without a checkpoint; the twin's come next.
            self.args.iteration, self.args.num_floating_point_operations_so_far = 0, 0
        else:
            with without_checkpoint(self.args):
                model, optimizer, scheduler = setup()
        self.attach(model, optimizer, scheduler)
        if not self.is_joiner:
            self.runtime.begin(self.args.iteration)
        return model, optimizer, scheduler

    def before_data_iterators(self) -> None:
        """A joiner receives its state and place in the data before its iterators are
        built."""
        if not self.is_joiner or self._training:
            return
        self._local.revert()
        self.first_iteration(lambda: 0)
        # After a rollback too the others build their data iterators with local collectives
        # (:meth:`rebuild_data_iterators`), and the joiner's start-up between its data
        # iterators and train() has no partner either.
        self.joined_in_place = not self._rolled_back
        self._rolled_back = False
        self._local = _local_collectives()

    def middle_stage_reads_data(self) -> bool:
        """Whether this rank is a middle pipeline stage of a job that may shrink onto pipeline
        templates, where it may be a first or last stage: it builds the training dataset too."""
        from megatron.core import parallel_state

        if (parallel_state.is_pipeline_first_stage(ignore_virtual=True)
                or parallel_state.is_pipeline_last_stage(ignore_virtual=True)):
            return False
        return not (lm_template_refusals(self.args, self._pretrain)
                    or template_refusals(self.args, self.sharded))

    def after_data_iterators(self, train_dataset: Any) -> None:
        """This rank's data iterators exist (``train_dataset``: the training dataset they
        read): the job may shrink onto pipeline templates when a rank is lost and no standby
        is ready (:mod:`mover_plugin.megatron.templates.megatron_lm`); its first rank tells the
        controller so."""
        self._train_dataset = train_dataset
        if self.templates.recipe is not None:
            return  # built again after a rollback: the same dataset
        call = self._pretrain
        refused = lm_template_refusals(self.args, call)
        if train_dataset is None:
            refused.append("this rank holds no training dataset")
        if refused:
            if self.runtime.rank == 0 and not self.is_joiner:
                logger.info("no pipeline templates for this job (%s): a rank lost with no "
                            "standby ready restarts the job", ", ".join(refused))
            return
        assert call is not None
        self.enable_templates(lm_stage_recipe(self.args, call, train_dataset))
        self.templates.publish_spec()

    def entering_train(self, checkpointing_context: Any) -> None:
        """Megatron-LM's ``train()`` is entered (with its ``checkpointing_context``, whose
        cached groups are rewritten after a switch like the model's): after a rollback every
        rank enters it anew, with its collectives (a joiner that took its rank in the running
        loop keeps its collectives local until its first iteration)."""
        if checkpointing_context is not None:
            self._held_by_loop = [checkpointing_context]
        if self._local is not None and not self.joined_in_place:
            self._local.revert()
            self._local = None

    def rebuild_data_iterators(self, build: Callable[[], Any]) -> Any:
        """A running rank's data iterators after a rollback, from the counters the checkpoint
        restored (with local collectives, as a joiner builds them). The timers the left
        ``train()`` had started are stopped: it starts them again."""
        _stop_timers_except(frozenset())
        with _local_collectives():
            return build()

    def train_step(self, train_step: Callable[[], Any], iteration: int,
                   data_iterator: Any) -> Any:
        """One iteration of Megatron-LM's ``train_step`` through the runtime."""
        gathers = None
        if not self._training:
            if self.joined_in_place:
                gathers = JoinerGathers(self.args, self._model)
            self._start_training(iteration)
        self.before_step()
        self._data_iterator = data_iterator
        self._replay.begin(data_iterator)
        self._step = self._step_start(iteration)
        progress = self.progress
        started = time.perf_counter()
        progress.step_begin(iteration + 1)
        if gathers is not None:
            gathers.begin()
        result, completed = self.runtime.run_step(iteration, lambda _: train_step())
        if gathers is not None:
            gathers.end(train_enters_again=self._rolled_back)
        progress.step_end(completed, time.perf_counter() - started)
        if result is None:
            self._stop_timers_started_since(self._step)
        if self._rolled_back:
            self._rolled_back = False
            raise RolledBack(completed)
        if completed != iteration + 1:
            raise LaunchError(f"rank {self.runtime.rank}: iteration {iteration} ended with "
                              f"{completed} iterations completed; Megatron-LM's loop counts "
                              "one per train_step")
        return result if result is not None else _completed_in_switch()

    def between_steps(self, work: Callable[[], Any], if_interrupted: Any) -> Any:
        """``work()``, Megatron-LM's own collectives after an iteration (``training_log``); if
        a peer is lost meanwhile, the ranks switch generation from the completed iteration
        and ``if_interrupted`` stands in for the result (or, if every rank rolled back to the
        checkpoint, :class:`RolledBack` leaves ``train()``)."""
        try:
            return work()
        except Exception as error:  # noqa: BLE001 - the runtime re-raises all but lost peers
            completed = self.runtime.recover_between_steps(error)
            if self._rolled_back:
                self._rolled_back = False
                raise RolledBack(completed) from None
            self._stop_timers_started_since(self._step)
            clear_moe_metrics()
            logger.warning("rank %d: a peer was lost after iteration %d; its log line is "
                           "dropped", self.runtime.rank, completed)
            return if_interrupted

    def _start_training(self, iteration: int) -> None:
        self._training = True
        if self._local is not None:
            self._local.revert()
            self._local = None
        if self._joined_rng is not None:
            # Anything drawn between receiving the state and the first iteration is undone.
            restore_rng_state(self._joined_rng)
            self._joined_rng = None
        self.progress.ready(iteration)

    def _step_start(self, iteration: int) -> StepStart:
        from megatron.core.rerun_state_machine import get_rerun_state_machine
        from megatron.training.global_vars import get_timers

        return StepStart(iteration, counters(self.args),
                         get_rerun_state_machine().current_iteration,
                         frozenset(_started_timers(get_timers())))

    # -- pipeline templates ---------------------------------------------------------------

    def _restart_training_data(self) -> None:
        """Back on the job's layout, a survivor's training data iterator starts again where
        the job is (it read nothing while on the templates)."""
        from megatron.training.training import build_pretraining_data_loader

        iterator = self._data_iterator
        if iterator is None or self._train_dataset is None:
            return
        loader = build_pretraining_data_loader(self._train_dataset,
                                               self.args.consumed_train_samples)
        iterator.iterable = iter(loader)
        self._replay.begin(iterator)

    # -- the adapter protocol, where Megatron-LM's loop differs -------------------------

    def init_groups(self) -> None:
        from megatron.core import parallel_state

        self._initialize()  # sees the default group and only adds the model-parallel groups
        cover_world([parallel_state.get_model_parallel_group(),
                     parallel_state.get_data_parallel_group(with_context_parallel=True)])

    def group_holders(self) -> tuple[list[Any], list[types.ModuleType]]:
        objects, modules = super().group_holders()
        return objects + self._held_by_loop, modules

    def restore_snapshot(self, snapshot: dict[str, Any]) -> None:
        super().restore_snapshot(snapshot)
        if not self._training:  # a joiner receiving its state
            self._joined_rng = snapshot
            return
        self._undo_attempt()

    def _undo_attempt(self) -> None:
        """What a dropped attempt changed outside the model and optimizer."""
        from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

        step = self._step
        assert step is not None
        self._replay.rewind()
        machine = get_rerun_state_machine()
        machine.state = RerunState.NOT_RUNNING_YET
        machine.current_iteration = step.rerun_iteration
        self._stop_timers_started_since(step)

    @staticmethod
    def _stop_timers_started_since(step: StepStart) -> None:
        """Timers a dropped attempt started are stopped, their partial measure dropped."""
        _stop_timers_except(step.started_timers)

    def scheduler_increment(self) -> int:
        """As Megatron-LM's ``train_step`` steps its scheduler: the samples of the running
        iteration's global batch (which grows under ``--step-batch-size-schedule``)."""
        return _iteration_samples(self.args) * getattr(self.args, "gtp_weight_remat_size", 1)

    def model_state_tensors(self) -> list[torch.Tensor]:
        return [tensor for chunk in self._model for tensor in module_state_tensors(chunk.module)]

    def _load_checkpoint(self) -> Optional[int]:
        """Megatron-LM's last checkpoint (``--load``) through its own ``load_checkpoint``;
        None without one."""
        from megatron.training.checkpointing import (
            get_checkpoint_tracker_filename,
            load_checkpoint,
        )

        args = self.args
        if not args.load or not os.path.isfile(get_checkpoint_tracker_filename(args.load)):
            return None
        if self._step is not None:
            self._stop_timers_started_since(self._step)
        # A joiner's distributed optimizer has no state yet, and Megatron-Core's loading
        # builds on the state it has (with torch's Adam it asserts that there is one).
        ensure_shard_state(self._optimizer)
        # Megatron-Core's scheduler loads its state by stepping on from where it is.
        self._scheduler.num_steps = 0
        # In place into parameters (and views of them) that require grad.
        with torch.no_grad():
            args.iteration, args.num_floating_point_operations_so_far = load_checkpoint(
                self._model, self._optimizer, self._scheduler)
        self._share_data_flags()
        _restart_rerun_state_machine(args.iteration)
        self._rolled_back = True
        return args.iteration

    def _share_data_flags(self) -> None:
        """A joiner that rolled back gets Megatron-LM's data flags from the running ranks
        (see :data:`~mover_plugin.megatron.lm_counters.DATA_FLAGS`)."""
        args = self.args
        mine = None if self.is_joiner and not self._training else data_flags(args)
        records: list[Any] = [None] * self.runtime.world_size
        torch.distributed.all_gather_object(records, mine)
        if mine is None:
            for name, value in next(r for r in records if r is not None).items():
                setattr(args, name, value)

    def state_blob(self) -> dict[str, Any]:
        step = self._step
        assert step is not None, "state is sent from inside an iteration"
        return {**super().state_blob(), "step_start": step.iteration, "counters": step.counters,
                "step_samples": _iteration_samples(self.args), "data_flags": data_flags(self.args)}

    def load_state(self, state: dict[str, Any], transfer: Transfer) -> None:
        super().load_state(state, transfer)
        # The twin's counters are those of the start of its iteration; the joiner starts at
        # state["iteration"], one further if that iteration was completed in the switch.
        done = state["iteration"] - state["step_start"]
        args = self.args
        args.iteration = state["iteration"]
        load_loop_state(args, state)
        args.consumed_train_samples += done * state["step_samples"]


def _iteration_samples(args: argparse.Namespace) -> int:
    """The samples of the running iteration's global batch, as Megatron-LM's loop counts them
    (the batch grows under ``--step-batch-size-schedule``)."""
    from megatron.core.num_microbatches_calculator import get_num_microbatches

    return get_num_microbatches() * args.micro_batch_size * args.data_parallel_size


def _completed_in_switch() -> tuple[Any, ...]:
    """``train_step``'s result for an iteration the switch completed (its losses were not
    kept): nothing to log, not skipped, no checkpoint or exit requested."""
    return {}, 0, False, False, 0, None, None, 0


def _restart_rerun_state_machine(iteration: int) -> None:
    """Megatron-Core's rerun state machine as at the start of ``iteration`` on every rank (a
    running rank left it in the middle of an attempt; a joiner's has seen none)."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    machine = get_rerun_state_machine()
    machine.state = RerunState.NOT_RUNNING_YET
    machine.current_iteration = iteration - 1


def _stop_timers_except(kept: frozenset[str]) -> None:
    """Megatron-LM's started timers but ``kept`` are stopped, their partial measure dropped."""
    from megatron.training.global_vars import get_timers

    timers = get_timers()
    for name in _started_timers(timers) - kept:
        timers._timers[name]._started = False


def _started_timers(timers: Any) -> set[str]:
    return {name for name, timer in getattr(timers, "_timers", {}).items()
            if getattr(timer, "_started", False)}


def _local_collectives() -> Any:
    from mover_plugin.patches import apply_patches

    return apply_patches("local-collectives")
