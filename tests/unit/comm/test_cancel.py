"""The cancel check of mover_plugin.comm.cancel: the waits of group construction give up when
the generation being built is superseded, and only inside cancel_when."""

import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import pytest
import torch.distributed as dist

from mover_plugin.comm import retired
from mover_plugin.comm.cancel import (
    BuildCancelled,
    cancel_when,
    cancellable,
    raise_if_cancelled,
    wait_for_keys,
)
from mover_plugin.comm.delta import agree_on_idle
from mover_plugin.comm.errors import CollectiveAborted
from mover_plugin.comm.process_group import MoverProcessGroup


def superseded_after(seconds: float):
    deadline = time.monotonic() + seconds
    return lambda: "generation 1 was superseded" if time.monotonic() > deadline else None


def test_a_wait_for_keys_gives_up_when_the_check_names_a_reason():
    store = dist.HashStore()
    started = time.monotonic()
    with cancel_when(superseded_after(0.2)):
        assert cancellable()
        with pytest.raises(BuildCancelled, match="generation 1 was superseded") as raised:
            wait_for_keys(store, ["idle/7/3"], timedelta(seconds=30))
    assert 0.2 <= time.monotonic() - started < 5
    assert isinstance(raised.value, CollectiveAborted)  # a lost peer to the runtime
    assert raised.value.reason == "generation 1 was superseded"
    assert not cancellable()


def test_a_wait_for_keys_returns_when_the_keys_come_and_the_check_stays_silent():
    store = dist.HashStore()
    store.set("idle/7/3", "1")
    with cancel_when(lambda: None):
        wait_for_keys(store, ["idle/7/3"], timedelta(seconds=5))
        raise_if_cancelled()


def test_outside_cancel_when_the_wait_is_the_stores_own():
    store = dist.HashStore()
    with pytest.raises(dist.DistStoreError):
        wait_for_keys(store, ["never"], timedelta(milliseconds=200))
    raise_if_cancelled()  # no check installed: nothing to raise


def test_a_group_whose_peer_never_comes_is_given_up_and_its_backend_kept():
    """Rank 0 of a two-rank group alone: its first connection waits for rank 1's address in
    a gloo thread; the check cancels the construction, and the backend, still waiting, is
    retired rather than destroyed (which would join that thread)."""
    held_before = retired.held()
    started = time.monotonic()
    with cancel_when(superseded_after(0.3)):
        with pytest.raises(BuildCancelled):
            MoverProcessGroup(dist.HashStore(), 0, 2, timedelta(seconds=30), group_name="7",
                              global_ranks=[0, 3])
    assert time.monotonic() - started < 5
    assert retired.held() == held_before + 1


def test_the_members_of_a_group_agree_it_is_idle_only_if_every_one_says_so():
    store = dist.HashStore()
    members = [0, 1, 2]
    answers = {0: {"dp": True, "tp": True}, 1: {"dp": True, "tp": False}, 2: {"dp": True,
                                                                             "tp": True}}

    def agree(rank):
        groups = {name: (idle, members) for name, idle in answers[rank].items()}
        return agree_on_idle(store, groups, timeout=timedelta(seconds=10))
    with ThreadPoolExecutor(3) as pool:
        verdicts = list(pool.map(agree, members))
    assert verdicts == [["tp"], ["tp"], ["tp"]]
