"""The abortable process group behind the ``mover`` c10d backend.

:class:`MoverProcessGroup` is a Python subclass of ``torch.distributed.ProcessGroup`` that
c10d's ``_new_process_group_helper`` adopts as the group itself (a creator function that
returns a ``ProcessGroup`` subclass replaces the generic one c10d would have built). c10d then
registers it in its world maps like any other group, so ``get_rank(group)``,
``get_global_rank``, p2p by global rank, ``new_group`` and ``destroy_process_group`` all work.
The Python functions of ``torch.distributed`` call its methods (``allreduce``,
``all_gather_single``, ``send``, ...) directly; C++ callers reach the ones that
``torch``'s ``PyProcessGroup`` trampoline forwards.

Each operation is handed to a real backend (:mod:`mover_plugin.comm.connections`) —
``ProcessGroupGloo`` for CPU tensors, and on a machine with CUDA ``ProcessGroupNCCL`` for CUDA
tensors — and its work is wrapped in an
:class:`~mover_plugin.comm.work.AbortableWork`; an all-reduce in a group of one (its result is
its input, unless it is a pre-multiplied sum) completes without the backend. A group is
*aborted* once the process-wide alarm has been raised after its creation (or
:meth:`MoverProcessGroup.abort` was called): new operations raise
:class:`~mover_plugin.comm.errors.CollectiveAborted` at once, waits end with it, NCCL
communicators are aborted, and :meth:`MoverProcessGroup.shutdown` (called by
``destroy_process_group``) returns at once, handing backends with pending operations to
:mod:`mover_plugin.comm.retired` instead of joining their threads. The groups not shut down
yet are the live groups (:mod:`mover_plugin.comm.live`), which the alarm's listener reaches.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store
from torch.distributed.distributed_c10d import (
    AllgatherOptions,
    AllreduceCoalescedOptions,
    AllreduceOptions,
    AllToAllOptions,
    BarrierOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOp,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from mover_plugin.comm import alarm, live, retired
from mover_plugin.comm.connections import (
    is_nccl_options,
    make_gloo,
    make_nccl,
    register_per_device,
)
from mover_plugin.comm.errors import CollectiveAborted, CommAborted
from mover_plugin.comm.named import NamedProcessGroup
from mover_plugin.comm.work import AbortableWork, completed, observe

logger = logging.getLogger(__name__)

BACKEND_NAME = "mover"


class _Link:
    """What the groups sharing one gloo backend share: the operations issued on it (all
    members issue them in the same order whichever group they go through), whether one failed,
    and how many groups use it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.inflight: list[Any] = []  # observers of backend works, see work.observe
        self.failure: Optional[BaseException] = None
        self.users = 1


