"""The parallel layout of a job: which global ranks form which groups (pure, no torch).

Megatron-Core orders ranks ``tp-cp-ep-dp-pp`` by default: the tensor-parallel index varies
fastest, then the data-parallel index, then the pipeline stage. With a context-parallel size of
1 a global rank is ``tp + TP * (dp + DP * pp)``. The experts of mixture-of-experts layers are
laid out over the same ``TP * DP`` ranks of a stage in the order ``etp-ep-edp``: the
expert-tensor-parallel index (ETP, by default TP) varies fastest, then the expert-model-parallel
index (EP: which experts a rank holds), then the expert-data-parallel index. Two ranks hold
the same parameters, dense and expert, only if they share the stage, the tensor-parallel index
and the expert indices: those are a rank's *twins*. Where no other rank holds a rank's experts
(an expert-data-parallel size of 1) but they travel in the rank's optimizer shard (Megatron-Core's
distributed optimizer: the shard of a group of one is all of it), the ranks that hold its dense
parameters are its twins: its state comes from them and its shard's copy. This module answers
layout questions (coordinates, group members, twins) for any world size in microseconds, so the
controller and tests can reason about 16K-rank jobs without processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from mover_plugin.errors import ConfigError


@dataclass(frozen=True)
class Coordinates:
    tp: int
    dp: int
    pp: int
    ep: int = 0
    """The expert-model-parallel index: which experts the rank holds (0 without experts)."""
    etp: int = 0
    """The expert-tensor-parallel index (the tensor-parallel index when ETP = TP)."""


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor-, data- and pipeline-parallel sizes (``world_size = tp * dp * pp``), and the
    expert-model- and expert-tensor-parallel sizes of mixture-of-experts layers (``ep``
    is 1 without experts; ``etp`` None means TP). ``experts_in_shard``: experts that no other
    rank holds travel in their rank's optimizer shard (see the module docstring)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    etp: Optional[int] = None
    experts_in_shard: bool = False

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)

    @classmethod
    def for_world(cls, world_size: int, tp: int, pp: int, *, ep: int = 1,
                  etp: Optional[int] = None, experts_in_shard: bool = False
                  ) -> "ParallelLayout":
        """The layout with the given TP and PP; DP is what remains of ``world_size``. ``ep``
        and ``etp``: the experts' layout (``etp`` None: TP)."""
        for name, value in (("world size", world_size), ("tensor-model-parallel size", tp),
                            ("pipeline-model-parallel size", pp),
                            ("expert-model-parallel size", ep),
                            ("expert-tensor-parallel size", tp if etp is None else etp)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if world_size % (tp * pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor-model-parallel size {tp} "
                f"x pipeline-model-parallel size {pp} = {tp * pp}; choose TP x PP among the "
                f"divisors of {world_size}: {_divisors(world_size)}"
            )
        layout = cls(tp=tp, pp=pp, dp=world_size // (tp * pp), ep=ep, etp=etp,
                     experts_in_shard=experts_in_shard)
        per_stage, experts = layout.tp * layout.dp, layout._expert_span
        if per_stage % experts:
            raise ConfigError(
                f"expert-tensor-parallel size {layout.etp} x expert-model-parallel size {ep} = "
                f"{experts} does not divide the {per_stage} ranks of a pipeline stage (world "
                f"size {world_size} / pipeline {pp}); choose ETP x EP among the divisors of "
                f"{per_stage}: {_divisors(per_stage)}")
        return layout

    @classmethod
    def of_record(cls, record: dict[str, int]) -> "ParallelLayout":
        """The layout of a published record (:meth:`record`)."""
        return cls(tp=record["tp"], pp=record["pp"], dp=record["dp"], ep=record.get("ep", 1),
                   etp=record.get("etp"),
                   experts_in_shard=bool(record.get("experts_in_shard", False)))

    def record(self) -> dict[str, int]:
        """The layout as a record to publish (JSON)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep,
                "etp": self._expert_tp, "experts_in_shard": int(self.experts_in_shard)}

    @property
    def _expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    @property
    def _expert_span(self) -> int:
        """How many consecutive ranks of a stage hold different experts (ETP x EP)."""
        return self._expert_tp * self.ep

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def coordinates(self, rank: int) -> Coordinates:
        self._check_rank(rank)
        local = rank % (self.tp * self.dp)
        return Coordinates(tp=rank % self.tp, dp=(rank // self.tp) % self.dp,
                           pp=rank // (self.tp * self.dp),
                           ep=(local // self._expert_tp) % self.ep,
                           etp=local % self._expert_tp)

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def data_parallel_group(self, rank: int) -> list[int]:
        """Ranks holding the same dense model shard as ``rank`` (same TP index and stage)."""
        c = self.coordinates(rank)
        return [self.rank(c.tp, dp, c.pp) for dp in range(self.dp)]

    def expert_data_parallel_group(self, rank: int) -> list[int]:
        """Ranks holding the same experts as ``rank`` (same stage and expert indices)."""
        self._check_rank(rank)
        per_stage = self.tp * self.dp
        start, first = rank - rank % per_stage, rank % per_stage % self._expert_span
        return list(range(start + first, start + per_stage, self._expert_span))

    def data_parallel_twins(self, rank: int) -> list[int]:
        """The peers a replacement of ``rank`` can copy from: the other ranks holding exactly
        its parameters, dense and expert; or, when no other rank holds its experts and they
        travel in its optimizer shard, the ranks holding its dense parameters."""
        dense = [r for r in self.data_parallel_group(rank) if r != rank]
        experts_alone = self.tp * self.dp == self._expert_span  # expert-data-parallel size 1
        if self.experts_in_shard and experts_alone:
            return dense
        span = self._expert_span
        return [r for r in dense if r % span == rank % span]

    def pipeline_group(self, rank: int) -> list[int]:
        c = self.coordinates(rank)
        return [self.rank(c.tp, c.dp, pp) for pp in range(self.pp)]

    def tensor_parallel_group(self, rank: int) -> list[int]:
        c = self.coordinates(rank)
        return [self.rank(tp, c.dp, c.pp) for tp in range(self.tp)]

    def replica_sets(self) -> list[list[int]]:
        """Each rank with its twins, once: ranks in one set must hold identical parameters."""
        sets: dict[tuple[int, int, int, int], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coordinates(rank)
            sets.setdefault((c.pp, c.tp, c.ep, c.etp), []).append(rank)
        return list(sets.values())

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} does not exist; valid: 0..{self.world_size - 1}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
