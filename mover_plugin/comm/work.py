"""Work handles whose ``wait()`` can be abandoned when the alarm is raised.

c10d returns one of these from every operation of a ``mover`` group, for asynchronous calls
(``async_op=True``, ``isend``/``irecv``, ``batch_isend_irecv``) and synchronous ones alike: the
Python functions of ``torch.distributed`` issue the operation and then call ``work.wait()``
themselves, so a synchronous ``dist.all_reduce(t)`` blocks here, in Python, where the alarm
can reach it.

How completion is observed depends on the backend's work:

- gloo collectives (its ``AsyncWork``: they have a future) are waited for by the waiting thread
  itself, in the work's own ``wait()`` with a timeout of 10 ms at a time (a timed-out
  ``wait()`` leaves the work pending and can be repeated); between slices the waiter checks
  its group, so it leaves within 10 ms of an alarm. The completion wakes the waiter inside
  gloo, with no Python callback and no thread hand-off (those cost about 0.2 ms per small
  collective here, several percent of a small model's step);
- gloo's send/recv and reduce-scatter works only complete inside their own ``wait()``, and a
  ``wait()`` that times out ends them, so a small pool of daemon threads calls that ``wait()``
  for them and wakes the waiter, which sleeps on the alarm's condition variable (woken by the
  completion, by the alarm, or by its group being aborted; it re-checks its group every 50 ms
  all the same); an abandoned one keeps its pool thread until the backend gives up (peer gone
  or the group timeout);
- NCCL works (CUDA) are not waited for: their ``wait()`` only orders the current stream after
  the collective, as NCCL's own does, and a stuck kernel is ended by aborting the communicator
  when the alarm is raised.

The pool of waiting threads and the main thread's waited seconds are the ``waits`` of the
process's :class:`~mover_plugin.comm.context.CommContext`.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional, Sequence

import torch
import torch.distributed as dist

from mover_plugin.comm import alarm
from mover_plugin.comm.context import WaitState, default_context

if TYPE_CHECKING:
    from mover_plugin.comm.process_group import MoverProcessGroup

_RECHECK_S = 0.05
"""How often a waiter re-checks its group even when nothing woke it."""
_SLICE_S = 0.01
"""How long a waiter blocks in a gloo collective's own ``wait()`` between checks of its group."""


def _waits() -> WaitState:
    return default_context().waits


def blocked_waits() -> int:
    """How many pool threads are blocked in a backend ``wait()`` now (at the end of training:
    the waits of operations abandoned with their group, which a peer may end at any moment)."""
    return _waits().pool.busy


def waited_s() -> float:
    """Seconds the main thread (the training loop) has spent blocked in waits for operations
    of mover groups: a step's duration minus what it waited is the rank's *busy time*."""
    return _waits().waited_s


class _Observed:
    """One backend work, observed through ``done()`` and finished by ``finish()``; this base
    asks the work itself whether it is done and knows no error of its own (a retired
    backend's cancelled connection)."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work

    def done(self) -> bool:
        return self.work.is_completed()

    def finish(self) -> None:
        """Called once ``done()``: returns, or raises the backend's error."""
        self.work.wait()

    def error(self) -> Optional[BaseException]:
        """The error the work completed with; ``None`` while it runs or if it succeeded."""
        return None

    def settled_error(self) -> Optional[BaseException]:
        """:meth:`error` as the bookkeeping of every operation reads it: without c10d's
        deprecated ``Work.exception()`` (it warns once per process)."""
        return self.error()

    def outputs(self) -> list[torch.Tensor]:
        """The operation's output tensors (once done)."""
        return self.work.result()

    def future_outputs(self) -> list[torch.Tensor]:
        """The value the backend's future completed with (empty where there is no future,
        as for gloo's point-to-point works)."""
        try:
            value = self.work.get_future().value()
        except RuntimeError:
            return []
        return value if isinstance(value, list) else [value]

    recheck_s = _RECHECK_S
    """How long :meth:`block` may wait before the waiter checks its group again."""

    def block(self, group: "MoverProcessGroup", seconds: float) -> None:
        """Waits up to ``seconds`` for the work's completion or the group's abort."""
        alarm.wait_until(lambda: self.done() or not group.usable, group.epoch, seconds)


