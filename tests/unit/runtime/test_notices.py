"""The notice pipe between an agent and a worker: mover_plugin.runtime.notices.

A real pipe and a real watcher thread; the agent's side is the same ``encode_notice`` the
agent writes with.
"""

import os
import time

from mover_plugin.contract import encode_notice
from mover_plugin.runtime.notices import NoticeWatcher


class _Recorder:
    def __init__(self) -> None:
        self.alarms: list[str] = []
        self.switches = 0
        self.preparations: list[int] = []

    def alarm(self, reason: str) -> None:
        self.alarms.append(reason)

    def switch(self) -> None:
        self.switches += 1

    def prepare(self, generation: int) -> None:
        self.preparations.append(generation)


def _watch(generation: int):
    read_end, write_end = os.pipe()
    recorder = _Recorder()
    watcher = NoticeWatcher(read_end, generation, recorder.alarm, recorder.switch,
                            recorder.prepare)
    return watcher, recorder, write_end


def _wait_for(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def _send(fd: int, **notice) -> None:
    os.write(fd, encode_notice(notice))


def test_only_the_followed_generation_s_notices_are_acted_on() -> None:
    watcher, recorder, pipe = _watch(generation=1)
    try:
        _send(pipe, generation=0, kind="alarm", reason="old generation")
        _send(pipe, generation=2, kind="switch")
        _send(pipe, generation=0, kind="prepare", next=3)
        _send(pipe, generation=1, kind="prepare", next=4)
        _send(pipe, generation=1, kind="switch")
        assert _wait_for(lambda: recorder.switches == 1)
        assert recorder.preparations == [4] and recorder.alarms == []
        watcher.follow(2)
        assert watcher.generation == 2
        _send(pipe, generation=1, kind="alarm", reason="late alarm of generation 1")
        _send(pipe, generation=2, kind="retire")
        # A notice split over two writes is read whole.
        line = encode_notice({"generation": 2, "kind": "alarm", "reason": "rank 3 lost"})
        os.write(pipe, line[:7])
        time.sleep(0.05)
        os.write(pipe, line[7:])
        assert _wait_for(lambda: recorder.alarms == ["rank 3 lost"])
        # The switch for generation 2 sent while 1 was followed was kept and acted on at follow.
        assert recorder.alarms == ["rank 3 lost"] and recorder.switches == 2
    finally:
        watcher.stop()
        os.close(pipe)


def test_stop_ends_the_thread_at_once_and_a_closed_pipe_ends_it_too() -> None:
    watcher, _, pipe = _watch(generation=0)
    started = time.monotonic()
    watcher.stop()
    assert time.monotonic() - started < 1.0
    assert not watcher.running
    os.close(pipe)

    watcher, _, pipe = _watch(generation=0)
    os.close(pipe)  # the agent is gone
    watcher.join(timeout=5.0)
    assert not watcher.running


def test_a_notice_for_a_later_generation_waits_until_that_generation_is_followed() -> None:
    watcher, recorder, pipe = _watch(generation=0)
    try:
        _send(pipe, generation=1, kind="alarm", reason="rank 2 lost")
        _send(pipe, generation=0, kind="switch")
        assert _wait_for(lambda: recorder.switches == 1)
        assert recorder.alarms == []  # kept, not acted on, while generation 0 is followed
        watcher.follow(1)
        assert recorder.alarms == ["rank 2 lost"]
        watcher.follow(2)
        assert recorder.alarms == ["rank 2 lost"]  # acted on once
    finally:
        watcher.stop()
        os.close(pipe)
