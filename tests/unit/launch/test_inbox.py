"""An agent's command inbox (mover_plugin.launch.inbox) over a real TCPStore: the commands
posted after it started arrive in order and wake the agent's selector; the ones before do not;
the end of the controller's store reaches the agent's loop as an error."""

from __future__ import annotations

import selectors
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from mover_plugin.contract import COMMANDS_MAILBOX
from mover_plugin.launch.inbox import CommandInbox
from mover_plugin.mailbox import Mailbox


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=10))


def _client(server: dist.TCPStore, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def _take_within(inbox: CommandInbox, count: int, timeout_s: float = 10.0) -> list[dict]:
    selector = selectors.DefaultSelector()
    selector.register(inbox.fileno, selectors.EVENT_READ)
    taken: list[dict] = []
    deadline = time.monotonic() + timeout_s
    while len(taken) < count and time.monotonic() < deadline:
        if selector.select(0.5):
            taken += inbox.take()
    return taken


def test_a_mailbox_read_of_the_next_message_waits_until_it_is_written():
    server = _server()
    writer, reader = Mailbox(server, "box"), Mailbox(_client(server, 10), "box")
    threading.Timer(0.3, writer.post, args=({"n": 1},)).start()
    started = time.monotonic()
    assert reader.next() == {"n": 1}
    assert time.monotonic() - started >= 0.25
    writer.post({"n": 2})
    writer.post({"n": 3})
    assert [reader.next(), reader.next()] == [{"n": 2}, {"n": 3}]


def test_a_poll_reads_every_new_message_at_once_in_order():
    server = _server()
    writer, reader = Mailbox(server, "box"), Mailbox(_client(server, 10), "box")
    for n in range(50):
        writer.post({"n": n})
    assert [m["n"] for m in reader.poll()] == list(range(50))
    assert reader.poll() == []


def test_the_inbox_hands_over_the_commands_posted_after_it_started_in_order():
    server = _server()
    commands = Mailbox(server, COMMANDS_MAILBOX)
    commands.post({"op": "before"})
    inbox = CommandInbox(lambda timeout_s: _client(server, timeout_s))
    inbox.start()
    for n in range(3):
        commands.post({"op": "start", "n": n})
    assert [c["n"] for c in _take_within(inbox, 3)] == [0, 1, 2]
    assert inbox.take() == []


def test_the_end_of_the_controllers_store_reaches_the_agents_loop_as_an_error():
    server = _server()
    inbox = CommandInbox(lambda timeout_s: _client(server, timeout_s))
    inbox.start()
    del server  # the controller's store closes
    with pytest.raises((RuntimeError, ConnectionError)):
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            inbox.take()
            time.sleep(0.05)


def test_the_commands_before_the_end_of_the_store_are_taken_before_its_error():
    """A ``finish`` that came just before the controller's store closed is obeyed: the error
    comes once the commands before it are taken."""
    server = _server()
    commands = Mailbox(server, COMMANDS_MAILBOX)
    inbox = CommandInbox(lambda timeout_s: _client(server, timeout_s))
    inbox.start()
    commands.post({"op": "finish"})
    time.sleep(0.5)  # received and queued
    del server, commands
    time.sleep(0.5)  # the wait ended with the store
    assert inbox.take() == [{"op": "finish"}]
    with pytest.raises((RuntimeError, ConnectionError)):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert inbox.take() == []
            time.sleep(0.05)
