"""A ``ProcessGroup`` written in Python that keeps its own name and description.

c10d's base ``ProcessGroup`` keeps a group's name and description in its registered backends.
A group of this package is itself the group c10d names and registers, and its gloo backend may
carry other groups too, so it keeps both itself. The camelCase methods are the ones the C++
trampoline forwards, the others the Python bindings'.
"""

from __future__ import annotations

import torch.distributed as dist


class NamedProcessGroup(dist.ProcessGroup):
    """Base class: name, description and backend name of a Python-implemented group."""

    backend_name = ""
    """The c10d backend name the subclass is registered under."""

    def __init__(self, rank: int, size: int, group_name: str = "") -> None:
        super().__init__(rank, size)
        self._group_name = group_name
        self._group_desc = ""

    def getBackendName(self) -> str:  # noqa: N802
        return self.backend_name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return self._group_desc

    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc
