"""The job's hosts, from the launcher's flags: a hostfile, ``--nnodes``/``--nproc-per-node``, or
a scheduler's environment (Slurm's variables, :mod:`~mover_plugin.launch.slurm`; a Kubernetes
JobSet pod's, :mod:`~mover_plugin.launch.kubernetes`); spare hosts; which hosts this command
runs agents for; the store's port.

Every check raises :class:`~mover_plugin.errors.ConfigError` before any process starts.

``python -m mover_plugin.launch.hosts`` prints, from the scheduler's environment, this host's
node rank and name in the job, the controller's address and port and the first host's name
(which runs the controller), one line: ``NODE_RANK HOST MASTER_ADDR MASTER_PORT FIRST_HOST``.
That is what a script needs to run ``mover migrate --host`` for a host of the job
(``examples/migrate_host.sh``).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence, Union

from mover_plugin.devices import (
    HostGpus,
    check_host_fits,
    driver_gpu_count,
    gpus_on_host,
    visible_ids,
)
from mover_plugin.errors import ConfigError
from mover_plugin.launch.deepspeed_line import LOCAL_HOST, select_slots
from mover_plugin.launch.hostfile import HostEntry, is_local_host, parse_hostfile
from mover_plugin.launch import kubernetes, slurm
from mover_plugin.launch.kubernetes import KubernetesAllocation
from mover_plugin.launch.slurm import SlurmAllocation

DEFAULT_MASTER_PORT = 29500
DEFAULT_MASTER_ADDR = "127.0.0.1"

Allocation = Union[SlurmAllocation, KubernetesAllocation]
"""The hosts a scheduler's environment gives: ``hosts``, this host's ``node_rank``, the
controller's ``master_addr`` and ``port`` (None: the default), ``gpus_on_node``,
``spare_hosts`` (None: ``--spare-hosts``), ``listen_addr`` (None: the job's address) and its
``source``."""


@dataclass(frozen=True)
class NodeSpec:
    """One host of the job: its node rank, name, worker count and first global rank; a spare
    host has no worker and ``spare_slots`` standbys."""

    node_rank: int
    host: str
    nproc: int
    first_rank: int
    spare_slots: int = 0
    devices: tuple[int, ...] = ()
    """The host's GPUs its processes use, as indices among those the host sees (the slots a
    deepspeed-style ``--include``/``--exclude`` names); empty: all of them."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))  # a list, read from JSON

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)

    @property
    def spare(self) -> bool:
        return self.spare_slots > 0

    @property
    def local_world_size(self) -> int:
        """Processes of the job this host runs at most at once (its slots)."""
        return self.spare_slots or self.nproc


def local_gpus(args: argparse.Namespace, environ: Mapping[str, str],
                local: list[NodeSpec], standbys: int) -> HostGpus:
    """This host's GPUs, once every local host's workers and standbys are known to fit (on a
    host whose processes use some of its GPUs only, in those)."""
    gpus = gpus_on_host(args.gpus_per_node, environ, driver_gpu_count)
    for node in local:
        named = list(node.devices) if gpus.count else []
        ids = visible_ids(environ)
        seen = gpus.count if ids is None else len(ids)
        if named and max(named) >= min(gpus.count, seen):
            raise ConfigError(f"host {node.host}: slot {max(named)} names no GPU; it has "
                              f"{min(gpus.count, seen)} ({gpus.source})")
        check_host_fits(node.host, node.nproc, node.spare_slots if node.spare else standbys,
                        HostGpus(len(named), f"the slots named for it: {named}") if named
                        else gpus)
    return gpus


def nodes_of(args: argparse.Namespace, host_gpus: Callable[[], int]) -> tuple[NodeSpec, ...]:
    """The hosts from ``--hostfile``, or ``--nnodes`` copies of one host of ``--nproc-per-node``
    slots (the last ``--spare-hosts`` of them spare); with the deepspeed launcher's
    ``--num_nodes``/``--num_gpus``/``--include``/``--exclude``, those of them
    (``host_gpus``: this host's GPU count, the slots of a line without a hostfile)."""
    if _deepspeed_selection(args):
        return _from_entries(_with_spares(_selected_entries(args, host_gpus), args))
    if args.hostfile is not None:
        if args.nproc_per_node is not None or args.nnodes is not None:
            raise ConfigError(
                "--hostfile gives the hosts and their slots; do not combine it with "
                "--nproc-per-node or --nnodes"
            )
        return _from_entries(_with_spares(parse_hostfile(args.hostfile), args))
    nnodes = 1 if args.standalone else (args.nnodes or 1)
    if args.standalone and args.nnodes not in (None, 1):
        raise ConfigError(f"--standalone runs on one machine; --nnodes {args.nnodes} conflicts")
    nproc = _nproc_per_node(args) or 1
    host = args.master_addr or DEFAULT_MASTER_ADDR
    return _from_entries(_with_spares([HostEntry(host, nproc)] * nnodes, args))


