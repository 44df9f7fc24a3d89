"""The collectives a script makes between two iterations, recorded and replayed for a joiner.

A script's own code between the engine's calls may run collectives whose results it then
uses in the next iteration: the Transformers Trainer gathers every rank's count of tokens
before an iteration's first forward and divides its loss by the sum. A joiner's script runs
that code too while it catches up, but its collectives act locally there (the running ranks
made them long ago), so its count would be its own, and its first real iteration would train
on another loss than the lost rank's.

:class:`BetweenCalls` closes that gap. On a running rank it records, from the end of an
iteration (or from ``deepspeed.initialize``) to the start of the next, the results of the
collectives the script's thread makes (those of ``SCRIPT_COLLECTIVES`` in
:mod:`mover_plugin.patches.deepspeed_hooks`, on the default group: their results are the same
on every rank; copied to host memory), and keeps those that preceded the iteration that is
open. Collectives inside an engine call the script makes there (a checkpoint save, an
evaluation) are not the script's and are not recorded (:meth:`BetweenCalls.paused`): a
joiner's script skips those calls while it catches up. A joiner receives the record with its
state and, once its script has caught up to that open iteration, answers the script's
collectives from it in order, until its first forward. Where that cannot be exact (a
collective on another group, another order or count than recorded, or a joiner that came in
the job's first iteration, whose script made them while it was still being built), the
joiner's ``caught_up`` event says why, and so does the run summary (``inexact``).
"""

from __future__ import annotations

import contextlib
import copy
import enum
import inspect
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mover_plugin.patches.local_collectives import LOCAL_COLLECTIVES, completed, no_op

_OUTPUT = {"all_reduce": "tensor", "broadcast": "tensor", "all_gather": "tensor_list",
           "all_gather_into_tensor": "output_tensor", "all_gather_object": "object_list",
           "broadcast_object_list": "object_list", "barrier": None}
"""The argument each collective writes its result into (None: it has none)."""


class Mode(enum.Enum):
    PASS = "pass"
    """Inside an iteration, or not training: collectives run as they are."""
    RECORD = "record"
    """Between two iterations on a running rank."""
    REPLAY = "replay"
    """A joiner between its last catch-up iteration and its first real one."""


@dataclass(frozen=True)
class Recorded:
    """One collective's result: ``name``, and what it wrote (tensors on the CPU, or objects);
    ``world``: whether it ran on the default group (else it cannot be replayed)."""

    name: str
    result: list[Any]
    world: bool


