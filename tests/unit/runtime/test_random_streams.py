"""The global random-number streams (mover_plugin.runtime.random_streams): captured and restored,
and carried as a fixed-size byte tensor."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, WeightedRandomSampler

from mover_plugin.runtime.random_streams import (
    LOADER_SEEDS,
    LOADER_SEEDS_KEPT,
    PACKED_BYTES,
    LoaderSeeds,
    RandomStreams,
    StreamsError,
    empty_packed,
    loader_draws_from_streams,
)


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(4).tolist()


def test_restored_streams_draw_again_what_they_drew_after_the_capture():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    streams = RandomStreams.capture()
    first = draws()
    assert draws() != first
    streams.restore()
    assert draws() == first
    streams.restore()  # a snapshot restored twice (an iteration dropped twice)
    assert draws() == first


def test_streams_unpacked_from_their_bytes_equal_the_captured_ones():
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    random.gauss(0, 1), np.random.standard_normal()  # a cached Gaussian in both
    packed = RandomStreams.capture().packed()
    expected = draws()
    assert packed.dtype == torch.uint8 and packed.numel() == PACKED_BYTES
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    received = empty_packed()
    received.copy_(packed)
    RandomStreams.unpacked(received).restore()
    assert draws() == expected


def test_a_buffer_nothing_was_received_into_is_refused():
    with pytest.raises(StreamsError, match="holds no random-number streams"):
        RandomStreams.unpacked(empty_packed())


def test_streams_are_the_same_until_any_one_of_them_draws():
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    streams = RandomStreams.capture()
    assert streams.same_as(RandomStreams.capture())
    assert streams.same_as(RandomStreams.unpacked(streams.packed()))
    for draw in (random.random, np.random.rand, lambda: torch.rand(1)):
        streams.restore()
        draw()
        assert not streams.same_as(RandomStreams.capture())


class SeededPerEpoch(RandomSampler):
    """A subclass that seeds itself (as Accelerate's ``SeedableRandomSampler``)."""


@pytest.mark.parametrize("loader, reason", [
    (DataLoader(range(8)), None),
    (DataLoader(range(8), shuffle=True, generator=torch.Generator()), None),
    (DataLoader(range(8), num_workers=2, generator=torch.Generator()), None),
    (DataLoader(range(8), sampler=SequentialSampler(range(8)), num_workers=0), None),
    (DataLoader(range(8), shuffle=True), "the order of its RandomSampler"),
    (DataLoader(range(8), sampler=WeightedRandomSampler([1.0] * 8, 8)),
     "the order of its WeightedRandomSampler"),
    (DataLoader(range(8), num_workers=2), "its worker processes' seeds (2)"),
    (DataLoader(range(8), num_workers=1, sampler=RandomSampler(range(8))),
     "its worker processes' seeds (1) and the order of its RandomSampler"),
    (DataLoader(range(8), sampler=SeededPerEpoch(range(8))), None),
], ids=["sequential", "own-generator", "workers-own-generator", "sampler-given", "shuffled",
        "weighted", "workers", "workers-and-shuffled", "subclass"])
def test_a_loader_draws_from_the_streams_what_its_seeds_or_generators_do_not_fix(loader, reason):
    """What a new iterator of a DataLoader draws from the global streams that shapes its data:
    its workers' seeds (unless the loader has a generator) and a random sampler's order
    (unless the sampler has one)."""
    assert loader_draws_from_streams(loader) == reason


def made(seeds: LoaderSeeds, loader: DataLoader) -> tuple[int, bool]:
    """An iterator of ``loader`` made and recorded as the drop-in's hook does: its base seed,
    and whether it was given one."""
    iterator = iter(loader)
    given = seeds.made_iterator(iterator)
    return iterator._base_seed, given


def test_a_joiner_s_iterators_take_the_replaced_rank_s_seeds_in_the_order_it_made_them():
    loader = DataLoader(range(8))
    torch.manual_seed(1)
    lost = LoaderSeeds()
    lost_seeds = [made(lost, loader)[0] for _ in range(3)]
    assert lost.recorded() == tuple(enumerate(lost_seeds)) and lost.made == 3
    torch.manual_seed(2)  # the joiner's own streams: other seeds
    joiner = LoaderSeeds()
    first, given = made(joiner, loader)  # made before it joined: its own
    assert not given and first != lost_seeds[0]
    joiner.give(lost.recorded())  # only the places not made yet are taken
    assert [made(joiner, loader) for _ in range(2)] == [(lost_seeds[1], True),
                                                        (lost_seeds[2], True)]
    fourth, given = made(joiner, loader)  # beyond what the lost rank made: its own draw
    assert not given and joiner.recorded()[-1] == (3, fourth)


def test_the_streams_carry_the_last_loader_seeds_and_a_restore_leaves_them_alone():
    seeds = LoaderSeeds()
    for _ in range(LOADER_SEEDS_KEPT + 2):
        made(seeds, DataLoader(range(4)))
    kept = seeds.recorded()
    assert len(kept) == LOADER_SEEDS_KEPT and kept[0][0] == 2
    streams = dataclasses.replace(RandomStreams.capture(), loader_seeds=kept)
    again = RandomStreams.unpacked(streams.packed())
    assert again.loader_seeds == kept and again.same_as(streams)
    process_record = LOADER_SEEDS.recorded()
    again.restore()  # the process's own record is not a stream
    assert LOADER_SEEDS.recorded() == process_record
    seeds.forget()
    assert seeds.made == 0 and seeds.recorded() == ()
