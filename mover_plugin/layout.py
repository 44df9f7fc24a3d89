"""The parallel layout of a job: which global ranks form which groups (pure, no torch).

Megatron-Core orders ranks ``tp-cp-ep-dp-pp`` by default: the tensor-parallel index varies
fastest, then the data-parallel index, then the pipeline stage. With context and expert
parallelism of 1 a global rank is ``tp + TP * (dp + DP * pp)``. This module answers layout
questions (coordinates, group members, data-parallel twins) for any world size in
microseconds, so the controller and tests can reason about 16K-rank jobs without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

from mover_plugin.errors import ConfigError


@dataclass(frozen=True)
class Coordinates:
    tp: int
    dp: int
    pp: int


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor-, data- and pipeline-parallel sizes; ``world_size = tp * dp * pp``."""

    tp: int
    pp: int
    dp: int

    @classmethod
    def for_world(cls, world_size: int, tp: int, pp: int) -> "ParallelLayout":
        """The layout with the given TP and PP; DP is what remains of ``world_size``."""
        for name, value in (("world size", world_size), ("tensor-model-parallel size", tp),
                            ("pipeline-model-parallel size", pp)):
            if value < 1:
                raise ConfigError(f"{name} must be at least 1, got {value}")
        if world_size % (tp * pp):
            raise ConfigError(
                f"world size {world_size} is not divisible by tensor-model-parallel size {tp} "
                f"x pipeline-model-parallel size {pp} = {tp * pp}; choose TP x PP among the "
                f"divisors of {world_size}: {_divisors(world_size)}"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @classmethod
    def of_record(cls, record: dict[str, int]) -> "ParallelLayout":
        """The layout of a published record (:meth:`record`)."""
        return cls(tp=record["tp"], pp=record["pp"], dp=record["dp"])

    def record(self) -> dict[str, int]:
        """The layout as a record to publish (JSON)."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.pp

    def coordinates(self, rank: int) -> Coordinates:
        self._check_rank(rank)
        return Coordinates(tp=rank % self.tp, dp=(rank // self.tp) % self.dp,
                           pp=rank // (self.tp * self.dp))

    def rank(self, tp: int, dp: int, pp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def data_parallel_group(self, rank: int) -> list[int]:
        """Ranks holding the same model shard as ``rank`` (same TP index and stage)."""
        c = self.coordinates(rank)
        return [self.rank(c.tp, dp, c.pp) for dp in range(self.dp)]

    def data_parallel_twins(self, rank: int) -> list[int]:
        """The other replicas of ``rank``'s shard: the peers a replacement can copy from."""
        return [r for r in self.data_parallel_group(rank) if r != rank]

    def pipeline_group(self, rank: int) -> list[int]:
        c = self.coordinates(rank)
        return [self.rank(c.tp, c.dp, pp) for pp in range(self.pp)]

    def tensor_parallel_group(self, rank: int) -> list[int]:
        c = self.coordinates(rank)
        return [self.rank(tp, c.dp, c.pp) for tp in range(self.tp)]

    def replica_sets(self) -> list[list[int]]:
        """Every data-parallel group once: ranks in one set must hold identical parameters."""
        return [self.data_parallel_group(self.rank(tp, 0, pp))
                for pp in range(self.pp) for tp in range(self.tp)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} does not exist; valid: 0..{self.world_size - 1}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
