"""Generations, membership, the standby pool and the recovery decision (pure, no torch).

A *generation* is one configuration of the running job: which process holds each global rank.
When a rank is lost the controller plans the next generation: a ready standby takes the lost
rank's global number (so every group that does not contain that rank keeps its members), and
receives its state from a data-parallel *twin* of the same shard. When that is impossible (no
standby left, or no twin because the data-parallel size is 1) the plan is a :class:`Fallback`
to the restart baseline, with the reason for the event log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from mover_plugin.layout import ParallelLayout


@dataclass(frozen=True)
class Replacement:
    rank: int
    """The lost global rank, taken over by the standby."""
    standby: str
    twin: int
    """The live rank whose state (parameters, optimizer, RNG, iteration) the standby copies."""


@dataclass(frozen=True)
class Fallback:
    reason: str


Plan = Union[list[Replacement], Fallback]


@dataclass
class StandbyPool:
    """Ready standbys in the order they became ready, with the host of each."""

    hosts: dict[str, int] = field(default_factory=dict)

    def add(self, standby: str, node: int) -> None:
        self.hosts[standby] = node

    def remove(self, standby: str) -> bool:
        return self.hosts.pop(standby, None) is not None

    def __len__(self) -> int:
        return len(self.hosts)

    def take(self, avoid_node: Optional[int] = None) -> Optional[str]:
        """Removes and returns a standby, preferring one not on ``avoid_node``."""
        if not self.hosts:
            return None
        others = [s for s, node in self.hosts.items() if node != avoid_node]
        chosen = (others or list(self.hosts))[0]
        del self.hosts[chosen]
        return chosen


@dataclass
class Membership:
    """Which process holds each global rank in the current generation."""

    generation: int
    members: dict[int, str]

    def next_generation(self, replacements: Sequence[Replacement]) -> "Membership":
        members = dict(self.members)
        for item in replacements:
            members[item.rank] = item.standby
        return Membership(self.generation + 1, members)


def plan_recovery(
    failed: Sequence[int],
    layout: Optional[ParallelLayout],
    pool: StandbyPool,
    node_of_rank: Optional[dict[int, int]] = None,
) -> Plan:
    """Replacements for the ``failed`` ranks, or the reason the job must fall back."""
    if layout is None:
        return Fallback("the parallel layout is unknown (the workers did not publish it)")
    if len(failed) > len(pool):
        return Fallback(f"{len(failed)} rank(s) lost but {len(pool)} standby(s) ready")
    lost = set(failed)
    plan = []
    for rank in sorted(lost):
        twins = [t for t in layout.data_parallel_twins(rank) if t not in lost]
        if not twins:
            reason = ("the data-parallel size is 1" if layout.dp == 1
                      else "every data-parallel twin was lost too")
            return Fallback(f"rank {rank} has no live data-parallel twin ({reason})")
        avoid = (node_of_rank or {}).get(rank)
        plan.append(Replacement(rank, pool.take(avoid_node=avoid), twins[0]))
    return plan