class MoverProcessGroup(NamedProcessGroup):
    """A process group whose operations can be abandoned; see the module docstring.

    Normally created by c10d through the ``mover`` backend (``init_process_group("mover")``,
    ``new_group``); it can also be built directly for a group that c10d does not manage.

    Args:
        store: the store the backends rendezvous in (c10d passes the group's prefix store).
        rank: this process's rank in the group.
        size: the number of ranks in the group.
        timeout: the backends' own operation timeout.
        group_name: c10d's name of the group (for logs and NCCL's bookkeeping).
        global_ranks: the global ranks of the group's members, in group-rank order
            (empty: all ranks, i.e. the default group).
        use_cuda: build an NCCL backend for CUDA tensors; ``None``: when CUDA and NCCL are
            available.
        nccl_options: ``ProcessGroupNCCL.Options`` for the NCCL backend (e.g. the
            ``pg_options`` Megatron passes to ``new_group``); other values are ignored.
        abortable: whether the process-wide alarm aborts this group (``False`` for a group
            outside the job's, such as a hand-over between two processes, which must finish
            whatever happens to the others; a peer's death still ends its operations with an
            error).
        connect: build the backends (``False``: a group whose operations another object
            carries, see :class:`mover_plugin.comm.world.WorldGroup`).

    A gloo backend connects each member to its ring neighbours at creation and other pairs on
    first use (see :func:`~mover_plugin.comm.connections.make_gloo`). Groups whose members are
    the same ranks in the same order may share one gloo backend (``share_with``: a group to
    share with, if :meth:`can_share_with` allows; the ``mover`` backend and the delta pass
    one): every member issues their operations in one program order, so one backend carries
    them in that order, and a group's replacement costs one backend per distinct set of
    members. Groups with NCCL never share. Set the class attribute :attr:`c10d_gloo` to build
    every group's gloo backend as c10d does: its own, connecting every pair at creation.
    """

    backend_name = BACKEND_NAME
    c10d_gloo: bool = False
    is_default_group = False

    def __init__(self, store: Store, rank: int, size: int, timeout: timedelta, *,
                 group_name: str = "", global_ranks: Sequence[int] = (),
                 use_cuda: Optional[bool] = None, nccl_options: Any = None,
                 abortable: bool = True, connect: bool = True,
                 share_with: Optional["MoverProcessGroup"] = None) -> None:
        super().__init__(rank, size, group_name)
        self._label = group_name or "?"
        self._timeout = timeout
        self._nccl_options = nccl_options if is_nccl_options(nccl_options) else None
        self._abortable = abortable
        self._epoch = alarm.current_epoch()
        self._abort_reason: Optional[str] = None
        self._closed = False
        self._nccl_aborted = False
        self._global_ranks = list(global_ranks) or list(range(size))
        if use_cuda is None:
            use_cuda = connect and torch.cuda.is_available() and dist.is_nccl_available()
        self._gloo: Optional[Any] = None
        self._nccl: Optional[Any] = None
        if (connect and share_with is not None and not use_cuda and not self.c10d_gloo
                and share_with.can_share_with(self)):
            self._link = share_with._link
            with self._link.lock:
                self._link.users += 1
            self._gloo = share_with._gloo
        else:
            if connect:
                self._gloo = make_gloo(PrefixStore("gloo/", store), rank, size, timeout,
                                        full_mesh=self.c10d_gloo)
                self._gloo.options.global_ranks_in_group = self._global_ranks
                self._gloo.options.group_name = group_name
            self._link = _Link()
        if use_cuda:
            self._nccl = make_nccl(PrefixStore("nccl/", store), rank, size, timeout,
                                    self._global_ranks, group_name, nccl_options)
        register_per_device(self, self._gloo, self._nccl)  # as c10d registers its own
        live.add(self)
        logger.debug("group %s: rank %d of %d (global ranks %s), epoch %d, nccl=%s, "
                     "gloo shared by %d", self._label, rank, size, self._global_ranks,
                     self._epoch, self._nccl is not None, self._link.users)

    # ------------------------------------------------------------------ state

    def __repr__(self) -> str:
        return (f"MoverProcessGroup(name={self.label!r}, rank={self.rank()}, "
                f"size={self.size()}, epoch={self._epoch}, aborted={self.aborted})")

    @property
    def label(self) -> str:
        """The group's name in messages: its c10d name, else the label it was made with."""
        return self._group_name or self._label

    def nccl_options_copy(self) -> Any:
        """A copy of the NCCL options the group was made with (None without), for the group
        that replaces it: its communicator gets the same configuration (stream priority,
        CTA counts, network) as the members that keep theirs."""
        if self._nccl_options is None:
            return None
        copy = dist.ProcessGroupNCCL.Options(
            is_high_priority_stream=self._nccl_options.is_high_priority_stream)
        copy.config = self._nccl_options.config
        return copy

    def can_share_with(self, other: "MoverProcessGroup") -> bool:
        """Whether ``other`` may use this group's gloo backend: same ranks in the same order,
        gloo only, this group usable and connected, neither a default group."""
        return (other._global_ranks == self._global_ranks and other.rank() == self.rank()
                and self._gloo is not None and self._nccl is None and other._nccl is None
                and self.usable and not self.is_default_group and not other.is_default_group
                and self._abortable == other._abortable)

    @property
    def epoch(self) -> int:
        """The alarm epoch this group belongs to (the current one if alarms do not abort it)."""
        return self._epoch if self._abortable else alarm.current_epoch()

    @property
    def aborted(self) -> bool:
        """Whether the group was aborted (by an alarm after its creation, or explicitly)."""
        return self._abort_reason is not None or alarm.current_epoch() != self.epoch

    def pending_operations(self) -> int:
        """How many backend operations issued on this group (and the groups sharing its gloo
        backend) have not completed."""
        with self._link.lock:
            return sum(1 for item in self._link.inflight if not item.done())

    def failed_operations(self) -> int:
        """How many of those completed with an error (seen by a wait or not). NCCL counts a
        work whose communicator hit an asynchronous error as completed while its kernel may
        still spin: such a group is neither idle nor kept, and an alarm aborts it."""
        with self._link.lock:
            return sum(1 for item in self._link.inflight if _failed(item))

    @property
    def usable(self) -> bool:
        """Whether operations may run (and waits go on) here; :meth:`check_usable` says why not."""
        return (self._abort_reason is None and alarm.current_epoch() == self.epoch
                and not self._closed and self._link.failure is None)

    @property
    def idle(self) -> bool:
        """Whether every operation issued here (and on the groups sharing its gloo backend)
        has completed and none failed: the members of a group that is idle on all of them
        issued the same operations, so the group can go on being used after an alarm (see
        :meth:`revive`)."""
        return (self._link.failure is None and not self._closed and not self._nccl_aborted
                and self._abort_reason is None and self.pending_operations() == 0
                and self.failed_operations() == 0)

    def revive(self) -> None:
        """Makes a group that an alarm aborted usable again, in the current alarm epoch.

        Only for a group that every member found :attr:`idle` after the alarm (the caller
        establishes that); raises ``ValueError`` if this member's side is not idle."""
        if not self.idle:
            raise ValueError(f"group {self.label!r} cannot be revived: it has pending, "
                             "failed or aborted operations, or was shut down")
        self._epoch = alarm.current_epoch()

    def check_usable(self, op: str) -> None:
        """Raises :class:`CollectiveAborted` if ``op`` must not run (or keep waiting) here."""
        if self._abort_reason is not None:
            raise CollectiveAborted(f"{op} on group {self.label!r}: group aborted: "
                                    f"{self._abort_reason}", reason=self._abort_reason,
                                    group=self.label)
        if alarm.current_epoch() != self.epoch:
            reason = alarm.reason_after(self._epoch) or "alarm"
            raise CollectiveAborted(f"{op} on group {self.label!r}: aborted by the alarm: "
                                    f"{reason}", reason=reason, group=self.label)
        if self._closed:
            raise CollectiveAborted(f"{op} on group {self.label!r}: the group was shut down",
                                    reason="shut down", group=self.label)
        if self._link.failure is not None:
            raise CollectiveAborted(
                f"{op} on group {self.label!r}: an earlier operation failed: "
                f"{self._link.failure}", reason=str(self._link.failure), group=self.label,
            ) from self._link.failure

    def note_failure(self, error: BaseException) -> None:
        """Latches a backend error: the group's peers are out of step, so later operations
        are refused."""
        if isinstance(error, CommAborted) or self._link.failure is not None:
            return
        self._link.failure = error
        logger.warning("group %s: operation failed, group unusable from now on: %s",
                       self.label, error)

    # ------------------------------------------------------------------ abort and shutdown

    def abort(self, reason: str = "aborted explicitly") -> None:  # type: ignore[override]
        """Aborts this group alone: like an alarm, but only for this group."""
        if self._abort_reason is None:
            self._abort_reason = reason
            logger.info("group %s aborted: %s", self.label, reason)
        self.on_alarm(reason)
        alarm.wake_waiters()

    @property
    def uses_nccl(self) -> bool:
        """Whether the group has an NCCL communicator (it was created where CUDA is)."""
        return self._nccl is not None

    def on_alarm(self, reason: str) -> None:
        """Called by the alarm's listener (:mod:`mover_plugin.comm.live`). Aborts the NCCL
        communicator of an aborted group that has an operation in flight (an idle communicator
        blocks nobody and may be kept; gloo has nothing to abort: its waiters are woken by the
        alarm and leave)."""
        if not self.aborted:
            return  # created after the alarm: belongs to the next generation
        nccl = self._nccl
        if nccl is not None and (self._abort_reason is not None or self.pending_operations()
                                 or self.failed_operations()):
            self._nccl_aborted = True
            try:
                nccl.abort()
            except Exception:
                logger.exception("group %s: NCCL abort failed", self.label)

    def shutdown(self) -> None:
        """Releases the backends without waiting for operations abandoned after an abort.

        Called by ``destroy_process_group``. Never blocks on a peer: backends with pending
        operations are retired (kept alive until those end), the rest are released.
        """
        if self._closed:
            return
        self._closed = True
        live.discard(self)
        with self._link.lock:
            self._link.users -= 1
            last_user = self._link.users == 0
            pending = [item for item in self._link.inflight if not item.done()]
            if last_user:
                self._link.inflight = []
        gloo, nccl = self._gloo if last_user else None, self._nccl
        self._gloo = self._nccl = None
        if not last_user:
            logger.debug("group %s shut down; its gloo backend stays with %d other group(s)",
                         self.label, self._link.users)
            return
        if nccl is not None:
            try:
                if pending or self.aborted:
                    nccl.abort()
                else:
                    nccl.shutdown()
            except Exception:
                logger.exception("group %s: NCCL shutdown failed", self.label)
        backends = [b for b in (gloo, nccl) if b is not None]
        if pending:
            logger.info("group %s shut down with %d operation(s) pending", self.label,
                        len(pending))
        retired.retire(self.label, backends, pending)

    @property
    def timeout(self) -> timedelta:
        """The backends' default operation timeout."""
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the backends' default operation timeout (NCCL's too: its watchdog's)."""
        self._timeout = timeout
        for backend in (self._gloo, self._nccl):
            if backend is not None:
                backend._set_default_timeout(timeout)

    # ------------------------------------------------------------------ dispatch

    def _backend_for(self, tensor: Optional[torch.Tensor], op: str) -> Any:
        device = "cpu" if tensor is None else tensor.device.type
        if device == "cuda":
            backend = self._nccl
        elif device == "cpu":
            backend = self._gloo
        else:
            raise ValueError(f"{op}: the mover backend has no communicator for {device} "
                             "tensors (cpu uses gloo, cuda uses NCCL)")
        if backend is None:
            if self._closed:
                self.check_usable(op)
            if self._gloo is None and self._nccl is None:
                raise ValueError(f"{op}: group {self.label!r} was created without "
                                 "connections of its own (a default group to be covered)")
            raise ValueError(f"{op}: group {self.label!r} has no communicator for "
                             f"{device} tensors (no CUDA/NCCL when it was created)")
        return backend

    def _issue(self, op: str, tensor: Optional[torch.Tensor],
               calls: Callable[[Any], Sequence[dist.Work]], *,
               point_to_point: bool = False) -> AbortableWork:
        self._drop_completed()
        self.check_usable(op)
        backend = self._backend_for(tensor, op)
        stream_ordered = backend is self._nccl
        communicator = backend if stream_ordered else None
        pending = [observe(work, communicator=communicator, point_to_point=point_to_point)
                   for work in calls(backend)]
        with self._link.lock:
            self._link.inflight.extend(pending)
        return AbortableWork(self, pending, op, stream_ordered=stream_ordered)

    def _drop_completed(self) -> None:
        """Forgets the completed operations (so that their tensors are not kept alive), each
        looked at once: one that failed with no wait to see it (gloo's connection reset,
        NCCL's asynchronous error) makes the group unusable before the next is issued."""
        failure: Optional[BaseException] = None
        with self._link.lock:
            running = []
            for item in self._link.inflight:
                if not item.done():
                    running.append(item)
                elif failure is None:
                    failure = item.settled_error()
            self._link.inflight = running
        if failure is not None:
            self.note_failure(failure)

    def _complete_alone(self, op: str, tensors: list[torch.Tensor]) -> AbortableWork:
        """``op`` in a group of one, where its result is its input: checked like any
        operation, completed without the backend (Megatron issues several such all-reduces per
        micro-batch on its size-one tensor-parallel group; through gloo each costs ~70 us
        here)."""
        self.check_usable(op)
        self._backend_for(tensors[0] if tensors else None, op)
        return AbortableWork(self, [completed(tensors)], op, stream_ordered=False)

    def _alone_is_identity(self, op: Any) -> bool:
        """Whether a reduction with ``op`` leaves the tensors as they are here: a group of one
        and any operation but a pre-multiplied sum."""
        return self.size() == 1 and op != ReduceOp.PREMUL_SUM

    # ------------------------------------------------------------------ collectives

    def allreduce(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        opts = _allreduce_options(opts)
        if self._alone_is_identity(opts.reduceOp):
            return self._complete_alone("allreduce", tensors)
        return self._issue("allreduce", tensors[0], lambda b: [b.allreduce(tensors, opts)])

    def allreduce_coalesced(self, tensors: list[torch.Tensor],  # type: ignore[override]
                            opts: Optional[AllreduceCoalescedOptions] = None) -> AbortableWork:
        single = AllreduceOptions()
        single.reduceOp = opts.reduceOp if opts is not None else ReduceOp.SUM
        if opts is not None:
            single.timeout = opts.timeout
        if self._alone_is_identity(single.reduceOp):
            return self._complete_alone("allreduce_coalesced", tensors)
        return self._issue("allreduce_coalesced", tensors[0] if tensors else None,
                           lambda b: [b.allreduce([t], single) for t in tensors])

    def broadcast(self, tensors: Any, opts: Any = None) -> AbortableWork:  # type: ignore[override]
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if opts is None:
            opts = BroadcastOptions()
        elif isinstance(opts, int):
            root, opts = opts, BroadcastOptions()
            opts.rootRank = root
        return self._issue("broadcast", tensors[0], lambda b: [b.broadcast(tensors, opts)])

    def reduce(self, tensors: list[torch.Tensor],  # type: ignore[override]
               opts: Optional[ReduceOptions] = None) -> AbortableWork:
        opts = opts or ReduceOptions()
        return self._issue("reduce", tensors[0], lambda b: [b.reduce(tensors, opts)])

    def allgather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
                  input_tensors: list[torch.Tensor],
                  opts: Optional[AllgatherOptions] = None) -> AbortableWork:
        opts = opts or AllgatherOptions()
        return self._issue("allgather", input_tensors[0],
                           lambda b: [b.allgather(output_tensors, input_tensors, opts)])

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Optional[AllgatherOptions] = None) -> AbortableWork:
        opts = opts or AllgatherOptions()
        return self._issue("all_gather_into_tensor", input,
                           lambda b: [b._allgather_base(output, input, opts)])

    _allgather_base = all_gather_single

    def allgather_coalesced(self,  # type: ignore[override]
                            output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor],
                            opts: Optional[AllgatherOptions] = None) -> AbortableWork:
        opts = opts or AllgatherOptions()
        return self._issue("allgather_coalesced", input_list[0] if input_list else None,
                           lambda b: [b.allgather([out], [inp], opts)
                                      for out, inp in zip(output_lists, input_list)])

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor],
                                    inputs: list[torch.Tensor],
                                    opts: Optional[AllgatherOptions] = None) -> AbortableWork:
        opts = opts or AllgatherOptions()
        return self._issue("all_gather_into_tensor_coalesced", inputs[0] if inputs else None,
                           lambda b: [b._allgather_base(out, inp, opts)
                                      for out, inp in zip(outputs, inputs)])

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                       input_lists: list[list[torch.Tensor]],
                       opts: Optional[ReduceScatterOptions] = None) -> AbortableWork:
        opts = opts or ReduceScatterOptions()
        return self._issue("reduce_scatter", output_tensors[0],
                           lambda b: [b.reduce_scatter(output_tensors, input_lists, opts)])

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Optional[ReduceScatterOptions] = None) -> AbortableWork:
        opts = opts or ReduceScatterOptions()
        return self._issue("reduce_scatter_tensor", input,
                           lambda b: [b._reduce_scatter_base(output, input, opts)])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Optional[ReduceScatterOptions] = None,
                                        ) -> AbortableWork:
        opts = opts or ReduceScatterOptions()
        return self._issue("reduce_scatter_tensor_coalesced", inputs[0] if inputs else None,
                           lambda b: [b._reduce_scatter_base(out, inp, opts)
                                      for out, inp in zip(outputs, inputs)])

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def alltoall(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                 input_tensors: list[torch.Tensor],
                 opts: Optional[AllToAllOptions] = None) -> AbortableWork:
        opts = opts or AllToAllOptions()
        return self._issue("alltoall", input_tensors[0],
                           lambda b: [b.alltoall(output_tensors, input_tensors, opts)])

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Optional[AllToAllOptions] = None) -> AbortableWork:
        opts = opts or AllToAllOptions()
        return self._issue("all_to_all_single", input, lambda b: [b.alltoall_base(
            output, input, output_split_sizes, input_split_sizes, opts)])

    alltoall_base = all_to_all_single

    def gather(self, output_tensors: list[list[torch.Tensor]],  # type: ignore[override]
               input_tensors: list[torch.Tensor],
               opts: Optional[GatherOptions] = None) -> AbortableWork:
        opts = opts or GatherOptions()
        return self._issue("gather", input_tensors[0],
                           lambda b: [b.gather(output_tensors, input_tensors, opts)])

    def scatter(self, output_tensors: list[torch.Tensor],  # type: ignore[override]
                input_tensors: list[list[torch.Tensor]],
                opts: Optional[ScatterOptions] = None) -> AbortableWork:
        opts = opts or ScatterOptions()
        return self._issue("scatter", output_tensors[0],
                           lambda b: [b.scatter(output_tensors, input_tensors, opts)])

    def barrier(self,  # type: ignore[override]
                opts: Optional[BarrierOptions] = None) -> AbortableWork:
        opts = opts or BarrierOptions()
        device = getattr(opts, "device", None)
        probe = None
        if device is not None and torch.device(device).type == "cuda" and self._nccl is not None:
            probe = torch.empty(0, device=device)
        return self._issue("barrier", probe, lambda b: [b.barrier(opts)])

    # ------------------------------------------------------------------ point to point

    def send(self, tensors: list[torch.Tensor], dst_rank: int,  # type: ignore[override]
             tag: int = 0) -> AbortableWork:
        return self._issue("send", tensors[0], lambda b: [b.send(tensors, dst_rank, tag)],
                           point_to_point=True)

    def recv(self, tensors: list[torch.Tensor], src_rank: int,  # type: ignore[override]
             tag: int = 0) -> AbortableWork:
        return self._issue("recv", tensors[0], lambda b: [b.recv(tensors, src_rank, tag)],
                           point_to_point=True)

    def batch_p2p(self, ops: Sequence[dist.P2POp]) -> list[AbortableWork]:
        """``torch.distributed.batch_isend_irecv`` on this group (``ops``: ``P2POp`` objects of
        ``isend`` and ``irecv``): on NCCL one coalesced batch (``ncclGroupStart``/``End``), as
        c10d batches for its own groups, so two neighbours that both send first do not wait for
        each other whatever the size; on gloo one operation after the other, as c10d does
        there. One work covers the batch."""
        first = ops[0].tensor

        def issue(backend: Any) -> list[dist.Work]:
            if backend is not self._nccl:
                return [_p2p(backend, op) for op in ops]
            backend._start_coalescing(first.device)  # noqa: SLF001 - c10d's own batching
            for op in ops:
                _p2p(backend, op)
            return [backend._end_coalescing(first.device)]  # noqa: SLF001

        return [self._issue("batch_isend_irecv", first, issue, point_to_point=True)]

    def recv_anysource(self, tensors: list[torch.Tensor],  # type: ignore[override]
                       tag: int = 0) -> AbortableWork:
        return self._issue("recv_anysource", tensors[0],
                           lambda b: [b.recv_anysource(tensors, tag)], point_to_point=True)


def _failed(item: Any) -> bool:
    """Whether an observed backend work completed with an error."""
    return item.done() and item.error() is not None


def _p2p(backend: Any, op: dist.P2POp) -> dist.Work:
    """``op`` (an ``isend`` or ``irecv`` to its peer's rank in the group) on ``backend``."""
    if op.op in (dist.isend, dist.send):
        return backend.send([op.tensor], op.group_peer, op.tag)
    return backend.recv([op.tensor], op.group_peer, op.tag)


def _allreduce_options(opts: Any) -> AllreduceOptions:
    if opts is None:
        return AllreduceOptions()
    if isinstance(opts, AllreduceOptions):
        return opts
    single = AllreduceOptions()
    single.reduceOp = opts  # a ReduceOp, as in pg.allreduce(tensors, op)
    return single
