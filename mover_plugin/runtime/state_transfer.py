"""A rank's state, from a live process to the one that takes its place.

:class:`StateTransfer` sends a joiner its state (the adapter's tensors, its blob, the RNG
snapshot and the iteration) over the two-process hand-over group of
:mod:`mover_plugin.runtime.handover`, and loads what a joiner receives.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch

from mover_plugin.runtime.adapter import FrameworkAdapter, Transfer
from mover_plugin.runtime.control import ControlClient
from mover_plugin.runtime.handover import open_handover, receive_state, send_state
from mover_plugin.runtime.ledger import StepLedger


class StateTransfer:
    """Sends and receives a rank's state for the process that runs it."""

    def __init__(self, control: ControlClient, adapter: FrameworkAdapter, ledger: StepLedger,
                 timeout: Callable[[], timedelta]) -> None:
        self._control = control
        self._adapter = adapter
        self._ledger = ledger
        self._timeout = timeout

    def outgoing(self) -> tuple[list[torch.Tensor], dict[str, Any]]:
        """What a leaver hands its joiner at the end of the iteration it just completed."""
        return self._adapter.state_tensors(Transfer.HANDOVER_SENT), self._blob(self._ledger.applied)

    def send(self, generation: int, joiner: int, iteration: int) -> None:
        """Sends rank ``joiner`` of ``generation`` this rank's copy of its state, as it is
        after ``iteration`` completed iterations."""
        group = open_handover(self._control.store, generation, joiner, source=True,
                              timeout=self._timeout())
        send_state(group, self._adapter.state_tensors(Transfer.COPY_SENT), self._blob(iteration))
        group.shutdown()

    def receive(self, generation: int, rank: int, transfer: Transfer) -> None:
        """Receives rank ``rank``'s state in ``generation`` and loads it; the ledger then
        counts the iterations it was taken after."""
        group = open_handover(self._control.store, generation, rank, source=False,
                              timeout=self._timeout())
        state = receive_state(group, self._adapter.state_tensors(transfer))
        group.shutdown()
        self._adapter.load_state(state, transfer)
        self._adapter.restore_snapshot(state["snapshot"])
        self._ledger.applied = state["iteration"]

    def _blob(self, iteration: int) -> dict[str, Any]:
        return {**self._adapter.state_blob(), "snapshot": self._adapter.capture_snapshot(),
                "iteration": iteration}
