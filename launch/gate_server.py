"""The job's port, served in a process of its own: the gate's protocol, its server and the
pump that copies the bytes of every connection it joined.

:mod:`mover_plugin.launch.store_gate` says what the gate is for and how clients get through
it. This module needs neither torch nor the controller: ``mover-launch`` runs it as a child
(``python -m mover_plugin.launch.gate_server``), so that the bytes of thousands of hosts'
connections are copied on another interpreter than the controller's, whose decisions must not
wait for them. The child and its parent speak JSON lines::

    parent -> child (stdin)   {"secret": HEX, "addr": A, "port": P, "routes": {TARGET: PORT}}
                              {"route": [TARGET, PORT]}      {"count": true}
    child -> parent (stdout)  {"port": P} (listening) or {"error": WHY}
                              {"routed": TARGET}             {"bytes": N}
                              {"refused": [PEER, WHY]}

The end of its stdin (the parent's end) closes the port and ends the child.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import logging
import os
import resource
import selectors
import socket
import struct
import sys
import threading
import time
from typing import Any, Callable, Mapping, Optional

logger = logging.getLogger(__name__)

MAGIC = b"MOVRGAT1"
NONCE_BYTES = 16
ACCEPTED, REFUSED, NO_STORE = b"\x01", b"\x00", b"\x02"
HANDSHAKE_TIMEOUT_S = 10.0
"""How long the gate waits for a client's answer, and a relay for the gate's verdict."""
RETRY_PERIOD_S = 0.2
"""How often a relay tries a gate that does not answer yet, and the gate a full accept."""
TARGET = struct.Struct(">I")
MAC_BYTES = hashlib.sha256().digest_size
LOOPBACK = "127.0.0.1"
_NO_FILE_CEILING = 1 << 20
"""The open-file limit asked for when the hard limit is unlimited (Linux's default ceiling)."""
BACKLOG = 4096
"""Connections waiting to be accepted: every host's agent and workers connect at once when a
large job starts (the kernel caps it at ``net.core.somaxconn``)."""


def answer(secret: bytes, nonce: bytes, target: int) -> bytes:
    """The client's answer to the gate's challenge ``nonce`` for ``target``."""
    return hmac.new(secret, nonce + TARGET.pack(target), hashlib.sha256).digest()


class GateServer:
    """The job's one network port in front of the stores the controller hosts (run in a
    process of its own by :class:`~mover_plugin.launch.store_gate.StoreGate`)."""

    def __init__(self, secret: bytes, addr: str, port: int,
                 routes: Optional[Mapping[int, int]] = None) -> None:
        """``routes``: the stores (target -> loopback port) routed before the port opens, so
        no client can arrive before them (the controller's store)."""
        self._secret = secret
        self._refusal_listeners: list[Callable[[str, str], None]] = []
        self._routes: dict[int, int] = dict(routes or {})
        self._lock = threading.Lock()
        self._pump = Pump("mover-gate-pump")
        self._listener = socket.create_server((addr, port), backlog=BACKLOG)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="mover-gate", daemon=True)
        self._thread.start()

    def route(self, target: int, store_port: int) -> None:
        """Connections for ``target`` go to the loopback store on ``store_port``."""
        with self._lock:
            self._routes[target] = store_port

    @property
    def bytes_forwarded(self) -> int:
        """Bytes passed between clients and stores so far, both ways."""
        return self._pump.forwarded

    def on_refusal(self, listener: Callable[[str, str], None]) -> None:
        """``listener(peer, why)`` hears of each refused connection (from the admitting
        thread)."""
        self._refusal_listeners.append(listener)

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._pump.stop()

    def _serve(self) -> None:
        while True:
            accepted = accept_connection(self._listener)
            if accepted is None:
                return
            client, peer = accepted
            threading.Thread(target=self._admit, args=(client, f"{peer[0]}:{peer[1]}"),
                             name="mover-gate-admit", daemon=True).start()

    def _admit(self, client: socket.socket, peer: str) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            client.settimeout(HANDSHAKE_TIMEOUT_S)
            client.sendall(MAGIC + nonce)
            reply = receive_exactly(client, TARGET.size + MAC_BYTES)
        except OSError as error:
            return self._refuse(client, peer, f"no answer to the challenge ({error})")
        if reply is None:
            return self._refuse(client, peer, "closed before answering the challenge")
        (target,) = TARGET.unpack(reply[:TARGET.size])
        if not hmac.compare_digest(reply[TARGET.size:], answer(self._secret, nonce, target)):
            return self._refuse(client, peer, "wrong job secret")
        with self._lock:
            store_port = self._routes.get(target)
        if store_port is None:
            return self._refuse(client, peer, f"no store {target}", NO_STORE)
        try:
            store = socket.create_connection((LOOPBACK, store_port), timeout=HANDSHAKE_TIMEOUT_S)
            client.sendall(ACCEPTED)
        except OSError as error:
            client.close()
            logger.warning("store %d is gone (%s); closed %s's connection", target, error, peer)
            return None
        self._pump.join(client, store)
        return None

    def _refuse(self, client: socket.socket, peer: str, why: str,
                verdict: bytes = REFUSED) -> None:
        logger.warning("refused a connection to the job's store from %s: %s", peer, why)
        for listener in self._refusal_listeners:
            listener(peer, why)
        try:
            client.sendall(verdict)
        except OSError:
            pass
        client.close()


