"""The job's hosts from Slurm's environment, for ``srun mover-launch ...`` inside an allocation.

Run by ``srun`` with one task per node, each ``mover-launch`` finds the job's hosts in Slurm's
variables when no host flag (``--hostfile``, ``--nnodes``, ``--node-rank``, ``--master-addr``,
``--standalone``) is given:

* the hosts: ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``, else ``SLURM_NODELIST``),
  a Slurm host list such as ``gpu[01-04,07],login1``, expanded in order; the first host runs
  the controller (the controller's address);
* the number of hosts, checked against the list: ``SLURM_STEP_NUM_NODES`` (else
  ``SLURM_JOB_NUM_NODES``, else ``SLURM_NNODES``);
* this host's node rank: the position of ``SLURMD_NODENAME`` in the list, else ``SLURM_NODEID``;
* the controller's port, unless ``--master-port`` gives it: derived from ``SLURM_JOB_ID``
  (:func:`port_of_job`), so that every host computes the same one and two jobs sharing a host
  differ;
* workers per host, unless ``--nproc-per-node`` gives it: ``SLURM_GPUS_ON_NODE``, else 1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping, Optional

from mover_plugin.errors import ConfigError

JOB_ID = "SLURM_JOB_ID"
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
NODE_COUNTS = ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
NODE_NAME = "SLURMD_NODENAME"
NODE_ID = "SLURM_NODEID"
GPUS_ON_NODE = "SLURM_GPUS_ON_NODE"

PORT_BASE, PORT_SPAN = 20000, 40000
"""Ports derived from a job id lie in [PORT_BASE, PORT_BASE + PORT_SPAN)."""

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


@dataclass(frozen=True)
class SlurmAllocation:
    """What ``mover-launch`` takes from Slurm's environment."""

    hosts: tuple[str, ...]
    node_rank: int
    job_id: int
    gpus_on_node: Optional[int]
    spare_hosts: Optional[int] = None
    """Not in Slurm's variables: ``--spare-hosts`` marks the last hosts spare."""
    listen_addr: Optional[str] = None
    """The controller's port listens on the first host's address."""
    source: str = "a Slurm job step (SLURM_JOB_ID is set)"

    @property
    def port(self) -> int:
        return port_of_job(self.job_id)

    @property
    def master_addr(self) -> str:
        """The first host, which runs the controller."""
        return self.hosts[0]


def port_of_job(job_id: int) -> int:
    """The controller's port of Slurm job ``job_id``."""
    return PORT_BASE + job_id % PORT_SPAN


def in_job_step(environ: Mapping[str, str]) -> bool:
    """Whether this process runs in a Slurm job step: a job id, a host list and this node's
    name or id are set."""
    return (JOB_ID in environ and _first(environ, NODELISTS) is not None
            and (NODE_ID in environ or NODE_NAME in environ))


def allocation_from_env(environ: Mapping[str, str]) -> Optional[SlurmAllocation]:
    """The allocation this process runs in; None outside a Slurm job step (no job id, host list
    or node id). Raises :class:`ConfigError` when Slurm's variables contradict each other."""
    if not in_job_step(environ):
        return None
    nodelist = _first(environ, NODELISTS) or ""
    hosts = tuple(expand_hostlist(nodelist))
    count = _first(environ, NODE_COUNTS)
    if count is not None and _whole(count, "node count") != len(hosts):
        raise ConfigError(f"Slurm's node count {count} does not match its host list "
                          f"{nodelist!r} ({len(hosts)} hosts)")
    gpus = environ.get(GPUS_ON_NODE)
    return SlurmAllocation(hosts, _node_rank(environ, hosts), _whole(environ[JOB_ID], JOB_ID),
                           _whole(gpus, GPUS_ON_NODE) if gpus else None)


def expand_hostlist(text: str) -> list[str]:
    """The hosts of a Slurm host list, in order: ``a[01-03,7],b`` → ``a01 a02 a03 a7 b``."""
    hosts: list[str] = []
    for item in _split_top_level(text.strip()):
        hosts += _expand_item(item, text)
    if not hosts:
        raise ConfigError(f"Slurm host list {text!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Splits at the commas outside brackets."""
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_item(item: str, text: str) -> list[str]:
    """One host pattern, with any number of bracketed ranges."""
    match = re.search(r"\[([^\[\]]*)\]", item)
    if match is None:
        if "[" in item or "]" in item:
            raise ConfigError(f"Slurm host list {text!r}: unbalanced brackets in {item!r}")
        return [item]
    prefix, suffix = item[:match.start()], item[match.end():]
    return [host for value in _expand_ranges(match.group(1), text)
            for host in _expand_item(prefix + value + suffix, text)]


def _expand_ranges(ranges: str, text: str) -> list[str]:
    """``01-03,7`` → ``01 02 03 7`` (a range keeps the zero padding of its first number)."""
    values = []
    for part in ranges.split(","):
        match = _RANGE.match(part.strip())
        if match is None:
            raise ConfigError(f"Slurm host list {text!r}: {part!r} is not N or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ConfigError(f"Slurm host list {text!r}: range {part!r} runs backwards")
        values += [str(number).zfill(len(first)) for number in range(int(first), int(last) + 1)]
    return values


def _node_rank(environ: Mapping[str, str], hosts: tuple[str, ...]) -> int:
    name = environ.get(NODE_NAME)
    if name in hosts:
        return hosts.index(name)
    if NODE_ID not in environ:
        raise ConfigError(f"this host {name!r} ({NODE_NAME}) is not in Slurm's host list "
                          f"{','.join(hosts)!r} and {NODE_ID} is not set")
    rank = _whole(environ[NODE_ID], NODE_ID)
    if rank >= len(hosts):
        raise ConfigError(f"{NODE_ID} {rank} does not exist; Slurm's host list has "
                          f"{len(hosts)} hosts")
    return rank


def _first(environ: Mapping[str, str], names: tuple[str, ...]) -> Optional[str]:
    return next((environ[name] for name in names if environ.get(name)), None)


def _whole(text: str, what: str) -> int:
    if not text.strip().isdigit():
        raise ConfigError(f"Slurm's {what} {text!r} is not a whole number")
    return int(text)