class _StreamOrdered(_Observed):
    """An NCCL work. Its failure is its communicator's once NCCL's watchdog recorded one there
    (``get_error()``: a timeout, an asynchronous or a remote error): every work on it that
    completed then counts as failed, and the group is neither idle nor kept. The watchdog
    records it on its next pass (about 100 ms); until then only the work itself knows, so
    :meth:`error` (the decisions after an alarm) asks it too, through c10d's
    ``Work.exception()`` (deprecated: torch warns once per process), while the per-operation
    bookkeeping reads :meth:`settled_error`, the communicator's alone."""

    def __init__(self, work: dist.Work, communicator: Any) -> None:
        super().__init__(work)
        self._communicator = communicator

    def settled_error(self) -> Optional[BaseException]:
        if not self.done():
            return None
        return communicator_error(self._communicator)

    def error(self) -> Optional[BaseException]:
        if not self.done():
            return None
        return communicator_error(self._communicator) or self.work.exception()


def communicator_error(communicator: Any) -> Optional[BaseException]:
    """The error NCCL's watchdog recorded on ``communicator`` (torch >= 2.6 has
    ``get_error()``), if any."""
    get_error = getattr(communicator, "get_error", None)
    state = get_error() if get_error is not None else None
    if state is None or state.name == "SUCCESS":
        return None
    return dist.DistBackendError(f"NCCL communicator error: {state.name}")


class _Sliced(_Observed):
    """A backend work whose ``wait(timeout)`` may time out and be repeated (gloo's
    collectives): the waiting thread blocks in it, a slice at a time. Its future holds its
    outcome once it is done (gloo completes the future before the work)."""

    recheck_s = _SLICE_S

    def error(self) -> Optional[BaseException]:
        if not self.done():
            return None
        try:
            self.work.get_future().value()
        except Exception as error:  # the backend's own error, as the future holds it
            return error
        return None

    def block(self, group: "MoverProcessGroup", seconds: float) -> None:
        self.wait_slice(seconds)

    def wait_slice(self, seconds: float) -> bool:
        """Blocks in the work's ``wait()`` for at most ``seconds``; whether it completed.
        Raises the backend's error if the work failed."""
        try:
            # At least 1 ms: c10d reads a zero timeout as "no timeout".
            self.work.wait(timedelta(seconds=max(seconds, 0.001)))
        except Exception:
            if not self.work.is_completed():
                return False  # only this slice ran out
            # It completed as the slice ran out, or failed: returns, or raises its own error.
            self.work.wait()
        return True


class _Watched(_Observed):
    """A backend work whose completion is only visible to its own ``wait()``: a pool thread
    makes that call and records how it ended."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__(work)
        self._done = False
        self._error: Optional[BaseException] = None
        _waits().pool.submit(self._wait)

    def _wait(self) -> None:
        try:
            self.work.wait()
        except BaseException as error:  # handed to the thread that waits on this work
            self._error = error
        self._done = True
        alarm.wake_waiters()

    def done(self) -> bool:
        return self._done

    def finish(self) -> None:
        if self._error is not None:
            raise self._error

    def error(self) -> Optional[BaseException]:
        return self._error


class _Completed(_Observed):
    """An operation that needs no communication (an all-reduce in a group of one): complete
    from the start, its outputs are its inputs, there is no backend work."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__(None)  # type: ignore[arg-type]
        self._outputs = outputs

    def done(self) -> bool:
        return True

    def finish(self) -> None:
        return None

    def error(self) -> Optional[BaseException]:
        return None

    def outputs(self) -> list[torch.Tensor]:
        return self._outputs

    future_outputs = outputs


def completed(outputs: list[torch.Tensor]) -> _Observed:
    """The observer of an operation that completed without communicating."""
    return _Completed(outputs)


def asked(work: dist.Work) -> _Observed:
    """The observer that only asks ``work`` whether it is done."""
    return _Observed(work)


def observe(work: dist.Work, *, communicator: Any = None,
            point_to_point: bool = False) -> _Observed:
    """Wraps a backend work in the observer that suits it (see the module docstring):
    ``communicator`` is the NCCL backend that issued it, ``None`` for gloo."""
    if communicator is not None:
        return _StreamOrdered(work, communicator)
    if point_to_point:
        return _Watched(work)
    try:
        work.get_future()
    except RuntimeError:  # gloo's SendWork/RecvWork and reduce-scatter: no future
        return _Watched(work)
    return _Sliced(work)


