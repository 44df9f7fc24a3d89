"""A copy of each rank's optimizer shard, kept in host memory by a data-parallel peer.

With a sharded optimizer (Megatron-Core's distributed optimizer, ZeRO) a rank's optimizer
shard exists nowhere else: when the rank is lost, its joiner can continue in place only if a
live peer holds a current copy. The ranks of each data-parallel group form a ring; after every
step each rank packs its shard into a host buffer and sends it to the next rank of the ring,
which keeps it (:class:`PeerCopy`). The exchange travels over two-process groups of its own
(rendezvous under ``gen{g}/peercopy/{src}-{dst}/`` of the control store), outside the job's
groups and not aborted by the alarm: a failure elsewhere does not cut it short, and the death
of the other end ends it with an error. It runs in the communication backend's own threads;
:meth:`PeerCopy.settle` waits for it (the caller decides when: right away, before the next step
begins, or at the latest at the next exchange or in the recovery after a crash).

A small *side record* may travel with the shard in the same buffer: the DeepSpeed adapter sends
the rank's random-number streams as they were after the step
(:mod:`mover_plugin.runtime.random_streams`), so that its joiner draws what it would have drawn.

On a GPU the shard is copied into page-locked host buffers on a stream of its own, and the copy
is sent from there: no GPU memory is spent on it. The host memory is two shards per rank (the
packed own shard and the copy of the previous rank's), :attr:`PeerCopy.nbytes`; each buffer is
page-locked at exactly its size (:mod:`mover_plugin.host_memory`; torch's pinned memory would
round it up to a power of two). What the copy
adds to the training thread's time (packing, opening the ring's groups, waiting for an exchange
to end) is summed in :attr:`PeerCopy.critical_s`.

:func:`decide_continuation` is the rule the adapters apply after a crash, from every rank's
record: continue in place when every lost rank's current shard is held by a live rank, or
else every rank rolls back to the last checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch.distributed import PrefixStore, Store

from mover_plugin.comm.process_group import MoverProcessGroup
from mover_plugin.contract import peer_copy_prefix
from mover_plugin.errors import StateTransferError
from mover_plugin.host_memory import PageLockedBuffer
from mover_plugin.runtime.ledger import StepLedger

logger = logging.getLogger(__name__)

_SOURCE, _DESTINATION = 0, 1


def shard_record(ledger: StepLedger, copy: Optional["PeerCopy"]) -> dict[str, Any]:
    """This rank's record for :func:`decide_continuation`. A rank caught past the commit with
    its update not counted (:attr:`StepLedger.update_pending`) may have begun the update; a
    rank still waiting in the commit changed nothing."""
    return {"applied": ledger.applied, "updating": ledger.update_pending,
            "held_of": copy.held_of if copy else -1,
            "held_version": copy.held_version if copy else -1}


def decide_continuation(records: list[Optional[dict[str, Any]]], peer_copy: bool, *,
                        off: str = "the peer copy is off"
                        ) -> tuple[int, Optional[str], dict[int, int]]:
    """From every rank's record after a crash (None for the lost ranks, whose joiners have
    none): the iteration to continue from, why every rank must roll back to the checkpoint
    (None if not), and for each lost rank the live rank holding its current shard.

    A record holds ``applied`` (iterations completed), ``updating`` (the rank was caught
    between passing the commit and completing the update), ``held_of`` and ``held_version``
    (whose shard copy the rank holds, of which iteration; -1 for none). ``off`` says, in the
    user's terms, that the peer copy was turned off."""
    known = [r for r in records if r is not None]
    lost = [rank for rank, record in enumerate(records) if record is None]
    target = max(r["applied"] for r in known)
    holders = {r["held_of"]: rank for rank, r in enumerate(records)
               if r is not None and r["held_version"] == target}
    if any(r["updating"] for r in known):
        return target, "a rank was lost while the optimizer update was being applied", {}
    if any(r["applied"] != target for r in known):
        return target, "the ranks had completed different numbers of iterations", {}
    missing = [rank for rank in lost if rank not in holders]
    if missing:
        why = ("no live rank holds a current copy of the optimizer shard of rank(s) "
               f"{missing}" + ("" if peer_copy else f" ({off})"))
        return target, why, {}
    return target, None, {rank: holders[rank] for rank in lost}


