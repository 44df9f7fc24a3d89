"""An agent's inbox: the controller's commands, waited for by a thread of their own.

The controller posts every command to the ``commands`` mailbox (:mod:`mover_plugin.mailbox`),
and it is that mailbox's one writer. A daemon thread of the agent reads the next command on a
store connection of its own (the store answers the read as soon as the command is written),
queues it and wakes the agent's loop through a pipe the loop's selector watches. So an agent
costs the store one call per command and nothing between commands, whatever the job's size, and
a command reaches the agent at once instead of at its next poll. The agent obeys the commands on
its own thread, in order.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
from typing import Any, Callable, Optional, Union

import torch.distributed as dist

from mover_plugin.contract import COMMANDS_MAILBOX
from mover_plugin.mailbox import Mailbox

logger = logging.getLogger(__name__)

WAIT_S = 3600.0
"""How long one read of the next command waits before the thread reads again (torch logs a
read that times out)."""


class CommandInbox:
    """The commands posted after :meth:`start`, for the agent's loop to :meth:`take`."""

    def __init__(self, connect: Callable[[float], dist.Store]) -> None:
        """``connect(timeout_s)``: a new connection to the controller's store, for the inbox
        alone, whose calls wait up to ``timeout_s``."""
        self._connect = connect
        self._queue: queue.SimpleQueue[Union[dict[str, Any], BaseException]] = (
            queue.SimpleQueue())
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._error: Optional[BaseException] = None
        """What ended the wait, raised once the commands before it are taken."""

    @property
    def fileno(self) -> int:
        """Readable when commands are waiting (for the agent's selector)."""
        return self._wake_read

    def start(self) -> None:
        """Connects and starts waiting; every command posted from now on arrives (the ones
        before are not this agent's: a host that comes back joins a running job)."""
        mailbox = Mailbox(self._connect(WAIT_S), COMMANDS_MAILBOX)
        mailbox.skip_to_end()
        threading.Thread(target=self._receive, args=(mailbox,), name="mover-agent-inbox",
                         daemon=True).start()

    def take(self) -> list[dict[str, Any]]:
        """The commands received since the last call, in order. Once none is left, raises the
        error that ended the wait (the controller's store is gone)."""
        try:
            while os.read(self._wake_read, 4096):
                pass
        except BlockingIOError:
            pass
        commands: list[dict[str, Any]] = []
        while self._error is None:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, BaseException):
                self._error = item
            else:
                commands.append(item)
        if not commands and self._error is not None:
            raise self._error
        return commands

    def _receive(self, mailbox: Mailbox) -> None:
        try:
            while True:
                try:
                    self._queue.put(mailbox.next())
                except dist.DistStoreError as error:
                    if "timeout" in str(error).lower():
                        continue  # an hour without a command: wait again
                    raise
                self._wake()
        except Exception as error:  # noqa: BLE001 - whatever ends the wait reaches the agent
            logger.warning("the wait for the controller's commands ended (%s)", error)
            self._queue.put(error if isinstance(error, (RuntimeError, ConnectionError))
                            else RuntimeError(f"the command inbox failed: {error!r}"))
            self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_write, b"x")
        except BlockingIOError:
            pass  # the loop has a wake-up pending already