class BetweenCalls:
    """Records or replays the script's collectives between iterations (module docstring)."""

    def __init__(self) -> None:
        self.mode = Mode.PASS
        self._window: list[Recorded] = []
        self._before_open: list[Recorded] = []
        self._replay: list[Recorded] = []
        self._thread = threading.get_ident()
        self.inexact: Optional[str] = None
        """Why a joiner's replay was not exact (None: it was, or none ran)."""
        self.replayed = 0
        """How many of the script's collectives a joiner's replay answered."""

    # -- a running rank -------------------------------------------------------------------

    def iteration_ended(self) -> None:
        """From here to the next :meth:`iteration_begins`, the script's collectives are
        recorded."""
        self._window = []
        self._thread = threading.get_ident()
        self.mode = Mode.RECORD

    def iteration_begins(self) -> None:
        """The recorded collectives become those that preceded the open iteration."""
        if self.mode is Mode.RECORD:
            self._before_open, self._window = self._window, []
        self.mode = Mode.PASS

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Collectives inside an engine call the script makes between iterations (a checkpoint
        save, an evaluation) are the engine's, not the script's: a joiner's script skips those
        calls while it catches up."""
        mode, self.mode = self.mode, Mode.PASS
        try:
            yield
        finally:
            self.mode = mode

    def before_open_iteration(self) -> list[Recorded]:
        """What a joiner of the open iteration receives."""
        return list(self._before_open)

    # -- a joiner -------------------------------------------------------------------------

    def replay(self, recorded: list[Recorded]) -> None:
        """The joiner's script reached the open iteration's window: its collectives are
        answered from ``recorded`` until :meth:`end_replay`."""
        self._replay = list(recorded)
        self._thread = threading.get_ident()
        self.mode = Mode.REPLAY

    def end_replay(self) -> Optional[str]:
        """The joiner's first real iteration begins; returns why the replay was inexact."""
        if self.mode is Mode.REPLAY and self._replay and self.inexact is None:
            names = ", ".join(entry.name for entry in self._replay)
            self.inexact = (f"the script made fewer collectives between iterations than the "
                            f"lost rank's did (not made: {names})")
        self.mode, self._replay = Mode.PASS, []
        return self.inexact

    def missed(self, recorded: list[Recorded]) -> Optional[str]:
        """Why a joiner that made its script's collectives while it was built (it came in
        the job's first iteration) may train inexactly; None if the lost rank made none."""
        if not recorded:
            return None
        self.inexact = (f"the script's {len(recorded)} collective(s) before the joiner's first "
                        "iteration ran while it was built, locally")
        return self.inexact

    # -- the hook -------------------------------------------------------------------------

    def around(self, name: str, collective: Callable[..., Any], *args: Any,
               **kwargs: Any) -> Any:
        """A call of ``torch.distributed.<name>``: run, recorded, or answered (the mode)."""
        if self.mode is Mode.PASS or threading.get_ident() != self._thread:
            return collective(*args, **kwargs)
        bound = inspect.signature(collective).bind(*args, **kwargs)
        if self.mode is Mode.RECORD:
            return self._record(name, collective, bound)
        return self._answer(name, bound)

    def _record(self, name: str, collective: Callable[..., Any],
                bound: inspect.BoundArguments) -> Any:
        work = collective(*bound.args, **bound.kwargs)
        if work is not None and bound.arguments.get("async_op", False):
            work.wait()  # the result is recorded now
        self._window.append(Recorded(name, _copied(_output(name, bound)), _on_world(bound)))
        return work

    def _answer(self, name: str, bound: inspect.BoundArguments) -> Any:
        entry = self._replay.pop(0) if self._replay else None
        if entry is None or entry.name != name or not entry.world:
            self._note_inexact(name, entry)
            return LOCAL_COLLECTIVES.get(name, no_op)(*bound.args, **bound.kwargs)
        _write(name, bound, entry.result)
        self.replayed += 1
        return completed(bound.arguments.get("async_op", False))

    def _note_inexact(self, name: str, entry: Optional[Recorded]) -> None:
        if self.inexact is not None:
            return
        if entry is None:
            self.inexact = (f"the script made a {name} between iterations that the lost rank's "
                            "did not")
        elif entry.name != name:
            self.inexact = (f"the script made a {name} between iterations where the lost rank's "
                            f"made a {entry.name}")
        else:
            self.inexact = f"the script's {name} between iterations was on a group of its own"


def _output(name: str, bound: inspect.BoundArguments) -> list[Any]:
    argument = _OUTPUT[name]
    if argument is None:
        return []
    value = bound.arguments[argument]
    return list(value) if isinstance(value, list) else [value]


def _on_world(bound: inspect.BoundArguments) -> bool:
    group = bound.arguments.get("group")
    return group is None or group is dist.GroupMember.WORLD


def _copied(values: list[Any]) -> list[Any]:
    return [value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor)
            else copy.deepcopy(value) for value in values]


def _write(name: str, bound: inspect.BoundArguments, result: list[Any]) -> None:
    """Writes a recorded result where the call writes its own: tensors in place, objects
    into the list the call was given."""
    argument = _OUTPUT[name]
    if argument is None:
        return
    target = bound.arguments[argument]
    if isinstance(target, torch.Tensor):
        target.copy_(result[0])
        return
    for index, value in enumerate(result):
        if isinstance(target[index], torch.Tensor):
            target[index].copy_(value)
        else:
            target[index] = value