def ring_neighbours(ring: Sequence[int], rank: int) -> tuple[int, int]:
    """The next and the previous rank of ``rank`` in ``ring`` (global ranks in ring order):
    where ``rank`` sends its shard, and whose copy it keeps."""
    index = ring.index(rank)
    return ring[(index + 1) % len(ring)], ring[(index - 1) % len(ring)]


def shard_dtype(shard: Sequence[torch.Tensor]) -> torch.dtype:
    """The one dtype of a shard's tensors (the copy packs them into one buffer)."""
    dtypes = {tensor.dtype for tensor in shard}
    if len(dtypes) != 1:
        raise TypeError(f"the optimizer shard mixes dtypes {sorted(map(str, dtypes))}; the "
                        "peer copy packs it into one buffer of one dtype")
    return dtypes.pop()


class PeerCopy:
    """This rank's side of the ring: sends its shard to the next rank, keeps the previous
    rank's (see the module docstring)."""

    def __init__(self, store: Store, rank: int, timeout: timedelta) -> None:
        self._store = store
        self._rank = rank
        self._timeout = timeout
        self.held_of = -1
        """The global rank whose shard the copy is."""
        self.held_version = -1
        """The number of completed iterations the copy belongs to (-1: none, or in flight)."""
        self._held_buffer: Optional[PageLockedBuffer] = None
        """The copy of the previous rank's shard."""
        self._outgoing_buffer: Optional[PageLockedBuffer] = None
        """This rank's own shard, packed to be sent."""
        self._sizes = ((0, 0), (0, 0))
        """(elements of the shard, bytes of the side record): this rank's, the previous
        rank's."""
        self._links: Optional[tuple[int, int, int, MoverProcessGroup, MoverProcessGroup]] = None
        """(generation, next, previous, the group sending to next, the one receiving)."""
        self._in_flight: Optional[_Exchange] = None
        self._copied: Optional[Any] = None
        """On a GPU: the event after which the own shard is in its host buffer."""
        self.critical_s = 0.0
        """Seconds the calls of the training thread spent in the copy (refresh, settle,
        before_update): what the copy adds to the steps."""
        self.exchanges = 0
        """Exchanges started."""

    @property
    def nbytes(self) -> int:
        """Host memory spent on the copy and on packing the own shard."""
        return sum(buffer.nbytes for buffer in self._buffers())

    def held(self) -> list[torch.Tensor]:
        """The copy, as sent to the joiner of the rank it belongs to: the shard (one flat
        tensor), then its side record (bytes) if it came with one."""
        held = self._held
        assert held is not None, "no copy is held"
        numel, side = self._sizes[1]
        return [held[:numel], *([_side_bytes(held, numel, side)] if side else [])]

    def refresh(self, shard: Sequence[torch.Tensor], version: int, generation: int,
                ring: tuple[int, int], side: Optional[torch.Tensor] = None) -> None:
        """Starts the exchange of ``shard`` (and the byte tensor ``side``, the same size at
        every step) at ``version`` completed iterations with the ring's ``(next, previous)``
        ranks; returns without waiting for it."""
        self.settle()
        following, previous = ring
        if following == self._rank:
            return  # no data-parallel peer
        with self._timed():
            self._connect(generation, following, previous, shard,
                          0 if side is None else side.numel())
            assert self._links is not None and self._outgoing is not None
            self._pack(shard, side)
            self.held_version = -1
            self._in_flight = _Exchange(self, version, previous)
            self.exchanges += 1

    def before_update(self) -> None:
        """Called before the optimizer changes the shard: on a GPU, the next update waits
        until the shard has been copied out."""
        if self._copied is not None:
            with self._timed():
                torch.cuda.current_stream().wait_event(self._copied)
            self._copied = None

    def settle(self) -> None:
        """Waits for the exchange in flight: on success the copy is current, and if a peer of
        the exchange was lost the copy is marked missing (and its groups are dropped)."""
        exchange, self._in_flight = self._in_flight, None
        if exchange is None:
            return
        with self._timed():
            error = exchange.wait()
        if error is None:
            self.held_of, self.held_version = exchange.previous, exchange.version
            return
        logger.warning("rank %d: the shard copy exchange of iteration %d failed (%s)",
                       self._rank, exchange.version, str(error)[:120])
        self.held_of, self.held_version = -1, -1
        self.close()

    def forget(self) -> None:
        """The copy no longer matches its rank's state (after a rollback)."""
        self.settle()
        self.held_of, self.held_version = -1, -1

    def report_and_close(self, post: Callable[..., Any], rank: int) -> None:
        """The training's end: waits for the last exchange, reports the copy's host memory and
        the training thread's time in it with ``post`` (the controller client's: a
        ``peer_copy`` event of ``rank``) and drops the exchange groups."""
        self.settle()
        post("peer_copy", rank=rank, bytes=self.nbytes, critical_s=self.critical_s,
             exchanges=self.exchanges, time=time.time())
        self.close()
        for buffer in self._buffers():
            buffer.release()

    def close(self) -> None:
        """Drops the exchange groups (never blocks on a peer)."""
        if self._links is not None:
            for group in self._links[3:]:
                group.shutdown()
            self._links = None

    # -- internals ------------------------------------------------------------------------

    @property
    def _held(self) -> Optional[torch.Tensor]:
        return None if self._held_buffer is None else self._held_buffer.tensor

    @property
    def _outgoing(self) -> Optional[torch.Tensor]:
        return None if self._outgoing_buffer is None else self._outgoing_buffer.tensor

    def _buffers(self) -> list[PageLockedBuffer]:
        return [buffer for buffer in (self._held_buffer, self._outgoing_buffer)
                if buffer is not None]

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.critical_s += time.perf_counter() - start

    def _connect(self, generation: int, following: int, previous: int,
                 shard: Sequence[torch.Tensor], side: int) -> None:
        """Opens the groups of this generation's ring (blocks until both neighbours open
        theirs) and learns the size of the previous rank's shard and side record; within a
        generation, learns it again when this rank's shard changed size."""
        mine = (sum(tensor.numel() for tensor in shard), side)
        if self._links is not None and self._links[:3] == (generation, following, previous):
            if mine != self._sizes[0]:
                self._exchange_sizes(mine, shard_dtype(shard))
            return
        self.close()
        # Every rank opens its two groups in one global order (by source, then destination),
        # so that no two neighbours wait for each other in opposite orders.
        edges = sorted([(self._rank, following, _SOURCE), (previous, self._rank, _DESTINATION)])
        opened = {role: self._pair(generation, source, destination, role)
                  for source, destination, role in edges}
        self._links = (generation, following, previous, opened[_SOURCE], opened[_DESTINATION])
        self._exchange_sizes(mine, shard_dtype(shard))

    def _exchange_sizes(self, mine: tuple[int, int], dtype: torch.dtype) -> None:
        """Sends this rank's (shard elements, side bytes) to the next rank and receives the
        previous rank's, then sizes the buffers. A shard changes size when its optimizer
        creates its state, at the first update it applies (later than the first step where
        fp16's loss scaler skips updates); every rank of a data-parallel group applies the
        same updates, so its neighbours exchange sizes again at the same step."""
        assert self._links is not None
        sending, receiving = self._links[3], self._links[4]
        received = torch.zeros(2, dtype=torch.int64)
        works = [sending.broadcast([torch.tensor(mine, dtype=torch.int64)], _SOURCE),
                 receiving.broadcast([received], _SOURCE)]
        for work in works:
            work.wait()
        theirs = (int(received[0]), int(received[1]))
        self._sizes = (mine, theirs)
        numel, held_numel = _buffer_numel(*mine, dtype), _buffer_numel(*theirs, dtype)
        if self._outgoing is None or self._outgoing.numel() != numel:
            self._outgoing_buffer = _replaced(self._outgoing_buffer, numel, dtype)
        if self._held is None or self._held.numel() != held_numel:
            self._held_buffer = _replaced(self._held_buffer, held_numel, dtype)
            self.held_of, self.held_version = -1, -1

    def _pair(self, generation: int, source: int, destination: int,
              role: int) -> MoverProcessGroup:
        store = PrefixStore(peer_copy_prefix(generation, source, destination), self._store)
        return MoverProcessGroup(store, role, 2, self._timeout,
                                 group_name=f"peer-copy-g{generation}-{source}-{destination}",
                                 use_cuda=False, abortable=False)

    def _pack(self, shard: Sequence[torch.Tensor], side: Optional[torch.Tensor]) -> None:
        outgoing = self._outgoing
        assert outgoing is not None
        numel, side_bytes = self._sizes[0]
        now = sum(tensor.numel() for tensor in shard)
        if now != numel:
            raise StateTransferError(f"rank {self._rank}: the optimizer shard has {now} "
                                     f"elements, the copy's buffer {numel}")
        if side is not None:
            _side_bytes(outgoing, numel, side_bytes).copy_(side)
        outgoing = outgoing[:numel]
        if shard and shard[0].is_cuda:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad():
                offset = 0
                for tensor in shard:
                    size = tensor.numel()
                    outgoing[offset:offset + size].copy_(tensor.reshape(-1),
                                                         non_blocking=True)
                    offset += size
                self._copied = torch.cuda.Event()
                self._copied.record(stream)
            return
        with torch.no_grad():
            torch.cat([tensor.reshape(-1) for tensor in shard], out=outgoing)


