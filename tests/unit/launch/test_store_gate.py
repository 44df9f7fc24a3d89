"""The job's port (mover_plugin.launch.store_gate) in-process: real sockets, real TCPStores.

Only a client that answers the gate's challenge with the job's secret reaches a store; torch's
own client, a wrong secret and a client that says nothing are refused and reported, and none
of them holds up the clients that do hold the secret. The stores listen on loopback only.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from mover_plugin.errors import LaunchError
from mover_plugin.launch import gate_server, store_gate
from mover_plugin.launch.gate_server import GateServer
from mover_plugin.launch.store_gate import (
    CONTROL_TARGET,
    GateRefused,
    StoreGate,
    StoreRelay,
    attempt_target,
    host_loopback_store,
)

SECRET = b"the-job-secret-0123456789"


@pytest.fixture
def gate():
    store = host_loopback_store()
    gate = StoreGate(SECRET, "127.0.0.1", 0, {CONTROL_TARGET: store.port})
    yield gate, store
    gate.close()


def test_the_secret_holder_reaches_each_routed_store_through_its_relay(gate):
    gate, control = gate
    attempt = host_loopback_store()
    gate.route(attempt_target(0), attempt.port)
    relay = StoreRelay(SECRET, "127.0.0.1", gate.port)
    relay.client(CONTROL_TARGET, timeout_s=10).set("commands/1", "start")
    relay.client(attempt_target(0), timeout_s=10).add("rendezvous", 3)
    assert control.get("commands/1") == b"start"
    assert attempt.add("rendezvous", 0) == 3 and not control.check(["rendezvous"])
    assert relay.port_for(CONTROL_TARGET) == relay.port_for(CONTROL_TARGET)
    assert gate.take_refusals() == []
    assert gate.bytes_forwarded > 0  # the copies happen in the gate's own process
    relay.close()


def _settled_refusals(gate: StoreGate, quiet_s: float = 0.5) -> list[tuple[str, str]]:
    """The refusals the gate's process reports (they come a moment after each verdict), taken
    until none came for ``quiet_s``."""
    refusals: list[tuple[str, str]] = []
    last = time.monotonic()
    while time.monotonic() - last < quiet_s:
        new = gate.take_refusals()
        if new:
            refusals += new
            last = time.monotonic()
        time.sleep(0.05)
    return refusals


def test_a_wrong_secret_is_refused_and_reported_and_reaches_nothing(gate):
    gate, control = gate
    wrong = StoreRelay(b"not-the-job-secret-000000", "127.0.0.1", gate.port)
    with pytest.raises(GateRefused, match="refused this host's secret"):
        wrong.client(CONTROL_TARGET, timeout_s=10)
    # torch's own client, straight at the port: it cannot even validate.
    with pytest.raises(dist.DistError):
        dist.TCPStore("127.0.0.1", gate.port, is_master=False, wait_for_workers=False,
                      timeout=timedelta(seconds=2))
    refusals = _settled_refusals(gate)
    assert refusals[0][1] == "wrong job secret"
    assert len(refusals) >= 2 and all(peer.startswith("127.0.0.1:") for peer, _ in refusals)
    assert control.list_keys() == []  # nothing was written
    assert gate.take_refusals() == []


def test_a_store_the_gate_does_not_route_is_refused_and_named(gate):
    gate, _ = gate
    relay = StoreRelay(SECRET, "127.0.0.1", gate.port)
    with pytest.raises(GateRefused, match=r"has no store 6$"):
        relay.open(attempt_target(5))
    assert _settled_refusals(gate)[0][1] == "no store 6"


def test_a_silent_client_is_dropped_and_holds_up_no_one(monkeypatch):
    """The gate's server itself (in this process, as its own process runs it)."""
    monkeypatch.setattr(gate_server, "HANDSHAKE_TIMEOUT_S", 0.5)
    control = host_loopback_store()
    gate = GateServer(SECRET, "127.0.0.1", 0, {CONTROL_TARGET: control.port})
    refusals: list[tuple[str, str]] = []
    gate.on_refusal(lambda peer, why: refusals.append((peer, why)))
    silent = socket.create_connection(("127.0.0.1", gate.port))
    relay = StoreRelay(SECRET, "127.0.0.1", gate.port)
    relay.client(CONTROL_TARGET, timeout_s=10).set("alive", "1")  # admitted meanwhile
    assert control.get("alive") == b"1"
    silent.settimeout(5)
    assert silent.recv(64)[:8] == store_gate.MAGIC  # the challenge, then the verdict
    deadline = time.monotonic() + 5
    while not refusals and time.monotonic() < deadline:
        time.sleep(0.05)
    assert refusals and refusals[0][1].startswith("no answer to the challenge")
    silent.close()
    gate.close()


def test_the_gate_and_the_stores_listen_on_their_address_only():
    gate = StoreGate(SECRET, "127.0.0.2", 0)
    store = host_loopback_store()
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", gate.port), timeout=2)
        socket.create_connection(("127.0.0.2", gate.port), timeout=2).close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.3", store.port), timeout=2)
    finally:
        gate.close()


_OUT_OF_DESCRIPTORS = """
import os, resource, socket, time
from mover_plugin.launch.gate_server import GateServer, raise_open_file_limit
from mover_plugin.launch.store_gate import CONTROL_TARGET, StoreRelay, host_loopback_store
SECRET = b"the-job-secret-0123456789"
store = host_loopback_store()
gate = GateServer(SECRET, "127.0.0.1", 0, {CONTROL_TARGET: store.port})
relay = StoreRelay(SECRET, "127.0.0.1", gate.port)
relay.client(CONTROL_TARGET, timeout_s=10).set("k", "v")
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 16, hard))
time.sleep(1.0)  # the relay's first probe of the gate, closed, has let go of its descriptors
filler = []
try:
    while True:  # every descriptor taken ...
        filler.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
os.close(filler.pop())  # ... but one, which the client takes: the gate's accept has none
client = socket.create_connection(("127.0.0.1", gate.port), timeout=5)
time.sleep(0.5)
for fd in filler:
    os.close(fd)
client.close()
print("limit", raise_open_file_limit() == hard)
assert relay.client(CONTROL_TARGET, timeout_s=10).get("k") == b"v"
print("gate still accepts")
"""


def test_a_gate_out_of_file_descriptors_accepts_again_once_some_are_free():
    """A gate that ran out of descriptors logs it and keeps accepting: the clients that come
    once some are free get through (it does not stop listening for good)."""
    done = subprocess.run([sys.executable, "-c", _OUT_OF_DESCRIPTORS], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:2] == ["limit True", "gate still accepts"]
    assert "no file descriptor left" in done.stderr


def test_a_port_taken_already_is_an_error_and_leaves_no_gate_process():
    taken = socket.create_server(("127.0.0.1", 0))
    processes_before = set(os.listdir("/proc"))
    with pytest.raises(OSError, match="in use"):
        StoreGate(SECRET, "127.0.0.1", taken.getsockname()[1])
    taken.close()
    children = [pid for pid in set(os.listdir("/proc")) - processes_before if pid.isdigit()
                and "gate_server" in Path(f"/proc/{pid}/cmdline").read_text(errors="ignore")]
    assert children == []


def test_a_gate_whose_process_died_says_so():
    gate = StoreGate(SECRET, "127.0.0.1", 0)
    os.kill(gate.pid, 9)
    deadline = time.monotonic() + 10
    with pytest.raises(LaunchError, match="the gate's process"):
        while time.monotonic() < deadline:
            gate.take_refusals()
            time.sleep(0.05)
    gate.close()
