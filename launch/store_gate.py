"""The job's stores behind one port that only holders of the job's secret get through.

torch's ``TCPStore`` has no authentication: anyone who reaches its port can read, write and
delete every key, including the ones that drive the job (commands to the agents, alarms,
process-group rendezvous). So the stores the controller hosts listen on this host's loopback
only, and the one port the job opens to the network is a :class:`StoreGate`. A connection to
the gate first answers a challenge (an HMAC-SHA256 of a fresh nonce under the job's secret,
see :mod:`mover_plugin.launch.job_secret`) and names the store it wants; the gate then joins it
to that store byte for byte. The gate runs in a process of its own
(:mod:`mover_plugin.launch.gate_server`; :class:`StoreGate` is the controller's handle on it),
where one thread copies the bytes of every connection it joined: thousands of hosts cost it
sockets, not threads, and the controller's interpreter never waits for those copies. A wrong
answer, a store that does not exist or a client that says nothing within
:data:`HANDSHAKE_TIMEOUT_S` is refused and logged, and kept for the controller's event log
(:meth:`StoreGate.take_refusals`); the job goes on untouched.

Processes that speak to the stores (agents, workers, standbys, ``mover status``) use torch's own
client, which cannot answer a challenge, so each host runs a :class:`StoreRelay`: it listens on
the host's loopback, answers the challenge for every connection it accepts and then joins the
two (one thread of the process copies for all its relays). Workers find their host's relay
through ``MASTER_ADDR``/``MASTER_PORT`` and never hold the secret. Trust is per host: a process
on a job's host that can reach its loopback is as trusted as the agent.

Protocol (all integers big-endian)::

    gate  -> client   MAGIC (8 bytes) + nonce (16 bytes)
    client -> gate    target (4 bytes) + HMAC-SHA256(secret, nonce + target) (32 bytes)
    gate  -> client   1 byte: ACCEPTED, then the store's own protocol; REFUSED (wrong secret)
                      or NO_STORE (no such target), then close

Target :data:`CONTROL_TARGET` is the controller's store; the per-attempt rendezvous stores
are :func:`attempt_target`.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Mapping, Optional

import torch.distributed as dist

from mover_plugin.errors import LaunchError
from mover_plugin.launch.gate_server import (
    ACCEPTED,
    BACKLOG,
    HANDSHAKE_TIMEOUT_S,
    LOOPBACK,
    MAGIC,
    NO_STORE,
    NONCE_BYTES,
    REFUSED,
    RETRY_PERIOD_S,
    TARGET,
    accept_connection,
    answer,
    raise_open_file_limit,
    receive_exactly,
    relay_pump,
)

logger = logging.getLogger(__name__)

__all__ = ["CONTROL_TARGET", "LOOPBACK", "GateRefused", "StoreGate", "StoreRelay", "answer",
           "attempt_target", "host_loopback_store", "raise_open_file_limit"]

CONTROL_TARGET = 0
_STOP_S = 5.0
"""How long closing the gate waits for its process to end."""


class GateRefused(LaunchError):
    """The gate refused this side's secret."""


def attempt_target(attempt: int) -> int:
    """The gate target of attempt ``attempt``'s rendezvous store."""
    return attempt + 1


