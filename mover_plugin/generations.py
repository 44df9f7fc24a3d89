"""Generations, membership, the standby pool and the recovery decision (pure, no torch).

A *generation* is one configuration of the running job: which process holds each global rank.
When a rank is lost the controller plans the next generation: a ready standby takes the lost
rank's global number (so every group that does not contain that rank keeps its members), and
receives its state from a data-parallel *twin* of the same shard. When that is impossible (no
standby left, or no twin because the data-parallel size is 1) the plan is a :class:`Fallback`
to the restart baseline, with the reason for the event log. A planned migration is the same
replacement with the leaving rank as its own source of state (:func:`plan_migration`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from mover_plugin.layout import ParallelLayout


@dataclass(frozen=True)
class Replacement:
    rank: int
    """The lost global rank, taken over by the standby."""
    standby: str
    twin: int
    """The live rank whose state (parameters, optimizer, RNG, iteration) the standby copies;
    in a migration, the leaving rank itself."""
    node: int = -1
    """The node (host) of the standby, where the rank runs from now on."""


@dataclass(frozen=True)
class Fallback:
    reason: str


Plan = Union[list[Replacement], Fallback]


@dataclass
class StandbyPool:
    """Ready standbys in the order they became ready, with the host of each. Standbys on a
    spare host (one that runs no worker) are taken first."""

    hosts: dict[str, int] = field(default_factory=dict)
    spare_nodes: frozenset[int] = frozenset()

    def add(self, standby: str, node: int) -> None:
        self.hosts[standby] = node

    def remove(self, standby: str) -> bool:
        return self.hosts.pop(standby, None) is not None

    def __len__(self) -> int:
        return len(self.hosts)

    def take(self, avoid_node: Optional[int] = None, *,
             strict: bool = False) -> Optional[tuple[str, int]]:
        """Removes and returns a standby and its node, preferring one not on ``avoid_node``
        (``strict``: only such a one); None when there is none."""
        chosen = self._first(avoid_node)
        if chosen is None and not strict:
            chosen = next(iter(self.hosts), None)
        if chosen is None:
            return None
        return chosen, self.hosts.pop(chosen)

    def _first(self, avoid_node: Optional[int]) -> Optional[str]:
        """The standby ready first on a spare host other than ``avoid_node``, else on any
        other host; None when there is none (one pass, thousands of standbys at scale)."""
        first = None
        for standby, node in self.hosts.items():
            if node == avoid_node:
                continue
            if node in self.spare_nodes:
                return standby
            if first is None:
                first = standby
        return first

    def take_on_one_host(self, count: int,
                         avoid_node: Optional[int] = None) -> Optional[list[tuple[str, int]]]:
        """Removes and returns ``count`` standbys of one host other than ``avoid_node`` (a
        spare host first), in the order of their ids; None when no host has that many."""
        by_node: dict[int, list[str]] = {}
        for standby in self._preferred(list(self.hosts)):
            by_node.setdefault(self.hosts[standby], []).append(standby)
        for node, standbys in by_node.items():
            if node != avoid_node and len(standbys) >= count:
                chosen = sorted(standbys[:count], key=_natural_order)
                for standby in chosen:
                    del self.hosts[standby]
                return [(standby, node) for standby in chosen]
        return None

    def _preferred(self, standbys: list[str]) -> list[str]:
        """``standbys`` with those on spare hosts first, each part in the order of readiness."""
        return sorted(standbys, key=lambda standby: self.hosts[standby] not in self.spare_nodes)

    def count_off(self, nodes: set[int]) -> int:
        """How many standbys are on none of ``nodes``."""
        return sum(1 for node in self.hosts.values() if node not in nodes)


def _natural_order(name: str) -> tuple:
    """Orders ``a0.n2.s10`` after ``a0.n2.s9``: digit runs compare as numbers."""
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


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

    def without(self, ranks: Sequence[int]) -> "Membership":
        """The next generation, in which ``ranks`` are held by nobody (the job shrank)."""
        return Membership(self.generation + 1, {rank: process for rank, process
                                                in self.members.items() if rank not in ranks})


def plan_recovery(
    failed: Sequence[int],
    layout: Optional[ParallelLayout],
    pool: StandbyPool,
    node_of_rank: Optional[dict[int, int]] = None,
    carried: Sequence[Replacement] = (),
) -> Plan:
    """Replacements for the ``failed`` ranks, or the reason the job must fall back.

    ``carried``: replacements of the switch still under way (their standbys were promoted but
    have no state yet; none of them failed). They stay with their standbys and take part
    again: each copies from a twin that is neither failed nor carried."""
    if layout is None:
        return Fallback("the parallel layout is unknown (the workers did not publish it)")
    if len(failed) > len(pool):
        return Fallback(f"{len(failed)} rank(s) lost but {len(pool)} standby(s) ready")
    lost = set(failed)
    without_state = lost | {item.rank for item in carried}
    twin_of = {}
    for rank in sorted(without_state):
        twins = [t for t in layout.data_parallel_twins(rank) if t not in without_state]
        if not twins:
            reason = ("the data-parallel size is 1" if layout.dp == 1
                      else "every data-parallel twin was lost too" if not carried
                      else "every data-parallel twin was lost too or has no state yet")
            return Fallback(f"rank {rank} has no live data-parallel twin ({reason})")
        twin_of[rank] = twins[0]
    fresh = [Replacement(rank, standby, twin_of[rank], node) for rank, (standby, node) in
             _take_standbys(sorted(lost), pool, node_of_rank or {}, strict=False)]
    kept = [Replacement(item.rank, item.standby, twin_of[item.rank], item.node)
            for item in carried]
    return sorted(fresh + kept, key=lambda item: item.rank)


def plan_migration(ranks: Sequence[int], pool: StandbyPool, node_of_rank: dict[int, int], *,
                   leave_hosts: bool = False) -> Plan:
    """Replacements moving ``ranks`` to standbys, each rank its own source of state, or the
    reason it cannot be done. Standbys on another host than the rank's are preferred; with
    ``leave_hosts`` (a host is being emptied) only those are used."""
    leaving_nodes = {node_of_rank[rank] for rank in ranks}
    usable = pool.count_off(leaving_nodes) if leave_hosts else len(pool)
    if usable < len(set(ranks)):
        where = (f" off node(s) {', '.join(str(n) for n in sorted(leaving_nodes))}"
                 if leave_hosts else "")
        return Fallback(f"{len(set(ranks))} rank(s) to move but {usable} standby(s) ready"
                        f"{where}")
    return [Replacement(rank, standby, rank, node) for rank, (standby, node) in
            _take_standbys(sorted(set(ranks)), pool, node_of_rank, strict=leave_hosts)]


NO_TWIN = -1
"""The ``twin`` of a replacement whose state comes from no single rank (growing back: every
layer from the survivor that holds it, :func:`mover_plugin.shrink.plan_grow`)."""


def plan_return(ranks: Sequence[int], pool: StandbyPool,
                node_of_rank: dict[int, int]) -> Optional[list[Replacement]]:
    """Standbys for ``ranks`` coming back into a shrunk job (placed as a crash's are), or None
    when the pool has too few."""
    if len(pool) < len(set(ranks)):
        return None
    return [Replacement(rank, standby, NO_TWIN, node) for rank, (standby, node) in
            _take_standbys(sorted(set(ranks)), pool, node_of_rank, strict=False)]


def _take_standbys(ranks: list[int], pool: StandbyPool, node_of_rank: dict[int, int], *,
                   strict: bool) -> list[tuple[int, tuple[str, int]]]:
    """A standby for each of ``ranks`` (the pool has enough). The ranks of one host go to one
    other host when one has enough standbys (a spare host first), in local-rank order, so that
    groups that live inside a host stay inside one; otherwise each takes the best it can."""
    taken: list[tuple[int, tuple[str, int]]] = []
    by_node: dict[Optional[int], list[int]] = {}
    for rank in ranks:
        by_node.setdefault(node_of_rank.get(rank), []).append(rank)
    for node, local in by_node.items():
        together = pool.take_on_one_host(len(local), avoid_node=node) if len(local) > 1 else None
        if together is not None:
            taken += list(zip(local, together))
            continue
        taken += [(rank, pool.take(avoid_node=node, strict=strict)) for rank in local]
    return sorted(taken)