class AbortableWork(dist.Work):
    """The work of one operation on a :class:`MoverProcessGroup` (possibly several backend
    works, e.g. for coalesced operations issued one by one).

    ``wait()`` returns ``True`` once every backend work completed; raises
    :class:`~mover_plugin.comm.errors.CollectiveAborted` when the group is aborted first; and
    re-raises the backend's own error (a gloo connection reset, its timeout) when the backend
    work failed, after which the group refuses further operations.
    """

    def __init__(self, group: "MoverProcessGroup", pending: Sequence[_Observed], op: str,
                 *, stream_ordered: bool) -> None:
        super().__init__()
        self._group = group
        self._pending = list(pending)
        self._op = op
        self._stream_ordered = stream_ordered
        self._succeeded = False
        self._exception: Optional[BaseException] = None
        self._future: Optional[torch.futures.Future] = None
        self._future_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"AbortableWork({self._op} on group {self._group.group_name!r})"

    @property
    def op(self) -> str:
        """The name of the operation, e.g. ``"allreduce"``."""
        return self._op

    def is_completed(self) -> bool:
        """Whether every backend work has completed (successfully or not)."""
        return self._exception is not None or all(p.done() for p in self._pending)

    def is_success(self) -> bool:
        """Whether the operation completed without error."""
        return self._exception is None and all(
            p.done() and p.error() is None for p in self._pending)

    def exception(self) -> Optional[BaseException]:
        """The error that ended the operation, if any."""
        if self._exception is not None:
            return self._exception
        for item in self._pending:
            error = item.error()
            if error is not None:
                return error
        return None

    def source_rank(self) -> int:
        """For a receive from any source: the group rank it came from."""
        return self._pending[0].work._source_rank()

    def _source_rank(self) -> int:
        """What ``dist.recv(src=None)`` asks (c10d's own name for :meth:`source_rank`)."""
        return self.source_rank()

    def result(self) -> list[torch.Tensor]:
        """The output tensors of the backend works, in order."""
        return [tensor for item in self._pending for tensor in item.outputs()]

    def _cuda_devices(self) -> list[torch.device]:
        """The CUDA devices of the operation's tensors (none for gloo's operations)."""
        if not self._stream_ordered:
            return []
        devices = {tensor.device for tensor in self.result() if tensor.is_cuda}
        return sorted(devices, key=lambda device: device.index or 0)

    def _values(self) -> list[torch.Tensor]:
        """The backend futures' values (their output tensors), for :meth:`get_future`."""
        return [tensor for item in self._pending for tensor in item.future_outputs()]

    def synchronize(self) -> None:
        self.wait()

    def block_current_stream(self) -> None:
        self.wait()

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Waits for the operation; see the class docstring for what it raises.

        ``timeout`` (``None`` or zero: no limit beyond the backend's own) bounds this wait only;
        when it passes, ``TimeoutError`` is raised and the operation stays pending.
        """
        if self._exception is not None:
            raise self._exception
        if self._succeeded:
            return True
        deadline = None
        if timeout is not None and timeout.total_seconds() > 0:
            deadline = time.monotonic() + timeout.total_seconds()
        try:
            if self._stream_ordered:
                self._group.check_usable(self._op)
                for item in self._pending:
                    item.finish()
            else:
                self._wait_for_completion(deadline)
        except TimeoutError:
            raise  # only this wait gave up: the operation may still be waited for
        except BaseException as error:
            self._exception = error
            self._group.note_failure(error)
            raise
        self._succeeded = True
        return True

    def _wait_for_completion(self, deadline: Optional[float]) -> None:
        if threading.current_thread() is not threading.main_thread():
            self._block_until_complete(deadline)
            return
        waits = _waits()
        started = time.perf_counter()
        try:
            self._block_until_complete(deadline)
        finally:
            waits.waited_s += time.perf_counter() - started

    def _block_until_complete(self, deadline: Optional[float]) -> None:
        group = self._group
        for item in self._pending:
            while not item.done():
                group.check_usable(self._op)
                sleep = item.recheck_s
                if deadline is not None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(f"{self._op} on group {group.group_name!r} "
                                           "did not complete within the wait timeout")
                    sleep = min(sleep, remaining)
                item.block(group, sleep)
            item.finish()

    def get_future(self) -> torch.futures.Future:
        """A future completed with :meth:`result` when the operation completes, or with the
        error when it fails or is aborted. A pool thread waits for it. For an operation on
        CUDA tensors the future is on their devices, as c10d's NCCL futures are: a consumer
        (``wait``, ``value``, a ``then`` callback) is ordered after the operation on its own
        current stream."""
        with self._future_lock:
            if self._future is not None:
                return self._future
            future: torch.futures.Future = torch.futures.Future(devices=self._cuda_devices())
            self._future = future

        def complete() -> None:
            try:
                self.wait()
            except BaseException as error:
                self._settle(future, error=error)
            else:
                self._settle(future, value=self._values())

        _waits().pool.submit(complete)
        return future

    def _settle(self, future: torch.futures.Future, *, value: Any = None,
                error: Optional[BaseException] = None) -> None:
        with self._future_lock:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
