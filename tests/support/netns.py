"""Test hosts in network namespaces: several hosts on one machine whose network a test can cut.

:func:`namespace_hosts` makes a bridge in this machine's namespace (the first host, which runs
the controller) and one network namespace per further host, joined to the bridge by a veth pair,
each with its own address on a private /24. A command runs on a host through
:meth:`Host.command` (``ip netns exec``), with ``GLOO_SOCKET_IFNAME`` naming the host's
interface so that gloo's sockets use it. :meth:`Host.cut` takes the host's link down: its
processes live on and hear nothing, like a host behind a failed switch. Everything is removed
at the end. Needs root (or CAP_NET_ADMIN) and iproute2: :func:`can_make_namespaces` says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional


@dataclass(frozen=True)
class Host:
    address: str
    interface: str
    """The host's interface: the bridge for the first host, its veth end for the others."""
    namespace: Optional[str] = None
    """None for the first host (this machine's own namespace)."""
    outer_interface: Optional[str] = None
    """The veth end on the bridge."""

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run on this host, gloo bound to its interface."""
        env = ["env", f"GLOO_SOCKET_IFNAME={self.interface}"]
        if self.namespace is None:
            return [*env, *argv]
        return ["ip", "netns", "exec", self.namespace, *env, *argv]

    def cut(self) -> None:
        """Takes the host off the network: its link to the bridge goes down."""
        assert self.outer_interface is not None, "the first host runs the controller"
        _ip("link", "set", self.outer_interface, "down")


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"mvprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    if made:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return made


@contextmanager
def namespace_hosts(count: int, subnet: int) -> Iterator[list[Host]]:
    """``count`` hosts on ``10.{subnet}.0.0/24``: the first in this namespace, the others in
    namespaces of their own; all removed at the end."""
    tag = f"{os.getpid() % 10000}"
    bridge = f"mvbr{tag}"
    made_namespaces: list[str] = []
    made_links: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made_links.append(bridge)
        _ip("addr", "add", f"10.{subnet}.0.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hosts = [Host(f"10.{subnet}.0.1", bridge)]
        for index in range(1, count):
            namespace, outer, inner = f"mvns{tag}h{index}", f"mvo{tag}h{index}", f"mvi{tag}h{index}"
            address = f"10.{subnet}.0.{index + 1}"
            _ip("netns", "add", namespace)
            made_namespaces.append(namespace)
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            made_links.append(outer)
            _ip("link", "set", inner, "netns", namespace)
            _ip("link", "set", outer, "master", bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
            _ip("-n", namespace, "link", "set", inner, "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            hosts.append(Host(address, inner, namespace, outer))
        yield hosts
    finally:
        for link in reversed(made_links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        for namespace in made_namespaces:
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")
