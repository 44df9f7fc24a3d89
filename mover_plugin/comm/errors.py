"""Errors of the abortable communication layer.

Both derive from :class:`mover_plugin.errors.MoverError`, so a training loop can tell "the
plugin abandoned this collective on purpose" apart from a backend failure (gloo's
``DistBackendError``, a connection reset, a timeout), which keeps its own type.
"""

from __future__ import annotations

from typing import Optional

from mover_plugin.errors import MoverError


class CommAborted(MoverError):
    """Communication on a process group was abandoned because the process-wide alarm was raised
    (or the group was aborted explicitly).

    ``reason`` is the text given to :func:`mover_plugin.comm.alarm.raise_alarm`; ``group`` names
    the process group (c10d's group name) when known.
    """

    def __init__(self, message: str, *, reason: Optional[str] = None,
                 group: Optional[str] = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.group = group


class CollectiveAborted(CommAborted):
    """A collective or point-to-point operation was left before it completed, or refused because
    its group belongs to a generation that was aborted.

    The operation may still be pending inside the backend: its output tensors are undefined and
    the group must not be used again.
    """