def host_loopback_store() -> dist.TCPStore:
    """A store served on this host's loopback only (torch's own server listens on every
    interface unless it is handed a socket)."""
    listener = socket.create_server((LOOPBACK, 0), backlog=BACKLOG)
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
    """The job's one network port in front of the stores the controller hosts: a handle on
    the gate's process (:mod:`mover_plugin.launch.gate_server`)."""

    def __init__(self, secret: bytes, addr: str, port: int,
                 routes: Optional[Mapping[int, int]] = None) -> None:
        """``routes``: the stores (target -> loopback port) routed before the port opens, so
        no client can arrive before them (the controller's store). Raises :class:`OSError`
        when the port cannot be opened."""
        self._refusals: list[tuple[str, str]] = []
        self._replies: list[dict[str, Any]] = []
        self._lock = threading.Condition()
        self._write_lock = threading.Lock()
        self._reader_ended = False
        # A session of its own: a Ctrl-C or a signal to the launcher's process group does not
        # close the port before the controller told the agents to finish; the end of its
        # stdin (this process's end, whatever ends it) does.
        self._process = subprocess.Popen(
            [sys.executable, "-m", "mover_plugin.launch.gate_server"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1, start_new_session=True)
        self._send(secret=secret.hex(), addr=addr, port=port,
                   routes={str(t): p for t, p in (routes or {}).items()})
        assert self._process.stdout is not None
        opened = json.loads(self._process.stdout.readline() or '{"error": "the gate exited"}')
        if "error" in opened:
            self.close()
            raise OSError(opened["error"])
        self.port: int = opened["port"]
        threading.Thread(target=self._read, name="mover-gate-replies", daemon=True).start()

    @property
    def pid(self) -> int:
        """The gate's process."""
        return self._process.pid

    def route(self, target: int, store_port: int) -> None:
        """Connections for ``target`` go to the loopback store on ``store_port`` (from the
        moment this returns)."""
        self._send(route=[target, store_port])
        self._reply("routed")

    @property
    def bytes_forwarded(self) -> int:
        """Bytes passed between clients and stores so far, both ways."""
        self._send(count=True)
        return int(self._reply("bytes")["bytes"])

    def take_refusals(self) -> list[tuple[str, str]]:
        """The connections refused since the last call: (the peer's address, why). Raises
        :class:`LaunchError` once the gate's process has exited (no host can reach the job)."""
        if self._process.poll() is not None:
            raise LaunchError(f"the job's port (the gate's process, pid {self._process.pid}) "
                              f"exited with {self._process.returncode}")
        with self._lock:
            refusals, self._refusals = self._refusals, []
        return refusals

    def close(self) -> None:
        """Closes the port: the gate's process ends, and every connection through it."""
        if self._process.stdin is not None:
            try:
                self._process.stdin.close()
            except OSError:
                pass
        try:
            self._process.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()

    def _send(self, **request: Any) -> None:
        assert self._process.stdin is not None
        try:
            with self._write_lock:
                self._process.stdin.write(json.dumps(request) + "\n")
                self._process.stdin.flush()
        except OSError as error:
            raise LaunchError(f"the job's port (the gate's process) is gone ({error})") from None

    def _reply(self, kind: str) -> dict[str, Any]:
        with self._lock:
            while True:
                for reply in self._replies:
                    if kind in reply:
                        self._replies.remove(reply)
                        return reply
                if self._process.poll() is not None or self._reader_ended:
                    raise LaunchError(f"the job's port (the gate's process) exited with "
                                      f"{self._process.poll()}")
                self._lock.wait(1.0)

    def _read(self) -> None:
        assert self._process.stdout is not None
        try:
            for line in self._process.stdout:
                message = json.loads(line)
                with self._lock:
                    if "refused" in message:
                        self._refusals.append((message["refused"][0], message["refused"][1]))
                    else:
                        self._replies.append(message)
                    self._lock.notify_all()
        except (OSError, ValueError) as error:
            logger.error("lost the gate's replies (%s)", error)
        finally:
            with self._lock:
                self._reader_ended = True
                self._lock.notify_all()


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
                listener = socket.create_server((LOOPBACK, 0), backlog=BACKLOG)
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
            challenge = receive_exactly(gate, len(MAGIC) + NONCE_BYTES)
            if challenge is None or not challenge.startswith(MAGIC):
                raise OSError(f"{self._address} is not a mover-launch job's port")
            nonce = challenge[len(MAGIC):]
            gate.sendall(TARGET.pack(target) + answer(self._secret, nonce, target))
            verdict = receive_exactly(gate, 1)
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
            accepted = accept_connection(listener)
            if accepted is None:
                return
            local, _ = accepted
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
        relay_pump().join(local, gate)


def _refusal(address: str, verdict: Optional[bytes], target: int) -> str:
    if verdict == REFUSED:
        return (f"the job at {address} refused this host's secret "
                "(MOVER_JOB_SECRET must be the job's)")
    if verdict == NO_STORE:
        return f"the job at {address} has no store {target}"
    return f"the job at {address} closed the connection"
