"""The job's stores behind one port that only holders of the job's secret get through.

torch's ``TCPStore`` has no authentication: anyone who reaches its port can read, write and
delete every key, including the ones that drive the job (commands to the agents, alarms,
process-group rendezvous). So the stores the controller hosts listen on this host's loopback
only, and the one port the job opens to the network is a :class:`StoreGate`. A connection to
the gate first answers a challenge (an HMAC-SHA256 of a fresh nonce under the job's secret,
see :mod:`mover_plugin.launch.job_secret`) and names the store it wants; the gate then joins it
to that store byte for byte. A wrong answer, a store that does not exist or a client that says
nothing within :data:`HANDSHAKE_TIMEOUT_S` is refused and logged, and kept for the controller's
event log (:meth:`StoreGate.take_refusals`); the job goes on untouched.

Processes that speak to the stores (agents, workers, standbys, ``mover status``) use torch's
own client, which cannot answer a challenge, so each host runs a :class:`StoreRelay`: it
listens on the host's loopback, answers the challenge for every connection it accepts and
then joins the two. Workers find their host's relay through ``MASTER_ADDR``/``MASTER_PORT``
and never hold the secret. Trust is per host: a process on a job's host that can reach its
loopback is as trusted as the agent.

Protocol (all integers big-endian)::

    gate  -> client   MAGIC (8 bytes) + nonce (16 bytes)
    client -> gate    target (4 bytes) + HMAC-SHA256(secret, nonce + target) (32 bytes)
    gate  -> client   1 byte: ACCEPTED, then the store's own protocol; REFUSED (wrong secret)
                      or NO_STORE (no such target), then close

Target :data:`CONTROL_TARGET` is the controller's store; the per-attempt rendezvous stores
are :func:`attempt_target`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Callable, Mapping, Optional

import torch.distributed as dist

from mover_plugin.errors import LaunchError

logger = logging.getLogger(__name__)

MAGIC = b"MOVRGAT1"
NONCE_BYTES = 16
ACCEPTED, REFUSED, NO_STORE = b"\x01", b"\x00", b"\x02"
HANDSHAKE_TIMEOUT_S = 10.0
"""How long the gate waits for a client's answer, and a relay for the gate's verdict."""
CONTROL_TARGET = 0
RETRY_PERIOD_S = 0.2
"""How often :meth:`StoreRelay.client` tries a gate that does not answer yet."""
_TARGET = struct.Struct(">I")
_MAC_BYTES = hashlib.sha256().digest_size
LOOPBACK = "127.0.0.1"


class GateRefused(LaunchError):
    """The gate refused this side's secret."""


def attempt_target(attempt: int) -> int:
    """The gate target of attempt ``attempt``'s rendezvous store."""
    return attempt + 1


def answer(secret: bytes, nonce: bytes, target: int) -> bytes:
    """The client's answer to the gate's challenge ``nonce`` for ``target``."""
    return hmac.new(secret, nonce + _TARGET.pack(target), hashlib.sha256).digest()


def host_loopback_store() -> dist.TCPStore:
    """A store served on this host's loopback only (torch's own server listens on every
    interface unless it is handed a socket)."""
    listener = socket.create_server((LOOPBACK, 0), backlog=512)
    port = listener.getsockname()[1]
    try:
        store = dist.TCPStore(LOOPBACK, port, is_master=True, wait_for_workers=False,
                              master_listen_fd=listener.fileno())
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store's server owns the socket from now on
    return store


class StoreGate:
    """The job's one network port in front of the stores the controller hosts."""

    def __init__(self, secret: bytes, addr: str, port: int,
                 routes: Optional[Mapping[int, int]] = None) -> None:
        """``routes``: the stores (target -> loopback port) routed before the port opens, so
        no client can arrive before them (the controller's store)."""
        self._secret = secret
        self._refusals: list[tuple[str, str]] = []
        self._routes: dict[int, int] = dict(routes or {})
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._listener = socket.create_server((addr, port), backlog=512)
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="mover-gate", daemon=True)
        self._thread.start()

    def route(self, target: int, store_port: int) -> None:
        """Connections for ``target`` go to the loopback store on ``store_port``."""
        with self._lock:
            self._routes[target] = store_port

    def take_refusals(self) -> list[tuple[str, str]]:
        """The connections refused since the last call: (the peer's address, why)."""
        with self._lock:
            refusals, self._refusals = self._refusals, []
        return refusals

    def close(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()

    def _serve(self) -> None:
        while True:
            try:
                client, peer = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(client, f"{peer[0]}:{peer[1]}"),
                             name="mover-gate-admit", daemon=True).start()

    def _admit(self, client: socket.socket, peer: str) -> None:
        nonce = os.urandom(NONCE_BYTES)
        try:
            client.settimeout(HANDSHAKE_TIMEOUT_S)
            client.sendall(MAGIC + nonce)
            reply = _receive_exactly(client, _TARGET.size + _MAC_BYTES)
        except OSError as error:
            return self._refuse(client, peer, f"no answer to the challenge ({error})")
        if reply is None:
            return self._refuse(client, peer, "closed before answering the challenge")
        (target,) = _TARGET.unpack(reply[:_TARGET.size])
        if not hmac.compare_digest(reply[_TARGET.size:], answer(self._secret, nonce, target)):
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
        self._join(client, store)
        return None

    def _refuse(self, client: socket.socket, peer: str, why: str,
                verdict: bytes = REFUSED) -> None:
        logger.warning("refused a connection to the job's store from %s: %s", peer, why)
        with self._lock:
            self._refusals.append((peer, why))
        try:
            client.sendall(verdict)
        except OSError:
            pass
        client.close()

    def _join(self, client: socket.socket, store: socket.socket) -> None:
        link = _Link(client, store, on_close=self._forget)
        with self._lock:
            self._links.add(link)
        link.run()

    def _forget(self, link: "_Link") -> None:
        with self._lock:
            self._links.discard(link)


