"""The global random-number streams (mover_plugin.runtime.random_streams): captured and restored,
and carried as a fixed-size byte tensor."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from mover_plugin.runtime.random_streams import (
    PACKED_BYTES,
    RandomStreams,
    StreamsError,
    empty_packed,
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
