"""A Megatron-Core job that goes on without a lost rank, on pipeline templates.

When a rank is lost and no standby is ready, a job whose script handed its stage recipe to
:meth:`MegatronResilience.enable_templates
<mover_plugin.megatron.resilience.MegatronResilience.enable_templates>` (on Megatron-LM's own
loop the drop-in builds it: :mod:`mover_plugin.megatron.templates.megatron_lm`) shrinks: the controller
plans the survivors' pipelines (:mod:`mover_plugin.shrink`), and each survivor, in the world
of the survivors, builds the stage the plan gives it with the script's own builder
(:class:`~mover_plugin.megatron.templates.stage.StageTrainer`), copies into it the layers it
held and receives from a live holder those it did not, with their Adam state
(:func:`~mover_plugin.megatron.templates.stage.relayout`), and takes over the learning-rate
schedule where the job's was. The script's own model and optimizer rest from then on; the
iterations run :meth:`ShrunkTraining.step`, which returns what the script's step returns (the
mean loss over the global batch, the gradient norm).

:func:`template_spec` says whether a job can do this (what its first rank publishes);
:func:`measure_own_stage` is what the first rank of each pipeline stage measures of its layers
before the first step, for the planner, when the job was given no profile; and
:meth:`ShrunkTraining.save_final` writes the parameters a job ends with (each unit once, by
its canonical name).

The stage's optimizer has the commit gate of the job's (:class:`~mover_plugin.megatron.
update_gate.UpdateGate`): a rank lost while shrunk leaves every survivor on the same side of an
iteration's update, and the job shrinks again from the templates (the participant builds the
next :class:`ShrunkTraining` from this one's stage).

Limits, besides those of :mod:`~mover_plugin.megatron.templates.stage` (tensor-parallel size 1,
CPU and gloo, the plain optimizer): the script's checkpoints are not written while
shrunk (the final parameters are, by :meth:`ShrunkTraining.save_final`).

**Growing back.** When standbys are ready for the lost ranks, the controller plans the job's
own layout again (:func:`mover_plugin.shrink.plan_grow`) and asks the survivors to switch at an
iteration boundary: the loss all-reduce of an iteration carries who saw the request, so all of
them agree in the same one (:meth:`ShrunkTraining.step`). Before the next each survivor builds the
job's groups again, its script objects are pointed at them, and :func:`move_back` puts the
layers it holds on the templates into the script's model and optimizer, receives those it
lacks from a survivor, and gives each standby everything of its rank; the first survivor sends
the learning-rate schedule. The script's own step trains from the next iteration on.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mover_plugin.contract import GenerationPlan
from mover_plugin.layout import ParallelLayout
from mover_plugin.megatron.checkpoint import capture_rng_state, restore_rng_state
from mover_plugin.megatron.templates.profile import host_memory_bytes, measure_training_stage
from mover_plugin.megatron.update_gate import (UpdateGate, load_loss_scaler_states,
                                               loss_scaler_states)
from mover_plugin.megatron.templates.stage import (
    PlacementGroups,
    StageRecipe,
    StageState,
    StageStep,
    StageTrainer,
    relayout,
    unit_of,
)
from mover_plugin.placement import Placement, Transfer
from mover_plugin.runtime.resilience import ResilienceRuntime
from mover_plugin.runtime.settings import ResilienceSettings
from mover_plugin.shrink import TemplateSpec, profile_record, shape_refusals
from mover_plugin.templates import Profile

logger = logging.getLogger(__name__)

FINAL_FOLDER = "templates_final"
"""Under ``--save``: the final parameters of a job that ended on pipeline templates."""


def template_spec(args: argparse.Namespace, settings: ResilienceSettings,
                  sharded: bool, quiet: bool = False) -> Optional[TemplateSpec]:
    """What the planner needs of this job, or None (with the reason logged, unless
    ``quiet``) when it cannot train on pipeline templates."""
    reasons = template_refusals(args, sharded)
    if reasons:
        if not quiet:
            logger.info("no pipeline templates for this job (%s): a rank lost with no standby "
                        "ready restarts the job", ", ".join(reasons))
        return None
    return TemplateSpec(num_layers=args.num_layers,
                        tied=not args.untie_embeddings_and_output_weights,
                        microbatches=args.global_batch_size // args.micro_batch_size,
                        fault_tolerance=settings.fault_tolerance,
                        profile=getattr(args, "template_profile", None))


def template_refusals(args: argparse.Namespace, sharded: bool) -> list[str]:
    """Why a Megatron-Core job with ``args`` (``sharded``: with the distributed optimizer)
    cannot train on pipeline templates; none: it can."""
    return shape_refusals(args.tensor_model_parallel_size,
                          bool(getattr(args, "num_experts", None)), sharded,
                          torch.cuda.is_available())


def measure_own_stage(args: argparse.Namespace, model: Any, recipe: StageRecipe,
                      rank: int) -> Optional[tuple[int, dict[str, Any]]]:
    """(pipeline stage, profile record of its layers) measured on the script's ``model`` (a
    model, or a list of chunks) when ``rank`` is its stage's first data-parallel rank; None for
    the other ranks, and with virtual pipeline chunks (not measured)."""
    chunks = model if isinstance(model, list) else [model]
    layout = ParallelLayout.for_world(args.world_size, args.tensor_model_parallel_size,
                                      args.pipeline_model_parallel_size)
    where = layout.coordinates(rank)
    if where.dp != 0 or where.tp != 0 or len(chunks) != 1:
        return None
    started = time.perf_counter()
    costs = measure_training_stage(
        chunks[0], recipe.forward_step, recipe.microbatch(0, 0),
        first_layer=job_first_layer(args, rank),
        input_shape=(recipe.seq_length, recipe.micro_batch_size, args.hidden_size))
    device = next(chunks[0].parameters()).device
    record = profile_record(Profile(costs, host_memory_bytes(device)))
    logger.info("pipeline stage %d measured its layers for the pipeline templates in %.2f s: %s",
                where.pp, time.perf_counter() - started,
                ", ".join(f"{cost.name} {1000 * cost.step_s:.1f} ms" for cost in costs))
    return where.pp, record


def job_first_layer(args: argparse.Namespace, job_rank: int) -> int:
    """The first transformer layer of ``job_rank``'s stage in the job's own layout."""
    layout = ParallelLayout.for_world(args.world_size, args.tensor_model_parallel_size,
                                      args.pipeline_model_parallel_size)
    return layout.coordinates(job_rank).pp * (args.num_layers // layout.pp)


class ShrunkTraining:
    """One survivor's training on the plan of a shrink (built in the survivors' world)."""

    def __init__(self, plan: GenerationPlan, rank: int, recipe: StageRecipe,
                 held: StageState, carried: dict[str, Any], runtime: ResilienceRuntime) -> None:
        """``rank``: this process's rank in the survivors' world; ``held``: the state of the
        stage it trained before (in the job, or on the templates of an earlier shrink);
        ``carried``: what that stage's optimizer carries besides (:meth:`carried_state`)."""
        assert plan.placement is not None, "a shrink's plan has its placement"
        self.placement = Placement.of_record(plan.placement)
        self.rank = rank
        rng = capture_rng_state()  # building draws initial weights; the iteration must not
        self.trainer = StageTrainer(self.placement, rank, recipe,
                                    PlacementGroups(self.placement, rank))
        restore_rng_state(rng)
        self.gate = UpdateGate(self.trainer.optimizer, self.trainer.scheduler, runtime, None,
                               lambda: recipe.global_batch_size)
        """The commit before the stage's update: a rank lost while shrunk leaves every
        survivor on the same side of it (:meth:`UpdateGate.settle`)."""
        moves = [Transfer(unit, source, destination)
                 for unit, source, destination in plan.moves]
        self.received_bytes = relayout(moves, rank, held, self.trainer.state)
        self.trainer.take_scheduler_state(carried["schedule"])
        load_loss_scaler_states(self.trainer.optimizer, carried["loss_scalers"])
        logger.warning("rank %d of the survivors trains layers %d-%d of pipeline %s on %s",
                       rank, self.trainer.role.layers[0], self.trainer.role.layers[1] - 1,
                       list(self.trainer.role.pipeline_ranks), plan.describe)

    def step(self, iteration: int, vote: bool = False,
             repeat: Optional[Callable[[Callable[[], list]], list]] = None) -> StageStep:
        """One iteration (:class:`~mover_plugin.megatron.templates.stage.StageStep`). ``vote``:
        this rank saw the request to grow back; :attr:`grow_agreed` then says whether any
        rank did. ``repeat``: see :meth:`StageTrainer.train_step`."""
        self.gate.begin_attempt()
        return self.trainer.train_step(iteration, vote, repeat)

    def carried_state(self) -> dict[str, Any]:
        """The learning-rate schedule and fp16's loss scalers of this stage's optimizer, for
        the next layout."""
        return {"schedule": self.trainer.scheduler.state_dict(),
                "loss_scalers": loss_scaler_states(self.trainer.optimizer)}

    def show_on(self, optimizer: Any) -> None:
        """``optimizer`` (the script's, resting) shows this stage's learning rate and loss
        scale, which the script logs."""
        for group in optimizer.param_groups:
            group["lr"] = self.learning_rate
        load_loss_scaler_states(optimizer, loss_scaler_states(self.trainer.optimizer))

    @property
    def grow_agreed(self) -> bool:
        return self.trainer.voted

    @property
    def learning_rate(self) -> float:
        return self.trainer.optimizer.param_groups[0]["lr"]

    def save_final(self, folder: Path, iteration: int) -> Path:
        """Writes the parameters of the units this rank is the first holder of, by canonical
        name (``FOLDER/templates_final/iter_NNNNNNN/rank_RRR.pt``); returns the file."""
        holders = self.placement.holders()
        mine = {name: param.detach().clone() for name, param
                in self.trainer.state.parameters.items()
                if holders[unit_of(name, self.placement.tied)][0] == self.rank}
        path = folder / FINAL_FOLDER / f"iter_{iteration:07d}" / f"rank_{self.rank:03d}.pt"
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".tmp")
        torch.save({"iteration": iteration, "parameters": mine}, partial)
        partial.replace(path)
        return path


def move_back(plan: GenerationPlan, rank: int, held: Optional[StageState], job: StageState,
              carried: Optional[dict[str, Any]]) -> tuple[dict[str, Any], int]:
    """Growing back (every rank of the job's world calls it): each unit of the job's layout
    that ``rank`` lacks comes from the survivor the plan names, into the script's own model and
    optimizer (``job``); ``held`` is a survivor's state on the templates (None at a standby).
    Returns what the first survivor carries to every rank (``carried`` there: the
    learning-rate schedule, and what else the job's loop needs), and the bytes received. The
    transfers go over a group of all ranks: two ranks of the job's layout need not share any
    other group."""
    everyone = dist.new_group(list(range(dist.get_world_size())))
    moves = [Transfer(unit, source, destination) for unit, source, destination in plan.moves]
    received = relayout(moves, rank, held, job, group=everyone)
    carried = [carried]
    dist.broadcast_object_list(carried, src=plan.survivors[0], group=everyone)
    dist.destroy_process_group(everyone)
    return carried[0], received
