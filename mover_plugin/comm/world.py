"""The default group (WORLD) carried by the job's other groups, so that replacing one rank
never makes every rank reconnect.

On gloo the default group holds connections between its ranks, the replaced rank's among them,
so a newcomer's WORLD can meet the others' only if every rank builds a new one — a cost paid by
every rank of the job at every switch. A framework's layout already puts ranks that train
together in common groups: Megatron's model-parallel groups times its data-parallel groups,
DeepSpeed's pipeline groups times its data-parallel groups, cover the world as a grid (each
group of one kind meets each group of the other in exactly one rank). Once a
:class:`WorldGroup` is given such a *cover* (:meth:`WorldGroup.cover`), its operations run over
the cover's groups:

* an all-reduce is one all-reduce per cover group in turn (exact for every associative
  ``ReduceOp``; the summation order is fixed, so runs stay bit-for-bit reproducible);
* broadcast, all-gather, gather, scatter, reduce-scatter and all-to-all move the tensors' bytes
  through a sum all-reduce in which each byte has a single non-zero contributor (exact for every
  dtype), and a barrier is a one-element all-reduce;
* a send or receive by global rank goes over the smallest group of the job that holds both
  ranks (both ends choose the same one).

These operations run to completion before the call returns (an ``async_op`` caller gets a work
that is already complete); each step waits on an abortable group, so an alarm still ends them at
once. The groups of the cover are delta-replaced like any other, and
:func:`mover_plugin.comm.delta.install_delta` points the cover at the replacements, so the
default group itself is never rebuilt. The connections it was created with (used until a cover
is set) are left idle; a newcomer creates its default group without them
(``init_process_group(..., pg_options=WorldOptions(connect=False))``) and sets its cover before
any operation on it. Every rank of a job must cover with groups of the same kinds at the same
point of its program. Other groups that hold every rank (Megatron-Core's distributed-optimizer
instance group; its data-parallel group when nothing else is parallel) are ordinary groups,
rebuilt like any other that holds a replaced rank; a cover may consist of one such group.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
import torch.distributed.distributed_c10d as c10d
from torch.distributed import Store
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp

from mover_plugin.comm.process_group import MoverProcessGroup
from mover_plugin.comm.work import AbortableWork

logger = logging.getLogger(__name__)

_EXACT_REDUCTIONS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.BAND,
                     ReduceOp.BOR, ReduceOp.BXOR)


class CoverError(ValueError):
    """Groups that do not cover the world as a grid, or an operation a cover cannot carry."""


@dataclass(frozen=True)
class WorldOptions:
    """``pg_options`` for ``init_process_group("mover", ...)``: ``connect=False`` creates the
    default group without connections of its own (a newcomer to a job whose default group is
    covered)."""

    connect: bool = True


def group_members(group: Any) -> tuple[int, ...]:
    """The global ranks of a c10d group, in group-rank order."""
    ranks = c10d._world.pg_group_ranks.get(group, {})
    return tuple(sorted(ranks, key=ranks.__getitem__))


def group_name_order(name: str) -> tuple[int, str]:
    """A sort key for c10d group names: c10d's numbered names by number, then the others by
    name (every rank orders the groups of the job alike)."""
    return (int(name), name) if name.isdigit() else (1 << 30, name)


def check_cover(rank: int, world_size: int, members: Sequence[Sequence[int]]) -> None:
    """Raises :class:`CoverError` unless groups with these members (as seen from ``rank``)
    form a grid over the world: each holds ``rank``, any two meet only in it, and their sizes
    multiply to the world size (a world of one rank needs none)."""
    for ranks in members:
        if rank not in ranks:
            raise CoverError(f"group {list(ranks)} does not hold this rank ({rank})")
    for index, first in enumerate(members):
        for second in members[index + 1:]:
            if set(first) & set(second) != {rank}:
                raise CoverError(f"groups {list(first)} and {list(second)} meet in "
                                 f"{sorted(set(first) & set(second))}, not only in rank {rank}")
    product = math.prod(len(ranks) for ranks in members)
    if product != world_size:
        raise CoverError(f"group sizes {[len(r) for r in members]} multiply to {product}, not "
                         f"to the world size {world_size}")


def _unless_uncovered(method: Callable[..., AbortableWork]) -> Callable[..., AbortableWork]:
    """An operation of :class:`WorldGroup` that runs over the cover once there is one, and
    until then as on any ``MoverProcessGroup`` (over the group's own connections)."""
    name = method.__name__

    @functools.wraps(method)
    def operation(self: "WorldGroup", *args: Any, **kwargs: Any) -> AbortableWork:
        if not self._cover:
            return getattr(super(WorldGroup, self), name)(*args, **kwargs)
        return method(self, *args, **kwargs)

    return operation


class WorldGroup(MoverProcessGroup):
    """The ``mover`` backend's default group; see the module docstring."""

    is_default_group = True  # shares no backend (its own is left idle once covered)

    def __init__(self, store: Store, rank: int, size: int, timeout: timedelta, *,
                 connect: bool = True, **kwargs: Any) -> None:
        super().__init__(store, rank, size, timeout, connect=connect, **kwargs)
        self._cover: tuple[MoverProcessGroup, ...] = ()
        self._routes: dict[int, tuple[MoverProcessGroup, int]] = {}

    @property
    def covered(self) -> bool:
        """Whether operations run over a cover rather than connections of this group."""
        return bool(self._cover)

    def cover(self, groups: Sequence[Any]) -> None:
        """From now on, carries this group's operations over ``groups`` (groups of size 1
        are left out); raises :class:`CoverError` if they do not cover the world as a grid."""
        groups = [g for g in groups if g.size() > 1]
        foreign = [g for g in groups
                   if not isinstance(g, MoverProcessGroup) or isinstance(g, WorldGroup)]
        if foreign:
            raise CoverError(f"groups {foreign} are not ordinary groups of the mover backend")
        check_cover(self.rank(), self.size(), [group_members(g) for g in groups])
        self._cover = tuple(groups)
        self._routes.clear()
        logger.debug("default group covered by %d group(s) of sizes %s", len(groups),
                     [g.size() for g in groups])

    def replace_cover(self, replaced: Mapping[int, Any]) -> None:
        """Points the cover at the replacements of its groups (``{id(old): new}``)."""
        self._cover = tuple(replaced.get(id(g), g) for g in self._cover)
        self._routes.clear()

    # ------------------------------------------------------------------ over the cover

    def _done(self, op: str) -> AbortableWork:
        return AbortableWork(self, [], op, stream_ordered=False)

    def _reduce_over_cover(self, op: str, tensor: torch.Tensor, reduce_op: Any) -> None:
        self.check_usable(op)
        options = AllreduceOptions()
        options.reduceOp = reduce_op
        for group in self._cover:
            group.allreduce([tensor], options).wait()

    def _exchange(self, op: str, parts: Sequence[Optional[torch.Tensor]],
                  slot_bytes: int, device: torch.device) -> list[torch.Tensor]:
        """Every rank's ``parts`` placed into ``len(parts)`` byte slots of ``slot_bytes`` and
        merged over the world by a sum (each byte has one non-zero contributor); returns the
        merged slots (``None`` parts stay zero)."""
        buffer = torch.zeros(len(parts) * slot_bytes, dtype=torch.uint8, device=device)
        for index, part in enumerate(parts):
            if part is not None:
                buffer[index * slot_bytes:(index + 1) * slot_bytes] = _bytes_of(part)
        self._reduce_over_cover(op, buffer, ReduceOp.SUM)
        return list(buffer.split(slot_bytes))

    @_unless_uncovered
    def allreduce(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        reduce_op = _reduce_op(opts)
        for tensor in tensors:
            self._reduce_over_cover("allreduce", tensor, reduce_op)
        return self._done("allreduce")

    @_unless_uncovered
    def allreduce_coalesced(self, tensors: list[torch.Tensor],  # type: ignore[override]
                            opts: Any = None) -> AbortableWork:
        reduce_op = opts.reduceOp if opts is not None else ReduceOp.SUM
        return self.allreduce(tensors, reduce_op)

    @_unless_uncovered
    def barrier(self, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        self._reduce_over_cover("barrier", torch.zeros(1), ReduceOp.SUM)
        return self._done("barrier")

    @_unless_uncovered
    def broadcast(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else tensors
        root = opts if isinstance(opts, int) else (opts.rootRank if opts is not None else 0)
        for tensor in tensors:
            mine = tensor if self.rank() == root else None
            (merged,) = self._exchange("broadcast", [mine], _nbytes(tensor), tensor.device)
            _set_bytes(tensor, merged)
        return self._done("broadcast")

    @_unless_uncovered
    def reduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Any = None) -> AbortableWork:
        root = opts.rootRank if opts is not None else 0
        reduce_op = opts.reduceOp if opts is not None else ReduceOp.SUM
        for tensor in tensors:
            result = tensor.clone()
            self._reduce_over_cover("reduce", result, reduce_op)
            if self.rank() == root:
                tensor.copy_(result)
        return self._done("reduce")

    def _gather_all(self, op: str, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts: list[Optional[torch.Tensor]] = [None] * self.size()
        parts[self.rank()] = tensor
        return self._exchange(op, parts, _nbytes(tensor), tensor.device)

    @_unless_uncovered
    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor], opts: Any = None) -> AbortableWork:
        for outputs, tensor in zip(output_tensors, input_tensors):
            for output, merged in zip(outputs, self._gather_all("allgather", tensor)):
                _set_bytes(output, merged)
        return self._done("allgather")

    @_unless_uncovered
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> AbortableWork:
        merged = torch.cat(self._gather_all("all_gather_into_tensor", input))
        _set_bytes(output, merged)
        return self._done("all_gather_into_tensor")

    _allgather_base = all_gather_single

    @_unless_uncovered
    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],  # type: ignore[override]
                            input_list: list[torch.Tensor], opts: Any = None) -> AbortableWork:
        return self.allgather(output_lists, input_list, opts)

    @_unless_uncovered
    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor],
                                    opts: Any = None) -> AbortableWork:
        for output, tensor in zip(outputs, inputs):
            self.all_gather_single(output, tensor, opts)
        return self._done("all_gather_into_tensor_coalesced")

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_unless_uncovered
    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor], opts: Any = None) -> AbortableWork:
        root = opts.rootRank if opts is not None else 0
        for index, tensor in enumerate(input_tensors):
            merged = self._gather_all("gather", tensor)
            if self.rank() == root:
                for output, part in zip(output_tensors[index], merged):
                    _set_bytes(output, part)
        return self._done("gather")

    @_unless_uncovered
    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]], opts: Any = None) -> AbortableWork:
        root = opts.rootRank if opts is not None else 0
        for index, output in enumerate(output_tensors):
            parts: list[Optional[torch.Tensor]] = (
                list(input_tensors[index]) if self.rank() == root else [None] * self.size())
            merged = self._exchange("scatter", parts, _nbytes(output), output.device)
            _set_bytes(output, merged[self.rank()])
        return self._done("scatter")

    @_unless_uncovered
    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_lists: list[list[torch.Tensor]], opts: Any = None) -> AbortableWork:
        reduce_op = _reduce_op(opts)
        for output, inputs in zip(output_tensors, input_lists):
            reduced = torch.stack([t.reshape(-1) for t in inputs])
            self._reduce_over_cover("reduce_scatter", reduced, reduce_op)
            output.copy_(reduced[self.rank()].view_as(output))
        return self._done("reduce_scatter")

    @_unless_uncovered
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> AbortableWork:
        reduced = input.clone()
        self._reduce_over_cover("reduce_scatter_tensor", reduced, _reduce_op(opts))
        output.copy_(reduced.reshape(self.size(), -1)[self.rank()].view_as(output))
        return self._done("reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    @_unless_uncovered
    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None,
                                        ) -> AbortableWork:
        for output, tensor in zip(outputs, inputs):
            self.reduce_scatter_single(output, tensor, opts)
        return self._done("reduce_scatter_tensor_coalesced")

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_unless_uncovered
    def alltoall(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                 input_tensors: list[torch.Tensor], opts: Any = None) -> AbortableWork:
        # Every rank's slots must be the same size: the largest input anywhere.
        slot = torch.tensor([max((_nbytes(t) for t in input_tensors), default=0)])
        self._reduce_over_cover("alltoall", slot, ReduceOp.MAX)
        slot = int(slot.item())
        size, rank = self.size(), self.rank()
        parts: list[Optional[torch.Tensor]] = [None] * (size * size)
        for peer, tensor in enumerate(input_tensors):
            parts[rank * size + peer] = _padded_bytes(tensor, slot)
        merged = self._exchange("alltoall", parts, slot, input_tensors[0].device)
        for peer, output in enumerate(output_tensors):
            _set_bytes(output, merged[peer * size + rank][:_nbytes(output)])
        return self._done("alltoall")

    @_unless_uncovered
    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> AbortableWork:
        outputs = list(output.split(output_split_sizes or [output.shape[0] // self.size()] *
                                    self.size()))
        inputs = list(input.split(input_split_sizes or [input.shape[0] // self.size()] *
                                  self.size()))
        received = [torch.empty_like(part) for part in outputs]
        self.alltoall(received, inputs, opts)
        for part, value in zip(outputs, received):
            part.copy_(value)
        return self._done("all_to_all_single")

    alltoall_base = all_to_all_single

    # ------------------------------------------------------------------ point to point

    def _route(self, peer: int) -> tuple[MoverProcessGroup, int]:
        """The smallest group of the job holding this rank and ``peer`` (ties by name), and
        ``peer``'s rank in it."""
        route = self._routes.get(peer)
        if route is None:
            route = self._routes[peer] = _smallest_group_with(self.rank(), peer)
        return route

    def _point_to_point(self, op: str, peer: int,
                        call: Callable[[MoverProcessGroup, int], AbortableWork]) -> AbortableWork:
        if peer == self.rank():
            raise CoverError(f"{op}: rank {peer} is this rank")
        self.check_usable(op)
        group, peer_in_group = self._route(peer)
        return call(group, peer_in_group)

    @_unless_uncovered
    def send(self, tensors: list[torch.Tensor], dst_rank: int,  # type: ignore[override]
             tag: int = 0) -> AbortableWork:
        return self._point_to_point("send", dst_rank, lambda g, r: g.send(tensors, r, tag))

    @_unless_uncovered
    def recv(self, tensors: list[torch.Tensor], src_rank: int,  # type: ignore[override]
             tag: int = 0) -> AbortableWork:
        return self._point_to_point("recv", src_rank, lambda g, r: g.recv(tensors, r, tag))

    @_unless_uncovered
    def recv_anysource(self, tensors: list[torch.Tensor],  # type: ignore[override]
                       tag: int = 0) -> AbortableWork:
        raise CoverError("a receive from any source on the default group is not supported "
                         "once it is covered; receive from a named rank")


def _smallest_group_with(rank: int, peer: int) -> tuple[MoverProcessGroup, int]:
    world = c10d._world
    candidates = []
    for group, ranks in world.pg_group_ranks.items():
        if (isinstance(group, WorldGroup) or not isinstance(group, MoverProcessGroup)
                or rank not in ranks or peer not in ranks):
            continue
        candidates.append((len(ranks), group_name_order(world.pg_names.get(group, "")), group))
    if not candidates:
        raise CoverError(f"no group of the job holds both rank {rank} and rank {peer}: a send "
                         "or receive on the covered default group needs one")
    _, _, group = min(candidates, key=lambda item: item[:2])
    return group, world.pg_group_ranks[group][peer]


def _reduce_op(opts: Any) -> Any:
    reduce_op = ReduceOp.SUM if opts is None else getattr(opts, "reduceOp", opts)
    kind = getattr(reduce_op, "op", reduce_op)  # a ReduceOp or its type
    if kind not in _EXACT_REDUCTIONS:
        raise CoverError(f"reduction {kind} cannot run over the covered default group; "
                         "valid: SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR")
    return reduce_op


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _padded_bytes(tensor: torch.Tensor, size: int) -> torch.Tensor:
    data = _bytes_of(tensor)
    if data.numel() == size:
        return data
    padded = torch.zeros(size, dtype=torch.uint8, device=tensor.device)
    padded[:data.numel()] = data
    return padded


def _set_bytes(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Writes ``data`` (bytes) into ``tensor``, whatever its dtype and layout."""
    if tensor.numel() == 0:
        return
    tensor.copy_(data.clone().view(tensor.dtype).reshape(tensor.shape))


def cover_world(groups: Sequence[Any]) -> bool:
    """Covers c10d's default group with ``groups`` if it is a :class:`WorldGroup` (the
    ``mover`` backend's); returns whether it did."""
    default = c10d._get_default_group()
    if not isinstance(default, WorldGroup):
        return False
    default.cover(groups)
    return True
