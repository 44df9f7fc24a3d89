"""A trial of pipeline templates on examples/pretrain_gpt.py's model: ranks that train, lose
a rank, go on in pipeline templates and grow back (for the tests and the benchmark of
pipeline templates, under :func:`mover_plugin.testing.run_ranks` on 4 processes).

Each rank trains the example's own Megatron-Core model, optimizer, scheduler and data: first
as the job's TP1 x PP2 x DP2 (``parallel_state`` and the example's ``train_step``); then rank 3
drops out with everything it held, and ranks 0-2 make a world of their own and train on the
planner's placement for three hosts (:mod:`mover_plugin.megatron.templates.stage`), their
new layers and optimizer state copied from the ranks that held them; then rank 3 comes back
with no state and all four train on the planner's placement for four hosts. Every step's loss
and time, each switch's time and the bytes each rank received come back.

The planner's profile is the synthetic GPT-like one unless a measured one is given.
"""

from __future__ import annotations

import importlib.util
import math
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import torch
import torch.distributed as dist

JOB_PIPELINES = [(0, 2), (1, 3)]
"""Megatron-Core's pipelines of TP1 x PP2 x DP2 on 4 ranks."""


@dataclass(frozen=True)
class TemplateRun:
    """What the ranks train: the example script and its flags (TP1 x PP2, 4 ranks)."""

    example: Path
    argv: tuple[str, ...]
    num_layers: int
    slots: int
    """Micro-batches of the global batch."""
    profile: Any = None
    """A measured :class:`~mover_plugin.templates.Profile`, or None for the synthetic one."""

    @property
    def tied(self) -> bool:
        """Whether the output layer shares the word embedding's weight (the example's default)."""
        return "--untie-embeddings-and-output-weights" not in self.argv


def _example(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("pretrain_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _start(run: TemplateRun, steps: int) -> tuple[Any, Any, Any, tuple]:
    from megatron.core import parallel_state

    from mover_plugin.megatron.arguments import parse_args

    torch.set_num_threads(1)  # as the example under mover-launch (OMP_NUM_THREADS=1)
    example = _example(run.example)
    args = parse_args([*run.argv, "--train-iters", str(steps)], world_size=4)
    example.quiet_known_warnings()
    example.apply_cpu_patches_if_needed()
    dataset = example.build_dataset(args)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1,
                                             pipeline_model_parallel_size=2)
    example.seed_for_stage(args)
    return example, args, dataset, example.setup_model_and_optimizer(args)


def _canonical(state: Any) -> dict[str, Any]:
    """Parameters by canonical name, as numpy arrays (tensors would travel back to the test
    through shared memory that dies with the rank)."""
    return {name: param.detach().numpy().copy() for name, param in state.parameters.items()}


def _job_state(run: TemplateRun, model: Any, optimizer: Any) -> Any:
    from megatron.core import parallel_state

    from mover_plugin.megatron.templates.stage import StageState

    first = parallel_state.get_pipeline_model_parallel_rank() * run.num_layers // 2
    return StageState.of_model(model.module, optimizer, first, tied=run.tied)


def _timed(step: Any, iteration: int, times: list[float]) -> float:
    started = time.perf_counter()
    loss = step(iteration)
    times.append(time.perf_counter() - started)
    return loss


def train_without_interruption(rank: int, world_size: int, run: TemplateRun,
                               steps: int) -> dict[str, Any]:
    """The failure-free job: losses of every step (NaN off the last stage), final parameters."""
    example, args, dataset, (model, optimizer, scheduler) = _start(run, steps)
    losses = [example.train_step(args, model, optimizer, scheduler, dataset, it)[0]
              for it in range(steps)]
    return {"losses": losses, "params": _canonical(_job_state(run, model, optimizer))}


def train_shrink_and_grow(rank: int, world_size: int, run: TemplateRun, full: int,
                          shrunk: int, grown: int) -> dict[str, Any]:
    """``full`` steps as the job, ``shrunk`` on three ranks, ``grown`` on four again."""
    from megatron.core import parallel_state

    from mover_plugin.placement import Placement
    from mover_plugin.templates import instantiate, plan_templates, transformer_profile

    steps = full + shrunk + grown
    example, args, dataset, (model, optimizer, scheduler) = _start(run, steps)
    recipe = example.stage_recipe(args, dataset)
    store = dist.distributed_c10d._get_default_store()
    times: list[float] = []
    losses = [_timed(lambda it: example.train_step(args, model, optimizer, scheduler, dataset,
                                                   it)[0], it, times) for it in range(full)]
    templates = plan_templates(run.profile or transformer_profile(run.num_layers),
                               pipeline_size=2)
    job = Placement.uniform(JOB_PIPELINES, run.num_layers, run.slots, tied=run.tied)
    result: dict[str, Any] = {"losses": losses, "times": times}
    switched = time.perf_counter()
    held = _job_state(run, model, optimizer)
    schedule = scheduler.state_dict()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    del model, optimizer, scheduler
    # Every rank plans alike (in a job, the controller's plan record would say it).
    placement = Placement.of_plan(instantiate(templates, 3, run.slots, 0), [0, 1, 2],
                                  run.num_layers, tied=run.tied, previous=job)
    if rank == 3:  # lost: it keeps nothing
        held, job = None, placement
        losses += [math.nan] * shrunk
        times += [math.nan] * shrunk
    else:
        _world(store, "shrunk", rank, 3)
        trainer, result["shrunk_received"] = _switch(placement, rank, recipe, job, held,
                                                     schedule, live=[0, 1, 2])
        result["shrink_s"] = time.perf_counter() - switched
        losses += [_timed(lambda it: trainer.train_step(it)[0], it, times)
                   for it in range(full, full + shrunk)]
        result["shrunk"] = placement.describe()
        held, schedule, job = trainer.state, trainer.scheduler.state_dict(), placement
        trainer.groups.destroy()
        dist.destroy_process_group()
    switched = time.perf_counter()
    _world(store, "grown", rank, 4)
    placement = Placement.of_plan(instantiate(templates, 4, run.slots, 1), [0, 1, 2, 3],
                                  run.num_layers, tied=run.tied, previous=job, fresh=[3])
    carried = [schedule]
    dist.broadcast_object_list(carried, src=0)
    trainer, result["grown_received"] = _switch(placement, rank, recipe, job, held,
                                                carried[0], live=[0, 1, 2], fresh=[3])
    result["grow_s"] = time.perf_counter() - switched
    losses += [_timed(lambda it: trainer.train_step(it)[0], it, times)
               for it in range(full + shrunk, steps)]
    result.update(grown=placement.describe(), params=_canonical(trainer.state))
    trainer.groups.destroy()
    return result


def _switch(placement: Any, rank: int, recipe: Any, previous: Any, held: Optional[Any],
            schedule: dict, live: list[int], fresh: tuple[int, ...] | list[int] = ()
            ) -> tuple[Any, int]:
    from mover_plugin.megatron.templates.stage import PlacementGroups, StageTrainer, relayout
    from mover_plugin.placement import transfers

    trainer = StageTrainer(placement, rank, recipe, PlacementGroups(placement, rank))
    received = relayout(transfers(previous, placement, live=live, fresh=fresh), rank, held,
                        trainer.state)
    trainer.take_scheduler_state(schedule)
    return trainer, received


def _world(store: Any, name: str, rank: int, size: int) -> None:
    dist.init_process_group("gloo", store=dist.PrefixStore(f"{name}/", store), rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))


