"""Abortable communication: a c10d backend whose collectives can be left on an alarm.

Survivors of a rank failure must leave a collective that waits for the dead (or hung) peer
within milliseconds, not at the backend timeout, and then build the next generation of groups
in the same process. This package provides:

- :mod:`~mover_plugin.comm.alarm` — the process-wide alarm (``raise_alarm``, ``clear_alarm``,
  ``is_raised``) that aborts every group created before it;
- :mod:`~mover_plugin.comm.backend` — ``register_backend()``, after which
  ``init_process_group("mover", ...)`` and every ``new_group`` without a backend build
  :class:`MoverProcessGroup` (gloo on CPU, NCCL on CUDA, behind one class);
- :mod:`~mover_plugin.comm.connections` — the gloo and NCCL backends a group is made of;
- :mod:`~mover_plugin.comm.work` — the work handles whose ``wait()`` can be abandoned;
- :mod:`~mover_plugin.comm.live` — the groups not shut down yet, whose NCCL communicators the
  alarm aborts all at once;
- :mod:`~mover_plugin.comm.retired` — keeps abandoned communicators alive until their pending
  operations end, so that destroying a generation never blocks;
- :mod:`~mover_plugin.comm.world` — the default group carried by the job's other groups (a
  *cover*), so that it never has to be rebuilt;
- :mod:`~mover_plugin.comm.delta` — the next generation's groups, rebuilt only where they hold
  a replaced rank (delta communicators) and registered with c10d in the old ones' place;
- :mod:`~mover_plugin.comm.sandbox` — the ``mover_sandbox`` backend, groups that talk to no
  one, in which a standby warms up;
- :mod:`~mover_plugin.comm.nccl_env` — the NCCL environment ``register_backend()`` sets, so
  that NCCL's watchdog ends no survivor of a peer's loss;
- :mod:`~mover_plugin.comm.context` — the package's process-wide state (the alarm, the waiter
  pool, the retired backends, the live groups, the sandbox's counters) in one object.

The alarm is raised in a worker by its ``mover_plugin.runtime.notices.NoticeWatcher`` when the
controller's alarm notice for the worker's generation arrives (relayed by the host's agent).

Typical use in a rank::

    register_backend()
    dist.init_process_group("mover", store=PrefixStore("gen0", store), rank=r, world_size=n)
    NoticeWatcher.from_env(0, raise_alarm, on_switch)   # a thread reading the notice pipe
    try:
        train_step()
    except CollectiveAborted:
        dist.destroy_process_group()          # instant, even with an op still pending
        clear_alarm()
        dist.init_process_group("mover", store=PrefixStore("gen1", store), ...)
"""

from mover_plugin.comm.alarm import clear_alarm, is_raised, raise_alarm
from mover_plugin.comm.backend import is_registered, register_backend
from mover_plugin.comm.errors import CollectiveAborted, CommAborted
from mover_plugin.comm.process_group import BACKEND_NAME, MoverProcessGroup
from mover_plugin.comm.work import AbortableWork

__all__ = [
    "BACKEND_NAME",
    "AbortableWork",
    "CollectiveAborted",
    "CommAborted",
    "MoverProcessGroup",
    "clear_alarm",
    "is_raised",
    "raise_alarm",
    "is_registered",
    "register_backend",
]
