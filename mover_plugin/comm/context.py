"""The process-wide state of the comm package, held in one object.

Some things exist once per process and every group, work and backend of the package shares
them: the alarm, the threads that wait in backend ``wait()`` calls, the backends retired with
operations still pending, the live ``mover`` groups the alarm must reach, the lock around
registering backends with c10d, the sandbox's operation counters, and the check that cancels
the construction of groups no longer wanted. :class:`CommContext`
holds them, one small state object per concept, and :func:`default_context` returns the
process's instance. The public functions of :mod:`~mover_plugin.comm.alarm`,
:mod:`~mover_plugin.comm.work`, :mod:`~mover_plugin.comm.retired`,
:mod:`~mover_plugin.comm.process_group`, :mod:`~mover_plugin.comm.backend`,
:mod:`~mover_plugin.comm.sandbox` and :mod:`~mover_plugin.comm.cancel` act on that instance, and
those modules document what the state means and how its locks are used. The state objects here
only hold the data and the locks that guard it (the waiter pool also runs its threads).

The default instance is never replaced or reset: a retired backend must stay referenced until
its operations end (or until process exit), and a group compares its alarm epoch with the
current one for as long as it lives.
"""

from __future__ import annotations

import collections
import queue
import threading
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

if TYPE_CHECKING:
    from mover_plugin.comm.process_group import MoverProcessGroup
    from mover_plugin.comm.retired import RetiredGroup


def _new_condition() -> threading.Condition:
    return threading.Condition(threading.Lock())


@dataclass(eq=False)
class AlarmState:
    """The alarm of :mod:`~mover_plugin.comm.alarm`: every field changes under ``cond``,
    which is also the condition variable that abortable waits sleep on."""

    cond: threading.Condition = field(default_factory=_new_condition)
    epoch: int = 0
    raised: bool = False
    reason: Optional[str] = None
    raised_at: Optional[float] = None
    listeners: list[Callable[[str], None]] = field(default_factory=list)
    reasons: dict[int, str] = field(default_factory=dict)
    """Epoch -> reason; alarms are rare, so this stays small."""


class WaiterPool:
    """Daemon threads that block in backend ``wait()`` calls on behalf of abortable waits.

    A thread is reused once its wait returns; a new one is started whenever none is idle, so
    a wait that never returns costs one parked thread, never a blocked caller.
    """

    def __init__(self) -> None:
        self._jobs: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0

    def submit(self, job: Callable[[], None]) -> None:
        """Runs ``job`` in an idle pool thread, or in a new one if none is idle."""
        with self._lock:
            if self._idle > 0:
                self._idle -= 1
            else:
                self._threads += 1
                threading.Thread(target=self._run, name=f"mover-wait-{self._threads}",
                                 daemon=True).start()
        self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            job()
            with self._lock:
                self._idle += 1

    @property
    def threads(self) -> int:
        """Threads started so far (idle or busy)."""
        return self._threads

    @property
    def busy(self) -> int:
        """Threads blocked in a backend ``wait()`` (or about to be): an operation abandoned
        when its group was shut down keeps its thread until the backend gives up."""
        with self._lock:
            return self._threads - self._idle


@dataclass(eq=False)
class WaitState:
    """The waits of :mod:`~mover_plugin.comm.work`."""

    pool: WaiterPool = field(default_factory=WaiterPool)
    waited_s: float = 0.0
    """Seconds the main thread has spent blocked waiting for operations of mover groups
    (only the main thread writes it)."""


@dataclass(eq=False)
class RetiredState:
    """The retired backends of :mod:`~mover_plugin.comm.retired`, guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    groups: list[RetiredGroup] = field(default_factory=list)
    exit_hook_installed: bool = False


@dataclass(eq=False)
class LiveGroups:
    """The ``mover`` groups not shut down yet (held weakly), which the alarm listener of
    :mod:`~mover_plugin.comm.process_group` reaches, and whether that listener is added
    (``listener_added`` is guarded by ``listener_lock``)."""

    groups: weakref.WeakSet[MoverProcessGroup] = field(default_factory=weakref.WeakSet)
    listener_lock: threading.Lock = field(default_factory=threading.Lock)
    listener_added: bool = False


@dataclass(eq=False)
class CancelState:
    """The cancel check of :mod:`~mover_plugin.comm.cancel` installed now, if any."""

    check: Optional[Callable[[], Optional[str]]] = None


@dataclass(eq=False)
class SandboxCounters:
    """How many operations of each kind the sandbox groups answered, guarded by ``lock``."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    served: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(eq=False)
class CommContext:
    """All process-wide state of the comm package; see the module docstring."""

    alarm: AlarmState = field(default_factory=AlarmState)
    waits: WaitState = field(default_factory=WaitState)
    retired: RetiredState = field(default_factory=RetiredState)
    live: LiveGroups = field(default_factory=LiveGroups)
    registration_lock: threading.Lock = field(default_factory=threading.Lock)
    """Makes checking for and registering a c10d backend plugin one step
    (:func:`mover_plugin.comm.backend.register_plugin`)."""
    sandbox: SandboxCounters = field(default_factory=SandboxCounters)
    cancel: CancelState = field(default_factory=CancelState)


_DEFAULT = CommContext()


def default_context() -> CommContext:
    """The process's context, which the package's public functions act on."""
    return _DEFAULT
