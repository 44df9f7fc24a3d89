"""How a training process tells a lost peer from a bug, and how it leaves when its rank
lives on elsewhere."""

from __future__ import annotations

import atexit
import os
import sys

import torch.distributed as dist

from mover_plugin.comm import CollectiveAborted

_PEER_FAILURE_MARKERS = ("Connection closed by peer", "Connection reset by peer", "Timed out",
                         "timed out", "Broken pipe", "gloo", "Gloo")
"""Substrings of the errors gloo raises when a peer dies or a collective times out."""


def is_peer_failure(error: BaseException) -> bool:
    """True for errors that mean a peer is gone, as opposed to bugs in the training code."""
    if isinstance(error, (CollectiveAborted, dist.DistNetworkError, dist.DistBackendError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in
                                                   _PEER_FAILURE_MARKERS)


def exit_now(status: int = 0) -> None:
    """Ends a process whose rank lives on elsewhere (a leaver, or a joiner whose hand-over
    failed) or that cannot go on. ``atexit`` callbacks run and output is flushed, but the
    interpreter's teardown is skipped: for a training process it takes seconds of CPU that the
    ranks still training on this host can use better."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
