"""The script's collectives between iterations (mover_plugin.deepspeed.between_calls): recorded
on a running rank, answered to a joiner in the same order, and named where they cannot be.
Real torch.distributed collectives on a one-process gloo group."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from mover_plugin.deepspeed.between_calls import BetweenCalls, Mode


@pytest.fixture
def world(tmp_path):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield
    finally:
        dist.destroy_process_group()


def call(between, name, *args, **kwargs):
    """What the hook point does with a script's call of ``torch.distributed.<name>``."""
    return between.around(name, getattr(dist, name), *args, **kwargs)


def script_between_iterations(between, count):
    """A Trainer-like script: gathers a token count and keeps the sum; then modifies its
    tensor in place (the record keeps the collective's result)."""
    gathered = [torch.zeros(1)]
    call(between, "all_gather", gathered, torch.tensor([float(count)]))
    total = torch.tensor([float(count)])
    call(between, "all_reduce", total)
    total /= 2
    objects = [None]
    call(between, "all_gather_object", objects, {"count": count})
    call(between, "barrier")
    return gathered[0].item(), total.item(), objects[0]


def recorded(count=7):
    between = BetweenCalls()
    between.iteration_ended()
    assert between.mode is Mode.RECORD
    script_between_iterations(between, count)
    between.iteration_begins()
    assert between.mode is Mode.PASS
    return between.before_open_iteration()


def test_a_joiner_is_answered_what_the_running_rank_received(world):
    record = recorded(count=7)
    assert [entry.name for entry in record] == ["all_gather", "all_reduce",
                                                "all_gather_object", "barrier"]
    assert record[1].result[0].item() == 7.0  # the collective's result, not the halved one

    joiner = BetweenCalls()
    joiner.replay(record)
    assert script_between_iterations(joiner, count=3) == (7.0, 3.5, {"count": 7})
    assert joiner.end_replay() is None and joiner.replayed == 4


def test_a_record_covers_only_the_window_before_the_open_iteration(world):
    between = BetweenCalls()
    between.iteration_ended()
    script_between_iterations(between, 1)
    between.iteration_begins()
    call(between, "all_reduce", torch.ones(1))  # inside the iteration: not recorded
    between.iteration_ended()
    call(between, "barrier")
    assert len(between.before_open_iteration()) == 4  # the next window is still open
    between.iteration_begins()
    assert [entry.name for entry in between.before_open_iteration()] == ["barrier"]


def test_another_thread_s_collectives_are_not_the_script_s(world):
    between = BetweenCalls()
    between.iteration_ended()
    worker = threading.Thread(target=lambda: call(between, "all_reduce", torch.ones(1)))
    worker.start()
    worker.join()
    between.iteration_begins()
    assert between.before_open_iteration() == []


def test_a_replay_that_cannot_be_exact_says_why(world):
    record = recorded()
    other_order = BetweenCalls()
    other_order.replay(record)
    call(other_order, "barrier")
    assert other_order.end_replay() == ("the script made a barrier between iterations where "
                                        "the lost rank's made a all_gather")

    fewer = BetweenCalls()
    fewer.replay(record[:2])
    call(fewer, "all_gather", [torch.zeros(1)], torch.ones(1))
    assert fewer.end_replay() == ("the script made fewer collectives between iterations than "
                                  "the lost rank's did (not made: all_reduce)")

    more = BetweenCalls()
    more.replay([])
    call(more, "barrier")
    assert more.end_replay() == ("the script made a barrier between iterations that the lost "
                                 "rank's did not")

    on_a_group = BetweenCalls()
    on_a_group.iteration_ended()
    call(on_a_group, "all_reduce", torch.ones(1), group=dist.new_group([0]))
    on_a_group.iteration_begins()
    joiner = BetweenCalls()
    joiner.replay(on_a_group.before_open_iteration())
    call(joiner, "all_reduce", torch.ones(1))
    assert joiner.end_replay() == ("the script's all_reduce between iterations was on a group "
                                   "of its own")

    assert BetweenCalls().missed([]) is None
    assert BetweenCalls().missed(record) == ("the script's 4 collective(s) before the joiner's "
                                             "first iteration ran while it was built, locally")


def test_an_engine_call_between_iterations_is_not_recorded(world):
    """A checkpoint save's or an evaluation's collectives are the engine's: a joiner's script
    skips those calls while it catches up."""
    between = BetweenCalls()
    between.iteration_ended()
    with between.paused():
        call(between, "barrier")
    call(between, "all_reduce", torch.ones(1))
    between.iteration_begins()
    assert [entry.name for entry in between.before_open_iteration()] == ["all_reduce"]
