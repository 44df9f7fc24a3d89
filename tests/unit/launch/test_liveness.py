"""The agents' heartbeats and the controller's watch of them, on an in-process store."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

import pytest

from mover_plugin.launch.agent_config import AgentConfig
from mover_plugin.launch.hosts import NodeSpec
from mover_plugin.launch.liveness import (
    CHECK_PERIOD_S,
    AgentBeat,
    AgentWatch,
    beat_key,
    beat_period,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _watch(store, clock, timeout_s=2.0):
    watch = AgentWatch(store, [0, 1], timeout_s, clock=clock)
    watch.prepare()
    watch.start()
    return watch


def test_a_host_whose_counter_stops_is_lost_once_after_the_timeout():
    store, clock = dist.HashStore(), Clock()
    watch = _watch(store, clock)
    step = 1.1 * CHECK_PERIOD_S
    for _ in range(30):  # 3.3 s: host 0 beats, host 1 is silent
        clock.advance(step)
        store.add(beat_key(0), 1)
        lost = watch.lost()
        if lost:
            break
    (node, silent, _), = lost
    assert node == 1 and 2.0 < silent <= 2.0 + step
    clock.advance(5.0)
    store.add(beat_key(0), 1)
    assert watch.lost() == []  # reported once; host 0 still beats


def test_a_controller_held_up_blames_no_agent():
    store, clock = dist.HashStore(), Clock()
    watch = _watch(store, clock)
    clock.advance(10.0)  # the controller did not look for 10 s
    assert watch.lost() == []
    for _ in range(4):  # 2 s of silence it saw, looking every 0.5 s
        clock.advance(0.5)
        assert watch.lost() == []
    clock.advance(0.5)
    assert sorted(node for node, _, _ in watch.lost()) == [0, 1]


def test_a_forgotten_host_is_not_watched():
    store, clock = dist.HashStore(), Clock()
    watch = _watch(store, clock)
    watch.forget(1)
    lost = []
    for _ in range(30):  # neither beats
        clock.advance(0.2)
        lost += watch.lost()
    assert [node for node, _, _ in lost] == [0]


def test_an_agent_beat_adds_to_its_counter_until_stopped():
    store = dist.HashStore()
    store.set(beat_key(3), "0")
    unreachable = []
    beat = AgentBeat(lambda: store, 3, period_s=0.01, unreachable_after_s=60.0,
                     on_unreachable=unreachable.append)
    beat.start()
    deadline = time.monotonic() + 10
    while int(store.get(beat_key(3))) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    beat.stop()
    assert beat.join(timeout_s=10) and int(store.get(beat_key(3))) >= 3
    assert unreachable == []


class _Unanswered(dist.HashStore):
    """A store whose calls wait, as one cut off by its network does."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def add(self, key, value):
        self.release.wait()
        return 0


def test_beats_unanswered_for_too_long_call_the_watchdog_once():
    store, called = _Unanswered(), threading.Event()
    silences = []

    def unreachable(silent_s: float) -> None:
        silences.append(silent_s)
        called.set()

    beat = AgentBeat(lambda: store, 0, period_s=0.01, unreachable_after_s=0.2,
                     on_unreachable=unreachable)
    beat.start()
    assert called.wait(timeout=10)
    beat.stop()
    store.release.set()
    assert beat.join(timeout_s=10)
    assert len(silences) == 1 and silences[0] > 0.2


@pytest.mark.parametrize("timeout_s, period_s", [(0.5, 0.25), (1.0, 0.25), (1.6, 0.4),
                                                 (2.0, 0.5), (30.0, 0.5)])
def test_agents_beat_four_times_per_timeout_between_a_quarter_and_half_a_second(timeout_s,
                                                                                period_s):
    assert beat_period(timeout_s) == pytest.approx(period_s)


def test_an_agents_beat_period_travels_in_its_settings():
    config = AgentConfig(NodeSpec(0, "h", 1, 0), 1, "127.0.0.1", 1, ("true",),
                         beat_period_s=0.5)
    assert AgentConfig.from_json(config.to_json()).beat_period_s == 0.5
