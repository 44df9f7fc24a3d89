"""Ports the operating system reports free now, for jobs the tests start (never fixed ones)."""

from __future__ import annotations

import socket

from mover_plugin.launch.slurm import PORT_BASE, PORT_SPAN


def free_port(address: str = "127.0.0.1") -> int:
    """A port on ``address`` that the OS reports free now."""
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def free_job_id() -> int:
    """A Slurm job id whose derived port (:func:`mover_plugin.launch.slurm.port_of_job`) the OS
    reports free now."""
    while True:
        port = free_port()
        if PORT_BASE <= port < PORT_BASE + PORT_SPAN:
            return port - PORT_BASE
