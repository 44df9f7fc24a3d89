"""The shrink decision: when a rank is lost and no standby is ready, the survivors' next
generation on pipeline templates (pure, no torch).

A job that can train on pipeline templates says so at its start: its first rank publishes a
:class:`TemplateSpec` (the model's transformer layer count, whether the output layer shares
the word embedding, the global batch in micro-batches, and the per-layer profile given with
``--resilient-template-profile`` when there is one). Without one, the first rank of every
pipeline stage measures its stage's layers before the first step and publishes them; the
controller puts them together (:func:`assemble_profile`) when it plans. When the controller
cannot give a lost rank a standby, :func:`plan_shrink` plans the survivors' generation from it:

- the survivors form a world of their own, numbered in the order of their job ranks (their
  ranks in the job stay their names towards the controller);
- the planner's instantiation for that many hosts (one rank each: tensor-parallel size 1),
  with at least ``f + 1`` pipelines when it has one and as many as it can otherwise
  (:func:`~mover_plugin.templates.instantiate`);
- placed so that each pipeline goes on the survivors that already hold most of its layers
  (:meth:`~mover_plugin.placement.Placement.of_plan`), starting from the job's own placement
  (Megatron-Core's equal pipelines, :meth:`~mover_plugin.placement.Placement.uniform`);
- and every layer a survivor newly holds, with its optimizer state, sent by a live holder
  (:func:`~mover_plugin.placement.transfers`) — never read from a checkpoint.

A rank lost while the job trains on templates (and no growing back is under way) shrinks it
again: :func:`plan_shrink` given the current shrink's plan plans the remaining survivors from
the templates' placement, every unit they newly hold sent by a live holder on the templates.
Each shrink's plan lists every rank the job goes on without, since the job's start.

When standbys are ready for every lost rank, :func:`plan_grow` plans the way back: the job's
own layout on all its ranks again, the standbys in the lost ranks' places, every unit a rank of
the job's layout lacks sent by a survivor that holds it on the templates.

A loss the templates cannot cover (fewer survivors than the smallest template; a layer every
holder of which was lost) is a :class:`~mover_plugin.generations.Fallback` with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence, Union

from mover_plugin.contract import GenerationPlan, PlanKind
from mover_plugin.generations import Fallback
from mover_plugin.layout import ParallelLayout
from mover_plugin.placement import Placement, PlacementError, transfers
from mover_plugin.templates import (
    LayerCost,
    PlanningError,
    Profile,
    instantiate,
    plan_templates,
    transformer_profile,
)



@dataclass(frozen=True)
class TemplateSpec:
    """What the planner needs to know about a job's model and batch."""

    num_layers: int
    tied: bool
    microbatches: int
    """The global batch in micro-batches."""
    fault_tolerance: int = 1
    """``--resilient-fault-tolerance``: the plan keeps at least this many pipelines more than
    one when the ranks left allow it."""
    profile: Optional[dict[str, Any]] = None
    """A measured per-layer profile (:func:`profile_record`); None: the synthetic GPT-like
    one (:func:`~mover_plugin.templates.transformer_profile`)."""
    measured: bool = False
    """Whether :attr:`profile` is the one the job's stages measured at its start (otherwise
    it was given with ``--resilient-template-profile``)."""

    @property
    def profile_source(self) -> str:
        """``given``, ``measured``, or ``estimate`` (no profile: the GPT-like one)."""
        if self.profile is None:
            return "estimate"
        return "measured" if self.measured else "given"

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> "TemplateSpec":
        return cls(int(record["num_layers"]), bool(record["tied"]),
                   int(record["microbatches"]), int(record.get("fault_tolerance", 1)),
                   record.get("profile"), bool(record.get("measured", False)))

    def to_record(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "tied": self.tied,
                "microbatches": self.microbatches, "fault_tolerance": self.fault_tolerance,
                "profile": self.profile, "measured": self.measured}

    def with_measured(self, stages: Sequence[Mapping[str, Any]]) -> "TemplateSpec":
        """This spec planning from the profile its stages measured (their records, in stage
        order), when it has no given one; raises :class:`PlanningError` when they do not
        make the model's profile."""
        if self.profile is not None:
            return self
        return replace(self, profile=assemble_profile(stages, self.num_layers), measured=True)

    def planner_profile(self) -> Profile:
        if self.profile is None:
            return transformer_profile(self.num_layers)
        return Profile(tuple(LayerCost(**layer) for layer in self.profile["layers"]),
                       int(self.profile["host_memory_bytes"]))


def shape_refusals(tensor_parallel: int, experts: bool, sharded: bool,
                   gpu: bool) -> list[str]:
    """Why a Megatron-Core job of this shape cannot train on pipeline templates (none: it
    can): its tensor-parallel size, mixture-of-experts layers, the distributed optimizer
    (``sharded``), a GPU."""
    refused = {
        f"tensor-parallel size {tensor_parallel}": tensor_parallel != 1,
        "mixture-of-experts layers (--num-experts)": experts,
        "the distributed optimizer": sharded,
        "a GPU (the layer transfers are written for CPU tensors)": gpu,
    }
    return [reason for reason, applies in refused.items() if applies]


def profile_record(profile: Profile) -> dict[str, Any]:
    """``profile`` as JSON-able data (:attr:`TemplateSpec.profile`)."""
    return {"host_memory_bytes": profile.host_memory_bytes,
            "layers": [vars(layer) for layer in profile.layers]}