def _nproc_per_node(args: argparse.Namespace) -> Optional[int]:
    """``--nproc-per-node`` or the deepspeed launcher's ``--num_gpus``, which means the same
    without a hostfile."""
    if args.nproc_per_node is not None and args.num_gpus is not None:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node} and --num_gpus "
                          f"{args.num_gpus} say the same thing: give one of them")
    return args.nproc_per_node if args.num_gpus is None else args.num_gpus


def _deepspeed_selection(args: argparse.Namespace) -> bool:
    """Whether the deepspeed launcher's flags select hosts or slots (``--num_gpus`` alone
    without a hostfile is ``--nproc-per-node``)."""
    return (any(getattr(args, name) is not None for name in ("num_nodes", "include", "exclude"))
            or (args.num_gpus is not None and args.hostfile is not None))


def _selected_entries(args: argparse.Namespace,
                      host_gpus: Callable[[], int]) -> list[HostEntry]:
    """The hosts and slots a deepspeed-style line selects (:mod:`deepspeed_line`)."""
    for flag, value in (("--nproc-per-node", args.nproc_per_node), ("--nnodes", args.nnodes),
                        ("--standalone", args.standalone or None)):
        if value is not None:
            raise ConfigError(f"{flag} does not go with the deepspeed launcher's --num_gpus, "
                              "--num_nodes, --include or --exclude: give the hosts one way")
    if args.hostfile is not None:
        entries = parse_hostfile(args.hostfile)
        pool: dict[str, Optional[int]] = {e.host: e.slots for e in entries}
        if len(pool) < len(entries):
            raise ConfigError(f"hostfile {args.hostfile!r} names a host twice; the deepspeed "
                              "launcher's --include/--exclude need each host once")
    else:
        entries, pool = [], {LOCAL_HOST: host_gpus() or None}
    chosen = select_slots(pool, args)
    spares = {e.host for e in entries if e.spare}
    exact = bool(args.include or args.exclude)
    host = args.master_addr or DEFAULT_MASTER_ADDR
    return [HostEntry(host if name == LOCAL_HOST and args.hostfile is None else name,
                      len(slots), name in spares, tuple(slots) if exact else ())
            for name, slots in chosen.items()]


HOST_FLAGS = ("hostfile", "nnodes", "node_rank", "master_addr", "standalone", "num_nodes",
              "include", "exclude")
"""The flags that say where the job's hosts are; without any, a scheduler's environment may."""


def environment_allocation(args: argparse.Namespace,
                           environ: Mapping[str, str]) -> Optional[Allocation]:
    """The scheduler's allocation, where no flag names the hosts and a scheduler's variables
    are set."""
    if any(getattr(args, name) not in (None, False) for name in HOST_FLAGS):
        return None
    return allocation_of(environ)


def allocation_of(environ: Mapping[str, str]) -> Optional[Allocation]:
    """The allocation this process runs in: a Slurm job step's or a JobSet pod's; None
    outside both. Raises :class:`ConfigError` when the two are both present."""
    if slurm.in_job_step(environ) and kubernetes.in_jobset_pod(environ):
        raise ConfigError(
            f"this process runs both in a Slurm job step (SLURM_JOB_ID "
            f"{environ.get(slurm.JOB_ID)}) and in a Kubernetes JobSet pod (JOBSET_NAME "
            f"{environ.get(kubernetes.JOBSET_NAME)}): the hosts would come from both; unset "
            "one's variables or name the hosts with flags (--hostfile, or --nnodes, --node-rank "
            "and --master-addr)")
    return slurm.allocation_from_env(environ) or kubernetes.allocation_from_env(environ)


def nodes_of_allocation(args: argparse.Namespace,
                        allocation: Allocation) -> tuple[NodeSpec, ...]:
    """The hosts of a scheduler's allocation, each with ``--nproc-per-node`` slots or its
    GPUs, the last of them spare as the allocation or ``--spare-hosts`` says."""
    nproc = _nproc_per_node(args) or allocation.gpus_on_node or 1
    entries = [HostEntry(host, nproc) for host in allocation.hosts]
    return _from_entries(_with_spares(entries, args, _spare_count(args, allocation)))


