"""A general standby: warmed up in the sandbox for every pipeline role before it is needed.

A standby does not know which rank it will replace. Before it reports ready (the job's first
step waits for its standbys, bounded by the collective timeout), it plays each pipeline role in
turn (first stage, last stage, a middle stage when the pipeline has one) as a rank of the job's
world size inside the sandbox (:mod:`mover_plugin.comm.sandbox`, groups that talk to no one):
it initializes Megatron-Core's groups, builds that stage's model, DDP and
optimizer with the script's own code, and runs a few *shadow iterations* of the script's
training step. The imports, lazy initializations, allocator pools and code paths of every role
are warm afterwards, and nothing has reached the job's ranks.

It keeps what it built for every role it played that fits its memory budget (each role's model,
DDP and optimizer, with the sandbox groups they hold). On promotion to a rank of a kept role
(same pipeline stage, tensor-parallel index 0, expert indices 0 when the model has
mixture-of-experts layers, and, with the distributed optimizer, data-parallel index 0), those
objects are *adopted*: every sandbox group they hold is replaced
by the job's group of the same purpose (paired through Megatron-Core's ``parallel_state``), the
other roles' objects are released, and the state then comes from the data-parallel twin as
usual. Every stage of a pipeline of up to three stages is thus warm. A rank of another role (a
tensor-parallel index other than 0, a middle stage after the second in a deeper pipeline, other
experts, or a data-parallel index other than 0 when the optimizer is sharded) is built on
promotion, with
warm code paths: Megatron-Core fixes the DDP grad buffers and the optimizer's parameter groups
when it builds them (with the distributed optimizer, the shard a rank updates and the bucket
groups' rank in the data-parallel group among them), so one role's objects cannot be turned
into another's.

Each kept role costs the standby that stage's model, gradients and optimizer state (never
activations: the shadow iterations' are freed); a worker holds one stage but also its
activations. The roles kept are those that fit a memory budget
(:mod:`mover_plugin.megatron.standby_memory`: by default, on a GPU, what a worker of the
largest role needs); the others are warmed and released.

The parameters, optimizer state and RNG states of the warm-up are never used: the promoted
standby receives them from its twin.
"""

from __future__ import annotations

import gc
import logging
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.distributed as dist

from mover_plugin.comm.sandbox import (
    SANDBOX_BACKEND,
    SandboxProcessGroup,
    operations_served,
    register_sandbox_backend,
)
from mover_plugin.layout import Coordinates, ParallelLayout
from mover_plugin.megatron.distributed_optimizer import uses_distributed_optimizer
from mover_plugin.megatron.standby_memory import MB, MemoryBudget, held_bytes
from mover_plugin.runtime.rewire import count_references, rewire

logger = logging.getLogger(__name__)

TrainingObjects = tuple[Any, Any, Any]
"""What a script's build function returns: model, optimizer, scheduler."""


@dataclass(frozen=True)
class StandbyWarmUp:
    """What a training script gives the runtime so that its standbys warm up.

    Attributes:
        parallel: the keyword arguments of ``initialize_model_parallel`` (they give the
            pipeline and tensor-parallel sizes, hence the roles).
        build: builds (model, optimizer, scheduler) exactly as a rank does after its groups
            exist (seeding included).
        shadow_step: runs one training iteration on those objects.
        initialize_groups: creates a role's model-parallel groups once the sandbox's default
            group exists (None: ``initialize_model_parallel(**parallel)``; a framework that
            creates its groups itself, such as Megatron-LM's ``_initialize_distributed``,
            passes its own).
    """

    parallel: dict[str, Any]
    build: Callable[[], TrainingObjects]
    shadow_step: Callable[[Any, Any, Any], Any]
    initialize_groups: Optional[Callable[[], None]] = None


@dataclass(frozen=True)
class PipelineRole:
    name: str
    """``first``, ``middle``, ``last``, or ``only`` (a pipeline of one stage)."""
    rank: int
    """The global rank this role is played as in the sandbox."""
    stage: int


def parallel_layout(world_size: int, parallel: dict[str, Any], *,
                    experts_in_shard: bool = False) -> ParallelLayout:
    """The layout given by ``initialize_model_parallel``'s keyword arguments."""
    return ParallelLayout.for_world(world_size, parallel.get("tensor_model_parallel_size", 1),
                                    parallel.get("pipeline_model_parallel_size", 1),
                                    ep=parallel.get("expert_model_parallel_size", 1),
                                    etp=parallel.get("expert_tensor_parallel_size"),
                                    experts_in_shard=experts_in_shard)


def pipeline_roles(layout: ParallelLayout) -> list[PipelineRole]:
    """The roles a standby plays, in order (each one is kept)."""
    def role(name: str, stage: int) -> PipelineRole:
        return PipelineRole(name, layout.rank(tp=0, dp=0, pp=stage), stage)

    if layout.pp == 1:
        return [role("only", 0)]
    roles = [role("first", 0), role("last", layout.pp - 1)]
    if layout.pp > 2:
        roles.append(role("middle", 1))
    return roles


@dataclass
class KeptRole:
    """What a standby built for one role in the sandbox."""

    role: PipelineRole
    objects: TrainingObjects
    groups: dict[str, Any]
    """The sandbox groups ``parallel_state`` held for this role, by variable name."""
    sharded: bool
    """Whether the optimizer is Megatron-Core's distributed optimizer, whose shard ranges and
    DDP bucket groups are fixed for the data-parallel index the role was played at (0)."""

    def fits(self, coordinates: Coordinates) -> bool:
        """Whether a rank at ``coordinates`` can take these objects over. A mixture-of-experts
        layer fixes which experts it holds when it is built: the role was played at expert
        indices 0."""
        if (coordinates.pp, coordinates.tp, coordinates.ep, coordinates.etp) != (
                self.role.stage, 0, 0, 0):
            return False
        return coordinates.dp == 0 or not self.sharded


