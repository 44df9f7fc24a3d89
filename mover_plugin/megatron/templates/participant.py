"""The Megatron adapters' part in pipeline templates: one unit that holds the template state.

:class:`MegatronTemplates` is the :class:`~mover_plugin.runtime.adapter.TemplateParticipant` of
both Megatron adapters. It holds the stage recipe the script enabled, publishes the job's
template spec (and the measured profile of each stage) before the first step, moves a survivor
onto the plan's templates after a shrink, trains the iterations there, and moves the state back
into the script's objects when the job grows back (:mod:`mover_plugin.megatron.templates.shrunk`
does each of these moves).

It reaches the adapter through :class:`TemplateJob` (the script's objects, the runtime, the
agreement on the iteration) and the training loop through a :class:`TemplateLoop` strategy:
:class:`CoreLoop` for a Megatron-Core script's own loop,
:class:`~mover_plugin.megatron.templates.megatron_lm.MegatronLMLoop` for Megatron-LM's.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist

from mover_plugin.contract import GenerationPlan
from mover_plugin.errors import LaunchError
from mover_plugin.megatron.templates.shrunk import (
    ShrunkTraining,
    job_first_layer,
    measure_own_stage,
    move_back,
    template_spec,
)
from mover_plugin.megatron.templates.stage import (StageRecipe, StageState, StageStep,
                                                   inner_model, load_schedule)
from mover_plugin.megatron.update_gate import (UpdateGate, load_loss_scaler_states,
                                               loss_scaler_states)
from mover_plugin.runtime.adapter import Continuation
from mover_plugin.runtime.resilience import ResilienceRuntime

logger = logging.getLogger(__name__)

Repeat = Callable[[Callable[[], list]], list]
"""How the forward and backward passes of an iteration on a stage are run (see
:meth:`~mover_plugin.megatron.templates.stage.StageTrainer.train_step`)."""


class TemplateJob(Protocol):
    """What the template unit uses of its adapter."""

    args: argparse.Namespace
    runtime: ResilienceRuntime

    @property
    def training_objects(self) -> tuple[Any, Any, Any]:
        """The script's (model, optimizer, scheduler)."""

    @property
    def sharded(self) -> bool:
        """Whether the optimizer is Megatron-Core's distributed optimizer."""

    def agree_on_iteration(self, *, contribute: bool) -> int:
        """The iteration every rank of the new generation continues from."""

    def settle_iteration(self, target: int, snapshot: dict[str, Any]) -> None:
        """Brings this survivor to ``target`` completed iterations, through the commit gate of
        the optimizer it trains with."""

    def after_switch(self) -> None:
        """The script's objects are on a new generation's groups."""

    def teardown(self) -> None:
        """Releases what the job's groups set in ``parallel_state``."""


class TemplateLoop(Protocol):
    """Where the training loop the script runs differs on pipeline templates."""

    def measuring(self) -> contextlib.AbstractContextManager[Any]:
        """What surrounds the measurement of a stage before the first step."""

    def job_module(self, model: Any) -> torch.nn.Module:
        """The script's model, unwrapped."""

    def before_shrink(self) -> None:
        """A survivor is about to build its stage of a shrink."""

    def step(self, train: Callable[[Optional[Repeat]], StageStep]) -> Any:
        """An iteration on the templates: ``train(repeat)`` trains it (its loss over the
        global batch, gradient norm, and whether the update was skipped); the result is what the
        loop's own step returns."""

    def after_leaving(self) -> None:
        """Growing back: the templates' groups are released."""

    def after_growth(self) -> None:
        """Growing back: the script's objects hold the job's state again."""

    def growth_state(self) -> dict[str, Any]:
        """What a survivor growing the job back carries to the joining standbys, besides the
        learning-rate schedule (the loop's own counters)."""

    def load_growth_state(self, state: dict[str, Any], iteration: int) -> None:
        """A standby joining a job that grows back takes :meth:`growth_state`."""


