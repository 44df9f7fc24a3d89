"""Forked children of a training process drop the TCP connections they inherit.

A data loader's worker processes are forked from the training process (PyTorch's
``DataLoader`` with ``num_workers > 0`` on Linux; DeepSpeed's own loader starts two per rank),
and a forked child holds a copy of every descriptor its parent had open, gloo's connections
among them. When the parent later closes a connection (a generation switch drops the groups
that held a lost peer), the child's copy keeps the socket's open file description alive, and
with it the socket's registration in gloo's event loop, which then reports events for a pair
it already closed: gloo throws ``pair.cc:676 state_ <= CONNECTED`` in its own thread and the
training process aborts. A worker never uses those connections, so :func:`install` makes every
child forked from then on close its inherited TCP sockets at once (``os.register_at_fork``);
closing a copy in the child leaves the parent's connection as it is. Only TCP sockets are
closed, and not the standard streams. A dataset that opens a connection before the fork and
uses it from its workers (unsafe in any case: the processes would share one stream) loses it
in the workers; it should open its connections in each worker.
"""

from __future__ import annotations

import logging
import os
import socket
import stat

logger = logging.getLogger(__name__)

_FD_FOLDER = "/proc/self/fd"
_TCP_FAMILIES = (socket.AF_INET, socket.AF_INET6)
_installed = False


def install() -> None:
    """Makes children forked from now on close their inherited TCP sockets (idempotent; only
    where ``/proc`` lists a process's descriptors)."""
    global _installed
    if _installed or not os.path.isdir(_FD_FOLDER):
        return
    os.register_at_fork(after_in_child=close_inherited_tcp_sockets)
    _installed = True


def close_inherited_tcp_sockets() -> int:
    """Closes this process's TCP socket descriptors above the standard streams; returns how
    many it closed."""
    closed = 0
    for name in os.listdir(_FD_FOLDER):
        descriptor = int(name)
        if descriptor > 2 and _is_tcp_socket(descriptor):
            try:
                os.close(descriptor)
                closed += 1
            except OSError:
                pass
    return closed


def _is_tcp_socket(descriptor: int) -> bool:
    try:
        if not stat.S_ISSOCK(os.fstat(descriptor).st_mode):
            return False
        probe = socket.socket(fileno=descriptor)
    except OSError:
        return False
    try:
        return probe.family in _TCP_FAMILIES and probe.type == socket.SOCK_STREAM
    finally:
        probe.detach()
