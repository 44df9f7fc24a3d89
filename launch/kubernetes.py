"""The job's hosts from a Kubernetes JobSet pod's environment, for ``mover-launch`` in every pod.

A JobSet (``jobset.x-k8s.io``) runs the job as replicated jobs, each one Indexed Job whose pods
are the hosts: the worker hosts, and optionally a pool of spare hosts
(``examples/kubernetes/jobset.yaml``). Each pod runs ``mover-launch`` with no host flag
(``--hostfile``, ``--nnodes``, ``--node-rank``, ``--master-addr``, ``--standalone``) and finds
the job's hosts in its environment:

* ``JOBSET_NAME``, ``REPLICATED_JOB_NAME`` and ``JOB_INDEX``: the pod's labels
  ``jobset.sigs.k8s.io/jobset-name``, ``jobset.sigs.k8s.io/replicatedjob-name`` and
  ``jobset.sigs.k8s.io/job-index``, which the manifest hands to the container with the
  downward API; ``JOB_INDEX`` must be 0 (one Job per replicated job, ``replicas: 1``);
  ``JOBSET_NAME`` set is what makes a pod a JobSet's;
* ``JOB_COMPLETION_INDEX``: the pod's index in its Indexed Job, set by Kubernetes;
* ``MOVER_WORKERS``: the worker hosts' replicated job and their number, ``NAME:HOSTS`` (e.g.
  ``workers:4``); ``MOVER_SPARES``, likewise, the spare hosts' (e.g. ``spares:1``; none when
  unset), which come last in the host list as ``--spare-hosts`` would make them;
* ``MOVER_SUBDOMAIN``: the JobSet's network subdomain (default: ``JOBSET_NAME``, JobSet's own
  default). The hosts are the pods' DNS names
  ``<jobset>-<replicated job>-<job index>-<pod index>.<subdomain>``, workers first;
* ``MOVER_MASTER_ADDR``: the controller's address, the headless Service that selects the first
  worker pod (default: that pod's DNS name); ``MOVER_MASTER_PORT``: its port (default: the
  launcher's, 29500).

This pod's node rank is its index among the workers, or the number of workers plus its index
among the spare hosts. The first worker pod runs the controller; its port listens on every
interface of the pod (only holders of the job's secret get through), since its own DNS name
may not resolve yet when it starts. Variables that contradict each other stop the launch with
one :class:`~mover_plugin.errors.ConfigError` naming the bad value and what is valid.

``python -m mover_plugin.launch.hosts`` prints what a pod's hook needs of this: its host name,
node rank and the controller's address and port.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from mover_plugin.errors import ConfigError

JOBSET_NAME = "JOBSET_NAME"
REPLICATED_JOB = "REPLICATED_JOB_NAME"
JOB_INDEX = "JOB_INDEX"
COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
WORKERS = "MOVER_WORKERS"
SPARES = "MOVER_SPARES"
SUBDOMAIN = "MOVER_SUBDOMAIN"
MASTER_ADDR = "MOVER_MASTER_ADDR"
MASTER_PORT = "MOVER_MASTER_PORT"

ANY_INTERFACE = "0.0.0.0"
"""Where the controller's port listens in its pod."""


@dataclass(frozen=True)
class KubernetesAllocation:
    """What ``mover-launch`` takes from a JobSet pod's environment."""

    hosts: tuple[str, ...]
    """Every host's DNS name, in node-rank order: the workers, then the spare hosts."""
    node_rank: int
    spare_hosts: int
    master_addr: str
    port: Optional[int]
    """``MOVER_MASTER_PORT``; None: the launcher's default."""
    gpus_on_node: Optional[int] = None
    """Not in the environment: ``--nproc-per-node`` gives the workers per host."""
    listen_addr: str = ANY_INTERFACE
    source: str = "a Kubernetes JobSet pod (JOBSET_NAME is set)"


@dataclass(frozen=True)
class _HostGroup:
    """One replicated job's hosts: ``NAME:HOSTS``."""

    variable: str
    name: str
    hosts: int


def in_jobset_pod(environ: Mapping[str, str]) -> bool:
    """Whether this process runs in a JobSet's pod (``JOBSET_NAME`` set)."""
    return bool(environ.get(JOBSET_NAME, "").strip())