class CoreLoop:
    """A Megatron-Core script's own loop: its model is its DDP, its step returns (loss,
    gradient norm), and it keeps no counters of its own."""

    def measuring(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def job_module(self, model: Any) -> torch.nn.Module:
        return inner_model(model.module)

    def before_shrink(self) -> None:
        pass

    def step(self, train: Callable[[Optional[Repeat]], StageStep]) -> Any:
        result = train(None)
        return result.loss, result.grad_norm

    def after_leaving(self) -> None:
        pass

    def after_growth(self) -> None:
        pass

    def growth_state(self) -> dict[str, Any]:
        return {}

    def load_growth_state(self, state: dict[str, Any], iteration: int) -> None:
        pass


class MegatronTemplates:
    """The template state of one rank and the runtime's calls into it (module docstring)."""

    def __init__(self, job: TemplateJob, loop: TemplateLoop) -> None:
        self._job = job
        self.loop = loop
        self.recipe: Optional[StageRecipe] = None
        """How the script builds and trains a stage of a pipeline template, when it can."""
        self._shrunk: Optional[ShrunkTraining] = None
        """This survivor's training once the job shrank onto pipeline templates."""

    @property
    def on_templates(self) -> bool:
        """Whether the job shrank and this rank trains on pipeline templates."""
        return self._shrunk is not None

    @property
    def gate(self) -> Optional[UpdateGate]:
        """On pipeline templates: the commit gate of this rank's stage's optimizer."""
        return None if self._shrunk is None else self._shrunk.gate

    @property
    def stage_groups(self) -> Any:
        """On pipeline templates: this rank's stage's process groups (Megatron-Core's
        ``ProcessGroupCollection``)."""
        assert self._shrunk is not None
        return self._shrunk.trainer.pg_collection

    def publish_spec(self) -> None:
        """The first rank of a job that started with a stage recipe tells the controller
        whether (and how) the job can shrink onto pipeline templates; without a given profile,
        the first rank of each pipeline stage measures its layers for the planner."""
        job, runtime = self._job, self._job.runtime
        if self.recipe is None or runtime.joiner_of is not None:
            return
        spec = template_spec(job.args, runtime.settings, job.sharded, quiet=runtime.rank != 0)
        if spec is None:
            return
        if runtime.rank == 0:
            runtime.control.publish_templates(spec.to_record())
        if spec.profile is None:
            with self.loop.measuring():
                measured = measure_own_stage(job.args, job.training_objects[0], self.recipe,
                                             runtime.rank)
            if measured is not None:
                runtime.control.publish_stage_profile(*measured)

    def save_final(self, save: Optional[str]) -> None:
        """A job that ends on the templates writes its final parameters under ``save``."""
        if self._shrunk is None or not save:
            return
        runtime = self._job.runtime
        path = self._shrunk.save_final(Path(save), runtime.ledger.applied)
        logger.warning("rank %d wrote its final parameters to %s", runtime.rank, path)

    # -- the runtime's calls (TemplateParticipant) ----------------------------------------

    def continue_on_templates(self, plan: GenerationPlan,
                              snapshot: dict[str, Any]) -> Continuation:
        """A shrink: from the job's layout, or from the templates of the shrink before."""
        assert self.recipe is not None, "a shrink plan for a job that published no spec"
        job, before = self._job, self._shrunk
        self.loop.before_shrink()
        target = job.agree_on_iteration(contribute=True)
        job.settle_iteration(target, snapshot)
        if before is None:
            _, optimizer, scheduler = job.training_objects
            held = self._job_state()
            carried = {"schedule": scheduler.state_dict(),
                       "loss_scalers": loss_scaler_states(optimizer)}
        else:
            held, carried = before.trainer.state, before.carried_state()
        self._shrunk = ShrunkTraining(plan, dist.get_rank(), self.recipe, held, carried,
                                      job.runtime)
        job.runtime.train_with(self._step)
        return Continuation(target, received_bytes=self._shrunk.received_bytes)

    def _step(self, iteration: int) -> Any:
        """An iteration after the shrink, as the loop's own step returns it; the script's
        optimizer shows the stage's learning rate and loss scale, as the script logs them from
        there."""
        return self.loop.step(lambda repeat: self._train(iteration, repeat))

    def _train(self, iteration: int, repeat: Optional[Repeat]) -> StageStep:
        shrunk, runtime = self._shrunk, self._job.runtime
        assert shrunk is not None
        result = shrunk.step(iteration, vote=runtime.switch_requested, repeat=repeat)
        if shrunk.grow_agreed:
            runtime.grow_back_at_next_step()
        runtime.ledger.count_running_iteration()
        shrunk.show_on(self._job.training_objects[1])
        return result

    def leave_templates(self) -> None:
        """Growing back, or shrinking again: the templates' groups are released (this rank's
        stage keeps its state until the next layout takes it)."""
        assert self._shrunk is not None
        self._shrunk.trainer.groups.destroy()
        self._job.teardown()  # what the templates set in parallel_state (its memory buffer)
        self.loop.after_leaving()

    def continue_after_growth(self, plan: GenerationPlan) -> int:
        assert self._shrunk is not None
        job = self._job
        ledger, rank = job.runtime.ledger, job.runtime.rank
        target = job.agree_on_iteration(contribute=True)
        if target != ledger.applied:
            raise LaunchError(f"rank {rank} completed {ledger.applied} iterations but the job "
                              f"grows back at {target}")
        shrunk = self._shrunk
        carried, received = move_back(
            plan, rank, shrunk.trainer.state, self._job_state(),
            {**self.loop.growth_state(), **shrunk.carried_state()})
        self._shrunk = None
        self._take_carried(carried)
        self.loop.after_growth()
        return received

    def join_after_growth(self, plan: GenerationPlan) -> Continuation:
        job = self._job
        target = job.agree_on_iteration(contribute=False)
        carried, received = move_back(plan, job.runtime.rank, None, self._job_state(), None)
        self._take_carried(carried)
        job.after_switch()  # the optimizer's agreed flags, as at every rank of a switch
        job.runtime.ledger.applied = target
        self.loop.load_growth_state(carried, target)
        return Continuation(target, received_bytes=received)

    def _take_carried(self, carried: dict[str, Any]) -> None:
        """Growing back: the script's scheduler and loss scalers where the templates' were."""
        _, optimizer, scheduler = self._job.training_objects
        load_schedule(scheduler, carried["schedule"])
        load_loss_scaler_states(optimizer, carried["loss_scalers"])

    def _job_state(self) -> StageState:
        """The script's model and optimizer, by canonical parameter names."""
        job = self._job
        model, optimizer, _ = job.training_objects
        return StageState.of_model(self.loop.job_module(model), optimizer,
                                   job_first_layer(job.args, job.runtime.rank),
                                   tied=not job.args.untie_embeddings_and_output_weights)
