"""The ring copy of optimizer shards (mover_plugin.runtime.peer_copy): two ranks in two threads
of this process, over real gloo pair groups rendezvousing in a real TCPStore."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
from torch.distributed import TCPStore

from mover_plugin.runtime.peer_copy import PeerCopy, ring_neighbours, shard_dtype

TIMEOUT = timedelta(seconds=30)


@pytest.fixture
def stores():
    """One client of the same store per rank (a store client is not shared across threads)."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=TIMEOUT)
    return {0: server, 1: client}


def in_threads(*calls):
    """Runs each call in a thread of its own (each opens groups the other must join)."""
    errors: list[BaseException] = []

    def run(call):
        try:
            call()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), "a rank did not finish"
    if errors:
        raise errors[0]


def test_each_rank_keeps_the_previous_ranks_shard_of_its_own_size(stores):
    shards = {0: [torch.arange(5.0), torch.full((2, 3), 7.0)],
              1: [torch.arange(4.0) * -1, torch.ones(3), torch.full((1,), 2.5)]}
    copies = {rank: PeerCopy(stores[rank], rank, TIMEOUT) for rank in shards}
    in_threads(*(lambda r=rank: copies[r].refresh(shards[r], 3, 0, (1 - r, 1 - r))
                 for rank in shards))
    for rank, copy in copies.items():
        copy.settle()
        other = 1 - rank
        assert (copy.held_of, copy.held_version) == (other, 3)
        (held,) = copy.held()
        assert torch.equal(held, torch.cat([t.reshape(-1) for t in shards[other]]))
        # The packed own shard and the copy of the other's.
        assert copy.nbytes == 4 * (sum(t.numel() for t in shards[rank])
                                   + sum(t.numel() for t in shards[other]))
    # The shard changes in place after the next update; the next exchange sends the new one,
    # over the groups already open.
    for tensor in shards[1]:
        tensor.add_(1.0)
    in_threads(*(lambda r=rank: copies[r].refresh(shards[r], 4, 0, (1 - r, 1 - r))
                 for rank in shards))
    copies[0].settle()
    assert copies[0].held_version == 4
    assert torch.equal(copies[0].held()[0], torch.cat([t.reshape(-1) for t in shards[1]]))
    for copy in copies.values():
        copy.close()


def test_a_shard_that_grows_within_a_generation_is_copied_whole(stores):
    """An optimizer creates its state at the first update it applies (with fp16, after
    skipped ones): every rank's shard grows at the same step, the ring learns the new sizes
    over its open groups and the copy holds the whole new shard."""
    mains = {0: torch.arange(4.0), 1: torch.arange(3.0) + 10}
    shards = {rank: [main] for rank, main in mains.items()}
    copies = {rank: PeerCopy(stores[rank], rank, TIMEOUT) for rank in shards}
    for version in (1, 2):
        in_threads(*(lambda r=rank: copies[r].refresh(shards[r], version, 0, (1 - r, 1 - r))
                     for rank in shards))
        for copy in copies.values():
            copy.settle()
        for rank in shards:
            other = 1 - rank
            assert copies[rank].held_version == version
            assert torch.equal(copies[rank].held()[0],
                               torch.cat([t.reshape(-1) for t in shards[other]]))
        # The first applied update creates each rank's moments.
        shards = {rank: [main, main * 0.5, main * 0.25] for rank, main in mains.items()}
    for copy in copies.values():
        copy.close()


def test_a_side_record_travels_after_the_shard_in_the_same_buffer(stores):
    """Bytes of a size that is no multiple of the shard's element size: the copy holds the
    shard, then exactly the side record, and both change at the next exchange."""
    shards = {0: [torch.arange(6.0)], 1: [torch.arange(3.0) + 10]}
    sides = {0: torch.arange(7, dtype=torch.uint8), 1: torch.arange(7, dtype=torch.uint8) + 100}
    copies = {rank: PeerCopy(stores[rank], rank, TIMEOUT) for rank in shards}
    for version in (1, 2):
        in_threads(*(lambda r=rank: copies[r].refresh(shards[r], version, 0, (1 - r, 1 - r),
                                                      side=sides[r]) for rank in shards))
        for rank, copy in copies.items():
            copy.settle()
            shard, side = copy.held()
            assert torch.equal(shard, shards[1 - rank][0])
            assert side.dtype == torch.uint8 and torch.equal(side, sides[1 - rank])
        for rank in shards:
            shards[rank][0].mul_(-1)
            sides[rank].add_(1)
    # 2 bytes of padding round each 7-byte record up to two float32 elements.
    assert copies[0].nbytes == 4 * (6 + 2) + 4 * (3 + 2)
    for copy in copies.values():
        copy.close()


def test_a_copy_in_flight_when_its_sender_goes_is_marked_missing(stores):
    shards = {0: [torch.arange(6.0)], 1: [torch.arange(6.0) + 100]}
    copies = {rank: PeerCopy(stores[rank], rank, TIMEOUT) for rank in shards}
    in_threads(*(lambda r=rank: copies[r].refresh(shards[r], 1, 0, (1 - r, 1 - r))
                 for rank in shards))
    for copy in copies.values():
        copy.settle()
    # Rank 1 is gone before it sends the next version: rank 0's exchange ends with an error.
    copies[1].close()
    copies[0].refresh(shards[0], 2, 0, (1, 1))
    copies[0].settle()
    assert (copies[0].held_of, copies[0].held_version) == (-1, -1)
    copies[0].close()


def test_a_rank_without_a_data_parallel_peer_keeps_no_copy(stores):
    copy = PeerCopy(stores[0], 0, TIMEOUT)
    copy.refresh([torch.ones(3)], 1, 0, (0, 0))
    copy.settle()
    assert (copy.held_of, copy.held_version, copy.nbytes) == (-1, -1, 0)


def test_a_shard_of_mixed_dtypes_is_refused_with_the_dtypes_named():
    with pytest.raises(TypeError, match=r"mixes dtypes \['torch.bfloat16', 'torch.float32'\]"):
        shard_dtype([torch.ones(2), torch.ones(2, dtype=torch.bfloat16)])


def test_a_ring_sends_to_the_next_rank_and_keeps_the_previous_ones_copy():
    assert ring_neighbours([1, 3, 5], 1) == (3, 5)
    assert ring_neighbours([1, 3, 5], 5) == (1, 3)
    assert ring_neighbours([0, 2], 2) == (0, 0)