class _End:
    """One socket of a link: the bytes waiting to be written to it, and its registration."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.peer: "_End" = self
        self.out = bytearray()
        self.mask = 0
        """The events it is registered for (0: not registered)."""

    def wanted(self) -> int:
        """Reads while its peer has no backlog, writes while it has one of its own."""
        return ((0 if self.peer.out else selectors.EVENT_READ)
                | (selectors.EVENT_WRITE if self.out else 0))


class _Link:
    """Two sockets joined byte for byte until either side closes."""

    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self.ends = (_End(a), _End(b))
        self.ends[0].peer, self.ends[1].peer = self.ends[1], self.ends[0]
        self.closed = False
        for end in self.ends:
            end.sock.setblocking(False)
            end.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Pump:
    """One thread that copies the bytes of every link it holds, both ways, with one selector:
    a link costs two sockets and no thread, and an idle one costs nothing. A side that
    cannot take more (its peer's bytes pile up) stops its peer's reads until it drains."""

    def __init__(self, name: str) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = socket.socketpair()
        for sock in (self._wake_read, self._wake_write):
            sock.setblocking(False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._lock = threading.Lock()
        self._joining: list[_Link] = []
        self._links: set[_Link] = set()
        self._stopping = False
        self.forwarded = 0
        """Bytes copied so far, both ways."""
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def join(self, a: socket.socket, b: socket.socket) -> None:
        """Joins ``a`` and ``b`` (from any thread)."""
        link = _Link(a, b)
        with self._lock:
            self._joining.append(link)
        self._wake()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Closes every link and ends the thread."""
        with self._lock:
            self._stopping = True
        self._wake()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _wake(self) -> None:
        try:
            self._wake_write.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or the pump has stopped

    def _run(self) -> None:
        while self._take_requests():
            for key, events in self._selector.select():
                if key.data is None:
                    self._drain_wakes()
                elif not key.data[0].closed:
                    self._serve(key.data[0], key.data[1], events)
        for link in list(self._links):
            self._close(link)
        self._selector.close()
        self._wake_read.close()
        self._wake_write.close()

    def _take_requests(self) -> bool:
        """Adds the links joined since the last look; returns whether the pump goes on."""
        with self._lock:
            joining, self._joining = self._joining, []
            stopping = self._stopping
        for link in joining:
            self._links.add(link)
            for end in link.ends:
                self._update(link, end)
        return not stopping

    def _drain_wakes(self) -> None:
        try:
            while self._wake_read.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _serve(self, link: _Link, end: _End, events: int) -> None:
        try:
            if events & selectors.EVENT_WRITE:
                del end.out[:end.sock.send(end.out)]
            if events & selectors.EVENT_READ and not end.peer.out:
                chunk = end.sock.recv(1 << 16)
                if not chunk:
                    return self._close(link)
                self.forwarded += len(chunk)
                peer = end.peer
                try:
                    sent = peer.sock.send(chunk)
                except BlockingIOError:
                    sent = 0
                peer.out += chunk[sent:]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            return self._close(link)
        for each in link.ends:
            self._update(link, each)
        return None

    def _update(self, link: _Link, end: _End) -> None:
        wanted = end.wanted()
        if wanted == end.mask:
            return
        if end.mask == 0:
            self._selector.register(end.sock, wanted, (link, end))
        elif wanted == 0:
            self._selector.unregister(end.sock)
        else:
            self._selector.modify(end.sock, wanted, (link, end))
        end.mask = wanted

    def _close(self, link: _Link) -> None:
        if link.closed:
            return
        link.closed = True
        self._links.discard(link)
        for end in link.ends:
            if end.mask:
                self._selector.unregister(end.sock)
                end.mask = 0
            try:
                end.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            end.sock.close()


_RELAY_PUMP: Optional[Pump] = None
_RELAY_PUMP_LOCK = threading.Lock()


def relay_pump() -> Pump:
    """The pump every relay of this process shares (started on first use)."""
    global _RELAY_PUMP
    with _RELAY_PUMP_LOCK:
        if _RELAY_PUMP is None:
            _RELAY_PUMP = Pump("mover-relay-pump")
        return _RELAY_PUMP


def accept_connection(listener: socket.socket) -> Optional[tuple[socket.socket, Any]]:
    """The next connection to ``listener``; None once it is closed. Out of file descriptors
    (the process's limit: see :func:`raise_open_file_limit`), it logs and tries again: the
    clients connected so far keep working and the next ones wait in the backlog."""
    while True:
        try:
            return listener.accept()
        except OSError as error:
            if error.errno not in (errno.EMFILE, errno.ENFILE):
                return None
            logger.error("no file descriptor left for a new connection to the job's store "
                         "(%s); retrying", error)
            time.sleep(RETRY_PERIOD_S)


def raise_open_file_limit() -> int:
    """Raises this process's limit of open files to its hard limit and returns it. A gate holds
    three descriptors per connection (the client's, its link to the store, the store's own),
    and a job of thousands of hosts holds tens of thousands of connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = _NO_FILE_CEILING if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as error:
            logger.warning("cannot raise the open-file limit from %d to %d (%s)", soft, target,
                           error)
            return soft
        return target
    return soft


def receive_exactly(sock: socket.socket, count: int) -> Optional[bytes]:
    """``count`` bytes from ``sock``; None if it closes first."""
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def main() -> None:
    """The child's loop: opens the port the first line asks for, then obeys the next ones."""
    logging.basicConfig(level=logging.INFO, format="[mover-gate] %(message)s", stream=sys.stderr)
    raise_open_file_limit()
    out_lock = threading.Lock()

    def say(**message: Any) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()
    settings = json.loads(sys.stdin.readline())
    try:
        gate = GateServer(bytes.fromhex(settings["secret"]), settings["addr"], settings["port"],
                          {int(t): p for t, p in settings["routes"].items()})
    except OSError as error:
        say(error=str(error))
        return
    gate.on_refusal(lambda peer, why: say(refused=[peer, why]))
    say(port=gate.port)
    for line in sys.stdin:
        request = json.loads(line)
        if "route" in request:
            target, port = request["route"]
            gate.route(target, port)
            say(routed=target)
        elif "count" in request:
            say(bytes=gate.bytes_forwarded)
    gate.close()


if __name__ == "__main__":
    main()