class StoreRelay:
    """This host's way through the gate: loopback ports that torch's store client can use."""

    def __init__(self, secret: bytes, gate_addr: str, gate_port: int,
                 connect_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:
        self._secret = secret
        self._gate = (gate_addr, gate_port)
        self._connect_timeout_s = connect_timeout_s
        self._listeners: dict[int, socket.socket] = {}
        self._lock = threading.Lock()

    def port_for(self, target: int) -> int:
        """The loopback port whose connections go to ``target``'s store (opened once)."""
        with self._lock:
            listener = self._listeners.get(target)
            if listener is None:
                listener = socket.create_server((LOOPBACK, 0), backlog=512)
                self._listeners[target] = listener
                threading.Thread(target=self._serve, args=(listener, target),
                                 name=f"mover-relay-{target}", daemon=True).start()
            return listener.getsockname()[1]

    def client(self, target: int, timeout_s: float) -> dist.TCPStore:
        """A store client of ``target`` through this relay; waits up to ``timeout_s`` for the
        gate to answer (and uses that timeout for every call). Raises :class:`GateRefused`
        at once when the gate refuses this secret, :class:`OSError` when nothing answered."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.open(target).close()
                break
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(RETRY_PERIOD_S)
        return dist.TCPStore(LOOPBACK, self.port_for(target), is_master=False,
                             timeout=timedelta(seconds=timeout_s), wait_for_workers=False)

    def open(self, target: int) -> socket.socket:
        """A connection through the gate to ``target``'s store, the challenge answered."""
        gate = socket.create_connection(self._gate, timeout=self._connect_timeout_s)
        try:
            gate.settimeout(HANDSHAKE_TIMEOUT_S)
            challenge = _receive_exactly(gate, len(MAGIC) + NONCE_BYTES)
            if challenge is None or not challenge.startswith(MAGIC):
                raise OSError(f"{self._address} is not a mover-launch job's port")
            nonce = challenge[len(MAGIC):]
            gate.sendall(_TARGET.pack(target) + answer(self._secret, nonce, target))
            verdict = _receive_exactly(gate, 1)
            if verdict != ACCEPTED:
                raise GateRefused(_refusal(self._address, verdict, target))
            gate.settimeout(None)
            return gate
        except BaseException:
            gate.close()
            raise

    def close(self) -> None:
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
        for listener in listeners:
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()

    @property
    def _address(self) -> str:
        return f"{self._gate[0]}:{self._gate[1]}"

    def _serve(self, listener: socket.socket, target: int) -> None:
        while True:
            try:
                local, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(local, target),
                             name="mover-relay-link", daemon=True).start()

    def _relay(self, local: socket.socket, target: int) -> None:
        try:
            gate = self.open(target)
        except (OSError, LaunchError) as error:
            logger.warning("cannot reach the job's store %d through %s: %s", target,
                           self._address, error)
            local.close()
            return
        _Link(local, gate).run()


class _Link:
    """Two sockets joined byte for byte until either side closes."""

    def __init__(self, a: socket.socket, b: socket.socket,
                 on_close: Optional[Callable[["_Link"], None]] = None) -> None:
        self._sockets = (a, b)
        self._on_close = on_close
        self._closed = threading.Event()
        for sock in self._sockets:
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run(self) -> None:
        """Copies both ways; returns (on the calling thread) when the link is closed."""
        a, b = self._sockets
        threading.Thread(target=self._copy, args=(b, a), name="mover-link", daemon=True).start()
        self._copy(a, b)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for sock in self._sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        if self._on_close is not None:
            self._on_close(self)

    def _copy(self, source: socket.socket, destination: socket.socket) -> None:
        try:
            while chunk := source.recv(1 << 16):
                destination.sendall(chunk)
        except OSError:
            pass
        self.close()


def _refusal(address: str, verdict: Optional[bytes], target: int) -> str:
    if verdict == REFUSED:
        return (f"the job at {address} refused this host's secret "
                "(MOVER_JOB_SECRET must be the job's)")
    if verdict == NO_STORE:
        return f"the job at {address} has no store {target}"
    return f"the job at {address} closed the connection"


def _receive_exactly(sock: socket.socket, count: int) -> Optional[bytes]:
    """``count`` bytes from ``sock``; None if it closes first."""
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)
