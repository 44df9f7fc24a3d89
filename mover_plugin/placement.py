"""Placement: which rank holds which layers and micro-batches when a job trains on a pipeline
template plan, and who sends what when the plan changes (pure, no torch).

An :class:`~mover_plugin.templates.Instantiation` says how many pipelines of which template
cover the hosts; a :class:`Placement` puts it on ranks (one stage per rank): each rank's
pipeline, stage, transformer layers and the slots of the global batch it trains on. From it
follow the groups a plan needs, made in one order on every rank:

- each pipeline's own group (its stages talk point to point) and, when its first and last
  stage differ, the group of those two (the tied word embedding's gradient, as in
  Megatron-Core);
- one *gradient group* per distinct set of ranks holding the same parameters: every layer's
  gradient is summed over all its holders, each pipeline's share weighted by its part of the
  global batch (:meth:`Placement.weight`), so the update equals that of the full job;
- all ranks, for the gradient norm, to which each unit counts once, from its first holder.

The parameters are named by *units*: ``embedding`` (the word embedding, tied to the output
layer unless ``tied`` is false, then ``output`` is its own unit), ``position``,
``layer <i>`` (global transformer layer numbers) and ``final_norm``. :func:`transfers` lists,
for a change of placement, which live rank sends each unit to a rank that did not hold it.

The global batch is ``microbatches`` slots; a pipeline trains on a contiguous run of them.
Which samples a slot holds is the caller's: any numbering that covers the batch once gives
the same summed gradient.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Optional, Sequence

from mover_plugin.errors import ConfigError
from mover_plugin.templates import Instantiation, Template


class PlacementError(ConfigError):
    """A plan that cannot be placed on the given ranks; the message says why."""


@dataclass(frozen=True)
class StageRole:
    """What one rank does under a placement."""

    rank: int
    pipeline: int
    stage: int
    pipeline_ranks: tuple[int, ...]
    layers: tuple[int, int]
    """Global transformer layers ``first .. end - 1``."""
    microbatches: tuple[int, int]
    """The slots of the global batch its pipeline trains on: ``first .. end - 1``."""

    @property
    def pre_process(self) -> bool:
        """Whether it holds the embeddings (the pipeline's first stage)."""
        return self.stage == 0

    @property
    def post_process(self) -> bool:
        """Whether it holds the final norm and the output layer (the last stage)."""
        return self.stage == len(self.pipeline_ranks) - 1

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def num_microbatches(self) -> int:
        return self.microbatches[1] - self.microbatches[0]


@dataclass(frozen=True)
class Placement:
    """Pipelines on ranks: every rank's :class:`StageRole`, in rank order."""

    num_layers: int
    microbatches: int
    roles: tuple[StageRole, ...]
    tied: bool = True
    """Whether the output layer shares the word embedding's weight."""

    @classmethod
    def of_plan(cls, plan: Instantiation, ranks: Sequence[int], num_layers: int, *,
                tied: bool = True, previous: Optional["Placement"] = None,
                fresh: Iterable[int] = ()) -> "Placement":
        """``plan``'s pipelines on ``ranks``, its template stages mapped to transformer layers
        (:func:`transformer_stages`). In order (the first pipeline on the first ranks, its
        stages on them in ascending order), or,
        given the ``previous`` placement, each pipeline on the free ranks that already hold
        most of its layers (fewer to copy; ``fresh`` ranks hold nothing), its stages on them
        in ascending order."""
        if len(ranks) != plan.hosts or len(set(ranks)) != len(ranks):
            raise PlacementError(f"a plan for {plan.hosts} hosts needs as many distinct ranks, "
                                 f"not {list(ranks)}")
        pipelines = [(transformer_stages(t, num_layers), m)
                     for t, m in zip(plan.pipelines, plan.microbatches)]
        if previous is not None:
            ranks = _closest_ranks(pipelines, ranks, previous, set(fresh))
        else:
            ranks, at = list(ranks), 0
            for stages, _ in pipelines:
                ranks[at:at + len(stages)] = sorted(ranks[at:at + len(stages)])
                at += len(stages)
        return cls.of_pipelines(pipelines, ranks, num_layers, tied=tied)

    @classmethod
    def of_pipelines(cls, pipelines: Sequence[tuple[Sequence[tuple[int, int]], int]],
                     ranks: Sequence[int], num_layers: int, *, tied: bool = True
                     ) -> "Placement":
        """Pipelines given as (stage layer ranges, micro-batch count), on ``ranks`` in order."""
        roles: list[StageRole] = []
        ranks = list(ranks)
        slot = 0
        for index, (stages, count) in enumerate(pipelines):
            _check_stages(stages, num_layers)
            members = tuple(ranks[len(roles):len(roles) + len(stages)])
            if len(members) != len(stages):
                raise PlacementError(f"{len(ranks)} ranks are too few for the pipelines")
            if list(members) != sorted(members):
                # A group orders its members by rank, and Megatron-Core takes a stage's place
                # in the pipeline from its rank in the pipeline's group.
                raise PlacementError(f"pipeline {list(members)}: its stages must be on "
                                     "ascending ranks")
            for stage, layers in enumerate(stages):
                roles.append(StageRole(members[stage], index, stage, members, tuple(layers),
                                       (slot, slot + count)))
            slot += count
        if len(roles) != len(ranks):
            raise PlacementError(f"the pipelines have {len(roles)} stages for {len(ranks)} ranks")
        return cls(num_layers, slot, tuple(sorted(roles, key=lambda r: r.rank)), tied)

    @classmethod
    def uniform(cls, pipeline_ranks: Sequence[Sequence[int]], num_layers: int,
                microbatches: int, *, tied: bool = True) -> "Placement":
        """Equal pipelines (the job's own layout): layers split evenly, batch split evenly."""
        size = len(pipeline_ranks[0])
        if num_layers % size or microbatches % len(pipeline_ranks):
            raise PlacementError(f"{num_layers} layers or {microbatches} micro-batches do not "
                                 f"split evenly over {len(pipeline_ranks)} pipelines of {size}")
        per = num_layers // size
        stages = [(s * per, (s + 1) * per) for s in range(size)]
        count = microbatches // len(pipeline_ranks)
        ranks = [rank for members in pipeline_ranks for rank in members]
        return cls.of_pipelines([(stages, count)] * len(pipeline_ranks), ranks, num_layers,
                                tied=tied)

    @classmethod
    def of_record(cls, record: Mapping[str, Any]) -> "Placement":
        """The placement a :meth:`to_record` (JSON) describes."""
        pipelines = [([tuple(stage) for stage in item["stages"]], item["microbatches"])
                     for item in record["pipelines"]]
        ranks = [rank for item in record["pipelines"] for rank in item["ranks"]]
        return cls.of_pipelines(pipelines, ranks, record["num_layers"], tied=record["tied"])

    def to_record(self) -> dict[str, Any]:
        """This placement as JSON-able data (a generation's plan carries it)."""
        pipelines = []
        for members in self.pipelines():
            roles = [self.role(rank) for rank in members]
            pipelines.append({"ranks": list(members),
                              "stages": [list(role.layers) for role in roles],
                              "microbatches": roles[0].num_microbatches})
        pipelines.sort(key=lambda item: self.role(item["ranks"][0]).microbatches)
        return {"num_layers": self.num_layers, "tied": self.tied, "pipelines": pipelines}

    def renumbered(self, new_rank: Mapping[int, int]) -> "Placement":
        """The same placement with each rank ``r`` called ``new_rank[r]`` (an order-keeping
        renumbering: a smaller world's ranks)."""
        record = self.to_record()
        for item in record["pipelines"]:
            item["ranks"] = [new_rank[rank] for rank in item["ranks"]]
        return Placement.of_record(record)

    # -- queries ----------------------------------------------------------------------------

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(role.rank for role in self.roles)

    def role(self, rank: int) -> StageRole:
        for role in self.roles:
            if role.rank == rank:
                return role
        raise PlacementError(f"rank {rank} has no stage in this placement (ranks {self.ranks})")

    def pipelines(self) -> list[tuple[int, ...]]:
        return sorted({role.pipeline_ranks for role in self.roles}, key=lambda r: r[0])

    def units(self, role: StageRole) -> list[str]:
        """The parameter units ``role`` holds, in model order."""
        units = []
        if role.pre_process:
            units += ["embedding", "position"]
        units += [layer_unit(i) for i in range(*role.layers)]
        if role.post_process:
            units.append("final_norm")
            if not self.tied:
                units.append("output")
            elif not role.pre_process:
                units.append("embedding")
        return units

    def holders(self) -> dict[str, tuple[int, ...]]:
        """Every unit's holders, in rank order."""
        holders: dict[str, list[int]] = {}
        for role in self.roles:
            for unit in self.units(role):
                holders.setdefault(unit, []).append(role.rank)
        return {unit: tuple(ranks) for unit, ranks in holders.items()}

    def gradient_groups(self) -> list[tuple[tuple[int, ...], tuple[str, ...]]]:
        """(ranks, units) for each distinct set of holders, in one order for every rank."""
        by_ranks: dict[tuple[int, ...], list[str]] = {}
        for unit, ranks in self.holders().items():
            by_ranks.setdefault(ranks, []).append(unit)
        return [(ranks, tuple(by_ranks[ranks])) for ranks in sorted(by_ranks, key=_group_order)]

    def rank_sets(self) -> list[tuple[int, ...]]:
        """Every group the plan needs (pipelines, their embedding ends, gradient groups, each
        rank alone, all ranks), once each, in the order every rank creates them."""
        sets = {(rank,) for rank in self.ranks} | {tuple(sorted(self.ranks))}
        for members in self.pipelines():
            sets.add(members)
            sets.add(embedding_ends(members))
        sets.update(ranks for ranks, _ in self.gradient_groups())
        return sorted(sets, key=_group_order)

    def weight(self, rank: int) -> float:
        """The share of the global batch ``rank``'s pipeline trains on."""
        return self.role(rank).num_microbatches / self.microbatches

    def describe(self) -> str:
        """``[0 1] layers 0-2|3 x 3 + [2] layers 0-3 x 1``: each pipeline's ranks, layers per
        stage and micro-batches."""
        parts = []
        for members in self.pipelines():
            roles = [self.role(rank) for rank in members]
            layers = "|".join(_span(role.layers) for role in roles)
            parts.append(f"[{' '.join(str(r) for r in members)}] layers {layers} "
                         f"x {roles[0].num_microbatches}")
        return " + ".join(parts)


def _closest_ranks(pipelines: Sequence[tuple[Sequence[tuple[int, int]], int]],
                   ranks: Sequence[int], previous: Placement, fresh: set[int]) -> list[int]:
    """``ranks`` in stage order: for each stage the free rank whose previous layers overlap
    its own most (ties: the one that held fewer layers, which other stages need less; then the
    lowest rank), each pipeline's ranks then put in ascending order (see
    :meth:`Placement.of_pipelines`)."""
    free = sorted(ranks)
    chosen: list[int] = []
    for stages, _ in pipelines:
        members = []
        for first, end in stages:
            def closeness(rank: int) -> tuple[int, int, int]:
                if rank not in previous.ranks or rank in fresh:
                    return (-1, 0, -rank)
                had = previous.role(rank).layers
                overlap = max(0, min(end, had[1]) - max(first, had[0]))
                return (overlap, -(had[1] - had[0]), -rank)
            best = max(free, key=closeness)
            free.remove(best)
            members.append(best)
        chosen += sorted(members)
    return chosen


def layer_unit(index: int) -> str:
    return f"layer {index}"


def embedding_ends(members: tuple[int, ...]) -> tuple[int, ...]:
    """The ranks of a pipeline that hold a copy of the tied word embedding."""
    return tuple(sorted({members[0], members[-1]}))


def _group_order(ranks: tuple[int, ...]) -> tuple:
    return (len(ranks), ranks)


def _span(layers: tuple[int, int]) -> str:
    first, end = layers
    return str(first) if end - first == 1 else f"{first}-{end - 1}"


def _check_stages(stages: Sequence[tuple[int, int]], num_layers: int) -> None:
    ends = [0] + [end for _, end in stages]
    if (not stages or [first for first, _ in stages] != ends[:-1] or ends[-1] != num_layers
            or any(first >= end for first, end in stages)):
        raise PlacementError(f"stages {list(stages)} do not split {num_layers} layers into "
                             "contiguous non-empty runs")


def transformer_stages(template: Template, num_layers: int) -> list[tuple[int, int]]:
    """``template``'s stages as transformer layer ranges.

    A template's layers are the profile's: the embedding (0), the ``num_layers`` transformer
    layers (1 .. num_layers) and the output layer (num_layers + 1). A stage goes where its
    transformer layers are; a Megatron-Core stage holds at least one, so a template stage of the
    embedding or the output layer alone takes its neighbour's nearest transformer layer."""
    count = len(template.stages)
    if template.stages[-1][1] != num_layers + 2:
        raise PlacementError(f"the template splits {template.stages[-1][1]} profile layers, not "
                             f"the {num_layers + 2} of a model of {num_layers} transformer "
                             "layers (with its embedding and output layers)")
    if count > num_layers:
        raise PlacementError(f"{count} stages cannot each hold one of {num_layers} layers")
    bounds = [0]
    for index, (_, end) in enumerate(template.stages[:-1], start=1):
        lowest, highest = bounds[-1] + 1, num_layers - (count - index)
        bounds.append(min(max(end - 1, lowest), highest))
    bounds.append(num_layers)
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class Transfer:
    """``source`` sends ``unit`` (parameters and optimizer state) to ``destination``."""

    unit: str
    source: int
    destination: int


def transfers(old: Placement, new: Placement, live: Optional[Iterable[int]] = None,
              fresh: Iterable[int] = ()) -> list[Transfer]:
    """What each rank of ``new`` must receive: every unit it holds that it did not hold in
    ``old`` (or every unit, for a ``fresh`` rank, one with no state), from the first live holder
    in ``old``; in one order for every rank. Raises :class:`PlacementError` when a unit has no
    live holder."""
    fresh = set(fresh)
    alive = set(old.ranks if live is None else live) - fresh
    before = {unit: [r for r in ranks if r in alive] for unit, ranks in old.holders().items()}
    listed = []
    for role in new.roles:
        held = set() if role.rank in fresh or role.rank not in old.ranks else set(
            old.units(old.role(role.rank)))
        for unit in new.units(role):
            if unit in held and role.rank in alive:
                continue
            sources = before.get(unit, [])
            if not sources:
                raise PlacementError(f"no live rank holds {unit} (rank {role.rank} needs it)")
            listed.append(Transfer(unit, sources[0], role.rank))
    return sorted(listed, key=lambda t: (_unit_order(t.unit), t.destination))


def _unit_order(unit: str) -> tuple:
    if unit.startswith("layer "):
        return (1, int(unit.split()[1]))
    return (0 if unit in ("embedding", "position") else 2, unit)