def measure_example_profile(rank: int, world_size: int, run: TemplateRun,
                            host_memory_bytes: int = 1 << 30) -> dict[str, Any]:
    """The example's model measured on one rank: the profile, and each part's parameter
    count."""
    from mover_plugin.megatron.arguments import parse_args
    from mover_plugin.megatron.templates.profile import measure_profile
    from mover_plugin.megatron.templates.stage import PlacementGroups, ensure_megatron_globals
    from mover_plugin.placement import Placement

    torch.set_num_threads(1)
    example = _example(run.example)
    args = parse_args([*run.argv, "--train-iters", "1"], world_size=4)
    example.quiet_known_warnings()
    example.apply_cpu_patches_if_needed()
    recipe = example.stage_recipe(args, example.build_dataset(args))
    whole = Placement.of_pipelines([([(0, run.num_layers)], run.slots)], [rank],
                                   run.num_layers, tied=run.tied)
    groups = PlacementGroups(whole, rank)
    ensure_megatron_globals()
    model = recipe.build_model(num_layers=run.num_layers, pre_process=True, post_process=True,
                               pg_collection=groups.collection(whole.role(rank)))
    profile = measure_profile(model, recipe.forward_step, recipe.microbatch(0, 0),
                              host_memory_bytes=host_memory_bytes)
    counts = {"embedding": sum(p.numel() for p in model.embedding.parameters()),
              **{f"layer {i}": sum(p.numel() for p in layer.parameters())
                 for i, layer in enumerate(model.decoder.layers)},
              "output": sum(p.numel() for p in model.decoder.final_layernorm.parameters())
              + (model.embedding.word_embeddings.weight if run.tied
                 else model.output_layer.weight).numel()}
    groups.destroy()
    return {"profile": profile, "parameters": counts}