def assemble_profile(stages: Sequence[Mapping[str, Any]], num_layers: int) -> dict[str, Any]:
    """The model's profile record from its pipeline stages' (:func:`profile_record` of each
    stage's parts, in stage order): their layers one after the other, and the smallest host
    memory. Raises :class:`PlanningError` unless the layers are the embedding, the
    ``num_layers`` transformer layers and the output layer, in order."""
    layers = [layer for stage in stages for layer in stage["layers"]]
    names = [str(layer["name"]) for layer in layers]
    expected = ["embedding", *(f"layer {index}" for index in range(num_layers)), "output"]
    if names != expected:
        raise PlanningError(f"the stages measured {names}, not the {len(expected)} layers "
                            f"{expected[0]!r} .. {expected[-1]!r} of the model")
    return {"host_memory_bytes": min(int(stage["host_memory_bytes"]) for stage in stages),
            "layers": layers}


@dataclass(frozen=True)
class ShrinkPlan:
    """The survivors' generation."""

    survivors: tuple[int, ...]
    """Their job ranks; the i-th is rank i of the new world."""
    placement: Placement
    """In the new world's ranks."""
    moves: list[tuple[str, int, int]] = field(default_factory=list)
    """(unit, source, destination) in the new world's ranks, in the order every rank sends
    and receives them."""
    lost: tuple[int, ...] = ()
    """Every job rank the job goes on without (those of earlier shrinks too), in order."""

    def generation_plan(self) -> GenerationPlan:
        """The survivors' generation's plan."""
        return GenerationPlan(PlanKind.SHRINK, world_size=len(self.survivors),
                              lost=self.lost, survivors=self.survivors,
                              placement=self.placement.to_record(), moves=tuple(self.moves),
                              describe=self.placement.describe())


def job_placement(layout: ParallelLayout, spec: TemplateSpec) -> Placement:
    """The job's own placement: Megatron-Core's equal pipelines, in job ranks."""
    pipelines = sorted({tuple(layout.pipeline_group(rank)) for rank in range(layout.world_size)})
    return Placement.uniform(pipelines, spec.num_layers, spec.microbatches, tied=spec.tied)


def shrunk_placement(shrunk: GenerationPlan) -> Placement:
    """The templates' placement of a shrink's plan, in job ranks."""
    assert shrunk.placement is not None, "a shrink's plan has its placement"
    return Placement.of_record(shrunk.placement).renumbered(dict(enumerate(shrunk.survivors)))


def plan_shrink(lost: Sequence[int], layout: Optional[ParallelLayout],
                spec: Optional[TemplateSpec],
                shrunk: Optional[GenerationPlan] = None) -> Union[ShrinkPlan, Fallback]:
    """The survivors' generation after losing ``lost`` (job ranks), or why there is none;
    ``shrunk``: the plan of the shrink the job trains on (None: it trains on its own layout)."""
    if spec is None:
        return Fallback("the job does not train on pipeline templates (the script gave no "
                        "stage recipe, or its configuration has none)")
    if layout is None:
        return Fallback("the parallel layout is unknown (the workers did not publish it)")
    if layout.tp != 1:
        return Fallback(f"pipeline templates need tensor-parallel size 1, not {layout.tp}")
    gone = set(lost) | set(shrunk.lost if shrunk is not None else ())
    survivors = tuple(rank for rank in range(layout.world_size) if rank not in gone)
    try:
        templates = plan_templates(spec.planner_profile(), layout.pp)
        plan = _instantiation(templates, len(survivors), spec.microbatches,
                              spec.fault_tolerance)
        before = job_placement(layout, spec) if shrunk is None else shrunk_placement(shrunk)
        placement = Placement.of_plan(plan, survivors, spec.num_layers, tied=spec.tied,
                                      previous=before)
        listed = transfers(before, placement, live=survivors)
    except (PlanningError, PlacementError) as error:
        return Fallback(f"no pipeline-template plan for the {len(survivors)} rank(s) left: "
                        f"{error}")
    new_rank = {rank: index for index, rank in enumerate(survivors)}
    return ShrinkPlan(survivors, placement.renumbered(new_rank),
                      [(t.unit, new_rank[t.source], new_rank[t.destination]) for t in listed],
                      lost=tuple(sorted(gone)))


def _instantiation(templates: Any, hosts: int, microbatches: int, fault_tolerance: int) -> Any:
    """With ``fault_tolerance + 1`` pipelines when there is such a plan, else as many as the
    hosts allow (a job that lost hosts keeps training with less protection)."""
    for tolerance in range(fault_tolerance, 0, -1):
        try:
            return instantiate(templates, hosts, microbatches, tolerance)
        except PlanningError:
            continue
    return instantiate(templates, hosts, microbatches, 0)


def plan_grow(shrunk: GenerationPlan, layout: ParallelLayout,
              spec: TemplateSpec) -> tuple[Placement, list[tuple[str, int, int]]]:
    """The job's own placement again after the shrink whose plan is ``shrunk``, and the
    moves that bring every rank its units (job ranks; the lost ranks come back empty)."""
    job = job_placement(layout, spec)
    listed = transfers(shrunk_placement(shrunk), job, live=shrunk.survivors, fresh=shrunk.lost)
    return job, [(t.unit, t.source, t.destination) for t in listed]
