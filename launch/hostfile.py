"""Hostfiles in the DeepSpeed/MPI form: one ``host slots=N`` line per host.

Blank lines and ``#`` comments are ignored. The order of the lines is the node order: the
first host is node 0 and holds global ranks ``0 .. slots-1``. A line ending with ``spare``
(``host slots=N spare``) names a spare host: it runs N standbys and no worker, and holds no
rank until a standby of its own is promoted.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from pathlib import Path

from mover_plugin.errors import ConfigError

_LINE = re.compile(r"^(?P<host>\S+)(?:\s+slots\s*=\s*(?P<slots>\S+))?(?P<spare>\s+spare)?\s*$")
_LOCAL_NAMES = {"localhost", "ip6-localhost", "::1"}


@dataclass(frozen=True)
class HostEntry:
    host: str
    slots: int
    spare: bool = False
    devices: tuple[int, ...] = ()
    """The GPUs its processes use, when a line names them (:class:`hosts.NodeSpec`)."""


def parse_hostfile(path: str | Path) -> list[HostEntry]:
    """Reads a hostfile; raises :class:`ConfigError` naming the file and line on bad input."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"hostfile {str(path)!r} does not exist (expected lines 'host slots=N')")
    entries = [
        _parse_line(path, number, line)
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if line.split("#", 1)[0].strip()
    ]
    if not entries:
        raise ConfigError(f"hostfile {str(path)!r} lists no host (expected lines 'host slots=N')")
    return entries


def _parse_line(path: Path, number: int, line: str) -> HostEntry:
    match = _LINE.match(line.split("#", 1)[0].strip())
    where = f"hostfile {str(path)!r} line {number}"
    if match is None or match.group("slots") is None:
        raise ConfigError(f"{where}: {line.strip()!r} is not of the form 'host slots=N' "
                          "(or 'host slots=N spare')")
    slots = match.group("slots")
    if not slots.isdigit() or int(slots) < 1:
        raise ConfigError(f"{where}: slots={slots!r} must be a positive integer")
    return HostEntry(match.group("host"), int(slots), match.group("spare") is not None)


def is_local_host(host: str) -> bool:
    """True when ``host`` names this machine (loopback addresses, its host name)."""
    if host in _LOCAL_NAMES or host.startswith("127."):
        return True
    return host in {socket.gethostname(), socket.getfqdn()}