def _buffer_numel(numel: int, side_bytes: int, dtype: torch.dtype) -> int:
    """Elements of a buffer of ``dtype`` that holds a shard of ``numel`` and, after it, a side
    record of ``side_bytes``."""
    itemsize = torch.empty(0, dtype=dtype).element_size()
    return numel + -(-side_bytes // itemsize)


def _side_bytes(buffer: torch.Tensor, numel: int, side_bytes: int) -> torch.Tensor:
    """The side record's bytes in ``buffer``, after its shard of ``numel`` elements."""
    return buffer[numel:].view(torch.uint8)[:side_bytes]


def _replaced(old: Optional[PageLockedBuffer], numel: int,
              dtype: torch.dtype) -> PageLockedBuffer:
    """A new page-locked buffer in place of ``old``, which is unlocked (no exchange is in
    flight: the caller settled it)."""
    if old is not None:
        old.release()
    return PageLockedBuffer(numel, dtype)


class _Exchange:
    """One exchange in flight: the own shard to the next rank, the previous rank's into the
    held buffer. On a GPU a thread waits for the copy out of GPU memory before sending."""

    def __init__(self, copy: PeerCopy, version: int, previous: int) -> None:
        assert copy._links is not None
        self.version, self.previous = version, previous
        self._sending, self._receiving = copy._links[3], copy._links[4]
        self._outgoing, self._held, copied = copy._outgoing, copy._held, copy._copied
        self._works: list[Any] = []
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if copied is None:
            self._start()
        else:
            self._thread = threading.Thread(target=self._start_after, args=(copied,),
                                            name="peer-copy", daemon=True)
            self._thread.start()

    def _start_after(self, copied: Any) -> None:
        copied.synchronize()
        self._start()

    def _start(self) -> None:
        try:
            self._works = [self._receiving.broadcast([self._held], _SOURCE),
                           self._sending.broadcast([self._outgoing], _SOURCE)]
        except Exception as error:  # noqa: BLE001 - reported by wait()
            self._error = error

    def wait(self) -> Optional[BaseException]:
        """Blocks until both directions ended; the error if one failed."""
        if self._thread is not None:
            self._thread.join()
        for work in self._works:
            try:
                work.wait()
            except Exception as error:  # noqa: BLE001 - a lost peer ends it with an error
                self._error = self._error or error
        return self._error