def _spare_count(args: argparse.Namespace, allocation: Allocation) -> int:
    """``--spare-hosts``, or the allocation's spare hosts; the two must agree when both say."""
    given = allocation.spare_hosts
    if given is None or args.spare_hosts in (0, given):
        return args.spare_hosts if given is None else given
    raise ConfigError(f"--spare-hosts {args.spare_hosts} contradicts {allocation.source}, "
                      f"which has {given} spare host(s): drop the flag or give {given}")


def _with_spares(entries: Sequence[HostEntry], args: argparse.Namespace,
                 count: Optional[int] = None) -> list[HostEntry]:
    """``entries`` with the last ``count`` (by default ``--spare-hosts``) of them marked spare;
    checks that some host still runs workers and that spares come with the resilient policy."""
    count = args.spare_hosts if count is None else count
    if count >= len(entries) and count > 0:
        raise ConfigError(f"--spare-hosts {count}: the job has {len(entries)} host(s); at least "
                          "one must run workers")
    marked = [HostEntry(e.host, e.slots, e.spare or i >= len(entries) - count, e.devices)
              for i, e in enumerate(entries)] if count else list(entries)
    spares = [e for e in marked if e.spare]
    if len(spares) == len(marked):
        raise ConfigError("every host of the job is a spare host; at least one must run workers")
    if spares and args.policy != "resilient":
        raise ConfigError(f"spare host {spares[0].host!r} needs --policy resilient (a spare host "
                          "runs standbys, which only the resilient policy uses)")
    return marked


def _from_entries(entries: Sequence[HostEntry]) -> tuple[NodeSpec, ...]:
    nodes, first = [], 0
    for node_rank, entry in enumerate(entries):
        if entry.spare:
            nodes.append(NodeSpec(node_rank, entry.host, 0, first, spare_slots=entry.slots,
                                  devices=entry.devices))
            continue
        nodes.append(NodeSpec(node_rank, entry.host, entry.slots, first, devices=entry.devices))
        first += entry.slots
    return tuple(nodes)


def local_nodes(
    args: argparse.Namespace, nodes: tuple[NodeSpec, ...]
) -> tuple[tuple[int, ...], bool]:
    """The node ranks this command runs agents for, and whether it runs the controller."""
    if args.node_rank is not None and args.node_rank >= len(nodes):
        raise ConfigError(
            f"--node-rank {args.node_rank} does not exist; the job has nodes 0..{len(nodes) - 1}"
        )
    if args.hostfile is None:
        node_rank = args.node_rank or 0
        return (node_rank,), node_rank == 0
    if args.node_rank is not None:
        # A host named by its rank runs its own agent only (node 0 also the controller).
        return (args.node_rank,), args.node_rank == 0
    local = tuple(n.node_rank for n in nodes if n.node_rank == 0 or is_local_host(n.host))
    return local, True


def store_port(
    args: argparse.Namespace, nodes: tuple[NodeSpec, ...], local: tuple[int, ...]
) -> int:
    """The store's port: ``--master-port``, else 0 (any free one) with ``--standalone``, else
    the default."""
    port = 0 if args.standalone and args.master_port is None else args.master_port
    port = DEFAULT_MASTER_PORT if port is None else port
    if port == 0 and len(local) != len(nodes):
        raise ConfigError(
            "--master-port 0 (any free port) needs every host's agent started by this command; "
            "give the port the other hosts should connect to"
        )
    return port


def main(environ: Optional[Mapping[str, str]] = None) -> int:
    """Prints ``NODE_RANK HOST MASTER_ADDR MASTER_PORT FIRST_HOST`` of this host in the
    scheduler's allocation; exits 2 with one line saying why where there is none."""
    environ = os.environ if environ is None else environ
    try:
        allocation = allocation_of(environ)
        if allocation is None:
            raise ConfigError("neither a Slurm job step nor a Kubernetes JobSet pod: no "
                              "SLURM_JOB_ID with a host list, no JOBSET_NAME")
    except ConfigError as error:
        print(f"mover_plugin.launch.hosts: error: {error}", file=sys.stderr)
        return 2
    port = DEFAULT_MASTER_PORT if allocation.port is None else allocation.port
    print(allocation.node_rank, allocation.hosts[allocation.node_rank], allocation.master_addr,
          port, allocation.hosts[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