def allocation_from_env(environ: Mapping[str, str]) -> Optional[KubernetesAllocation]:
    """The JobSet pod this process runs in; None outside one. Raises :class:`ConfigError` when
    the pod's variables are missing or contradict each other."""
    if not in_jobset_pod(environ):
        return None
    jobset = environ[JOBSET_NAME].strip()
    groups = _host_groups(environ)
    subdomain = environ.get(SUBDOMAIN, "").strip() or jobset
    hosts = tuple(f"{jobset}-{group.name}-0-{index}.{subdomain}"
                  for group in groups for index in range(group.hosts))
    return KubernetesAllocation(
        hosts=hosts, node_rank=_node_rank(environ, groups),
        spare_hosts=sum(group.hosts for group in groups[1:]),
        master_addr=environ.get(MASTER_ADDR, "").strip() or hosts[0],
        port=_port(environ))


def _host_groups(environ: Mapping[str, str]) -> list[_HostGroup]:
    """The workers' replicated job, then the spare hosts' one if any."""
    if not environ.get(WORKERS, "").strip():
        raise ConfigError(f"this pod is a JobSet's ({JOBSET_NAME}={environ[JOBSET_NAME]}) but "
                          f"{WORKERS} is not set: set it to the worker hosts' replicated job "
                          "and their number, e.g. workers:4")
    groups = [_host_group(environ, WORKERS)]
    if environ.get(SPARES, "").strip():
        spares = _host_group(environ, SPARES)
        if spares.name == groups[0].name:
            raise ConfigError(f"{SPARES} {environ[SPARES]!r} names the workers' replicated job "
                              f"({WORKERS} {environ[WORKERS]!r}); spare hosts need one of "
                              "their own")
        groups.append(spares)
    return groups


def _host_group(environ: Mapping[str, str], variable: str) -> _HostGroup:
    text = environ[variable].strip()
    name, _, count = text.rpartition(":")
    if not name or not count.strip().isdigit() or int(count) < 1:
        raise ConfigError(f"{variable} {text!r} is not REPLICATED_JOB:HOSTS with at least one "
                          "host (e.g. workers:4)")
    return _HostGroup(variable, name.strip(), int(count))


def _node_rank(environ: Mapping[str, str], groups: list[_HostGroup]) -> int:
    """This pod's position in the host list."""
    name = _required(environ, REPLICATED_JOB, "jobset.sigs.k8s.io/replicatedjob-name")
    matching = [group for group in groups if group.name == name]
    if not matching:
        valid = " or ".join(f"{g.name!r} ({g.variable})" for g in groups)
        raise ConfigError(f"this pod's replicated job {name!r} ({REPLICATED_JOB}) is not one "
                          f"of the job's hosts: {valid}")
    job_index = _whole(_required(environ, JOB_INDEX, "jobset.sigs.k8s.io/job-index"),
                       JOB_INDEX)
    if job_index != 0:
        raise ConfigError(f"{JOB_INDEX} {job_index}: mover-launch takes one Job per replicated "
                          "job (replicas: 1), whose pods are the hosts; valid: 0")
    group = matching[0]
    index = _whole(_required(environ, COMPLETION_INDEX, None), COMPLETION_INDEX)
    if index >= group.hosts:
        raise ConfigError(f"{COMPLETION_INDEX} {index} does not exist: replicated job "
                          f"{group.name!r} has {group.hosts} host(s) ({group.variable} "
                          f"{environ[group.variable]!r}), indexes 0..{group.hosts - 1}")
    return sum(g.hosts for g in groups[:groups.index(group)]) + index


def _required(environ: Mapping[str, str], name: str, label: Optional[str]) -> str:
    value = environ.get(name, "").strip()
    if not value:
        source = (f"the pod's label {label} through the downward API" if label else
                  "Kubernetes for the pods of an Indexed Job (completionMode: Indexed)")
        raise ConfigError(f"this pod is a JobSet's but {name} is not set: it comes from "
                          f"{source}")
    return value


def _port(environ: Mapping[str, str]) -> Optional[int]:
    text = environ.get(MASTER_PORT, "").strip()
    if not text:
        return None
    port = _whole(text, MASTER_PORT)
    if not 0 < port <= 65535:
        raise ConfigError(f"{MASTER_PORT} {port} is not a port: valid 1..65535")
    return port


def _whole(text: str, name: str) -> int:
    if not text.isdigit():
        raise ConfigError(f"{name} {text!r} is not a whole number")
    return int(text)