@dataclass
class WarmedStandby:
    """The outcome of a warm-up: every role's objects and what the warm-up did."""

    kept: list[KeptRole]
    report: dict[str, Any] = field(default_factory=dict)

    def adopt(self, rank: int, layout: ParallelLayout) -> Optional[TrainingObjects]:
        """After the job's groups exist (``initialize_model_parallel`` ran for ``rank``):
        the objects of ``rank``'s role moved onto them, or None when no kept role is
        ``rank``'s. Every other role's objects are released."""
        coordinates = layout.coordinates(rank)
        matching = [kept for kept in self.kept if kept.fits(coordinates)]
        # Released without a gc.collect(): a full collection here would cost the promotion
        # a tenth of a second; the cycles go with the next automatic one.
        self.kept = []
        if not matching:
            return None
        (kept,) = matching
        objects = kept.objects
        moved = rewire(objects, _pair_groups(kept.groups, _parallel_state_groups()))
        left = count_references(objects, lambda value: isinstance(value, SandboxProcessGroup))
        if left:
            logger.warning("the kept %s-stage model still holds %d sandbox group(s) after "
                           "adoption; building a fresh one", kept.role.name, left)
            del objects, kept, matching
            gc.collect()
            return None
        logger.info("adopted the warmed %s-stage model for rank %d (%d group references moved)",
                    kept.role.name, rank, moved)
        return objects


def warm_up(plan: StandbyWarmUp, world_size: int, iterations: int,
            memory_mb: int = 0) -> Optional[WarmedStandby]:
    """Plays every pipeline role in the sandbox (see the module docstring), keeping those that
    fit ``memory_mb`` (:class:`MemoryBudget`); None if the warm-up failed (logged): the
    standby then stays, cold, and builds on promotion."""
    from megatron.core import parallel_state

    try:
        return _play_roles(plan, world_size, iterations, memory_mb)
    except Exception:  # noqa: BLE001 - a standby is worth keeping even if it cannot warm up
        logger.exception("the standby's warm-up in the sandbox failed; it stays a cold standby")
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()
        return None


def _play_roles(plan: StandbyWarmUp, world_size: int, iterations: int,
                memory_mb: int = 0) -> WarmedStandby:
    from megatron.core import parallel_state

    register_sandbox_backend()
    roles = pipeline_roles(parallel_layout(world_size, plan.parallel))
    started = time.time()
    timings: dict[str, float] = {}
    budget = MemoryBudget(memory_mb * MB if memory_mb else None)
    kept: list[KeptRole] = []
    for role in roles:
        role_started = time.perf_counter()
        dist.init_process_group(SANDBOX_BACKEND, store=dist.HashStore(), rank=role.rank,
                                world_size=world_size)
        if plan.initialize_groups is None:
            parallel_state.initialize_model_parallel(**plan.parallel)
        else:
            plan.initialize_groups()
        with budget.measuring(role.name):
            objects = plan.build()
            for _ in range(iterations):
                plan.shadow_step(*objects)
        if budget.keeps(role.name, held_bytes(objects)):
            kept.append(KeptRole(role, objects, _parallel_state_groups(),
                                 uses_distributed_optimizer(objects[1])))
        del objects
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        gc.collect()
        timings[role.name] = time.perf_counter() - role_started
    report = {
        "roles": [role.name for role in roles],
        "kept": [item.role.name for item in kept],
        **budget.report(),
        "shadow_iterations": iterations,
        "role_s": timings,
        "warm_up_s": time.time() - started,
        "sandbox_operations": sum(operations_served().values()),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    logger.info("standby warmed up as %s in %.2f s (%d sandbox operations)",
                "/".join(report["roles"]), report["warm_up_s"], report["sandbox_operations"])
    return WarmedStandby(kept, report)


def _parallel_state_groups() -> dict[str, Any]:
    """``parallel_state``'s module globals that hold process groups (directly or in lists,
    tuples and dicts), plus the default group under ``"WORLD"``."""
    from megatron.core import parallel_state

    found = {name: value for name, value in vars(parallel_state).items()
             if not name.startswith("__") and _holds_group(value)}
    found["WORLD"] = dist.group.WORLD
    return found


def _holds_group(value: Any) -> bool:
    if isinstance(value, dist.ProcessGroup):
        return True
    if isinstance(value, (list, tuple)):
        return any(_holds_group(item) for item in value)
    if isinstance(value, dict):
        return any(_holds_group(item) for item in value.values())
    return False


def _pair_groups(old: Any, new: Any, pairs: Optional[dict[int, Any]] = None) -> dict[int, Any]:
    """``{id(old group): new group}`` for groups at the same place in two structures."""
    pairs = {} if pairs is None else pairs
    if isinstance(old, dist.ProcessGroup):
        if isinstance(new, dist.ProcessGroup):
            pairs[id(old)] = new
    elif isinstance(old, (list, tuple)) and isinstance(new, (list, tuple)):
        for old_item, new_item in zip(old, new):
            _pair_groups(old_item, new_item, pairs)
    elif isinstance(old, dict) and isinstance(new, dict):
        for key, old_item in old.items():
            if key in new:
                _pair_groups(old_item, new[key], pairs)
    return pairs
