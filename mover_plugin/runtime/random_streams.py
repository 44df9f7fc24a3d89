"""A process's global random-number streams, captured, restored, and carried as bytes.

Dropout, data augmentation and samplers without a generator of their own draw from four global
streams: Python's ``random``, NumPy's global state, torch's CPU generator and, with CUDA, the
current GPU's default generator. :class:`RandomStreams` holds all four. A redone iteration
starts from the streams captured when it began; a joiner continues from the streams of the rank
it replaces, which a live process carries for it: a leaver hands over its own, and with the peer
copy each rank's streams travel with its optimizer shard after every step
(:mod:`mover_plugin.runtime.peer_copy`). Only the current GPU's generator is kept: the process
that restores it may own another device index than the one that captured it.

What cannot be carried is a generator object a script makes for itself
(``torch.Generator()``, ``np.random.default_rng()``): a sampler seeded with ``seed + epoch``
draws the same again, one that keeps drawing from its own generator does not. Nor what a
joiner's script draws while it catches up through steps the job trained: its streams become
the replaced rank's only at the end. A data loader's iterator it makes on the way (a new epoch)
would seed its worker processes from them; :class:`LoaderSeeds` gives it the replaced rank's
seed instead, since the streams carry the base seeds of the last iterators each process made.
A random sampler without a generator of its own still draws its order from the joiner's
streams (:func:`loader_draws_from_streams` tells which loaders draw what).
"""

from __future__ import annotations

import pickle
import random
import struct
from collections import deque
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from mover_plugin.errors import MoverError

PACKED_BYTES = 16384
"""Size of :meth:`RandomStreams.packed`: the four streams take about 12 KiB."""

LOADER_SEEDS_KEPT = 64
"""How many of the last data loader iterators' base seeds the streams carry."""

_LENGTH = struct.Struct("<I")
_RANDOM_SAMPLERS = (RandomSampler, SubsetRandomSampler, WeightedRandomSampler)
"""torch's samplers that draw their order from their ``generator``, or from torch's CPU
stream when it is None (a subclass may seed itself: Accelerate's ``SeedableRandomSampler``
draws from ``seed + epoch``)."""


class StreamsError(MoverError, ValueError):
    """Bytes that do not hold random-number streams."""


@dataclass(frozen=True)
class RandomStreams:
    """The global random-number streams of a process (module docstring)."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: torch.Tensor
    cuda: Optional[torch.Tensor]
    """The current GPU's default generator; None without CUDA."""
    loader_seeds: tuple[tuple[int, int], ...] = ()
    """(order of making, base seed) of the last data loader iterators the process made
    (:data:`LOADER_SEEDS`)."""

    @classmethod
    def capture(cls) -> "RandomStreams":
        cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(), cuda,
                   LOADER_SEEDS.recorded())

    def restore(self) -> None:
        """Puts every stream back to where it was captured (this object stays unchanged: a
        snapshot may be restored again). The loader seeds are not streams: a joiner gives
        them with :meth:`LoaderSeeds.give`."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda)

    def same_as(self, other: "RandomStreams") -> bool:
        """Whether both hold the same state of every stream."""
        name, keys, *rest = self.numpy
        other_name, other_keys, *other_rest = other.numpy
        return (self.python == other.python and name == other_name
                and np.array_equal(keys, other_keys) and rest == other_rest
                and torch.equal(self.torch_cpu, other.torch_cpu)
                and _same_optional(self.cuda, other.cuda))

    def packed(self) -> torch.Tensor:
        """The streams as a byte tensor of :data:`PACKED_BYTES` (a fixed size, so that a peer
        can receive them into a buffer made in advance)."""
        data = pickle.dumps((self.python, self.numpy, self.torch_cpu.numpy().tobytes(),
                             None if self.cuda is None else self.cuda.cpu().numpy().tobytes(),
                             self.loader_seeds))
        if _LENGTH.size + len(data) > PACKED_BYTES:
            raise StreamsError(f"random-number streams of {len(data)} bytes do not fit in "
                               f"{PACKED_BYTES}")
        packed = torch.zeros(PACKED_BYTES, dtype=torch.uint8)
        packed[:_LENGTH.size + len(data)] = torch.frombuffer(
            bytearray(_LENGTH.pack(len(data)) + data), dtype=torch.uint8)
        return packed

    @classmethod
    def unpacked(cls, packed: torch.Tensor) -> "RandomStreams":
        """What :meth:`packed` made; :class:`StreamsError` for a buffer that holds none (all
        zeros: nothing was received into it)."""
        raw = packed.cpu().numpy().tobytes()
        (length,) = _LENGTH.unpack_from(raw)
        if length == 0 or _LENGTH.size + length > len(raw):
            raise StreamsError("the buffer holds no random-number streams")
        python, numpy_state, cpu, cuda, loader_seeds = pickle.loads(
            raw[_LENGTH.size:_LENGTH.size + length])
        return cls(python, numpy_state, _bytes_tensor(cpu),
                   None if cuda is None else _bytes_tensor(cuda), loader_seeds)


class LoaderSeeds:
    """The base seeds of the data loader iterators this process made, in the order it made
    them (the seed a ``DataLoader`` iterator draws from the streams, or from the loader's
    generator, and from which it seeds each of its worker processes). A rank records them; a
    joiner is given those of the rank it replaces, and each iterator its script makes again
    (in the same order: the same script) while it catches up takes that rank's seed."""

    def __init__(self) -> None:
        self.made = 0
        self._kept: deque[tuple[int, int]] = deque(maxlen=LOADER_SEEDS_KEPT)
        self._given: dict[int, int] = {}

    def made_iterator(self, iterator: Any) -> bool:
        """``iterator`` was just made (before it starts its workers): it is recorded, with
        the given seed of its place in the order if there is one; returns whether there
        was."""
        order, self.made = self.made, self.made + 1
        given = self._given.pop(order, None)
        if given is not None:
            iterator._base_seed = given
        self._kept.append((order, iterator._base_seed))
        return given is not None

    def recorded(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._kept)

    def give(self, recorded: tuple[tuple[int, int], ...]) -> None:
        """The seeds the iterators made from now on take, by their place in the order."""
        self._given = {order: seed for order, seed in recorded if order >= self.made}

    def forget(self) -> None:
        """Back to no iterator made (a standby's shadow run ended; its script starts over)."""
        self.made = 0
        self._kept.clear()
        self._given.clear()


LOADER_SEEDS = LoaderSeeds()
"""This process's record: :meth:`LoaderSeeds.made_iterator` runs where each iterator is made
(the DeepSpeed drop-in's hook point)."""


def loader_draws_from_streams(loader: Any, *, seeded: bool = False) -> Optional[str]:
    """Why a ``torch.utils.data.DataLoader``'s new iterator draws from the global streams what
    shapes the data it gives (None if it draws nothing that does): its worker processes'
    seeds, unless the loader has a generator of its own or the iterator was ``seeded`` (given
    a base seed: :class:`LoaderSeeds`); the order of a random sampler without one."""
    reasons = []
    if getattr(loader, "num_workers", 0) > 0 and getattr(loader, "generator", None) is None \
            and not seeded:
        reasons.append(f"its worker processes' seeds ({loader.num_workers})")
    sampler = getattr(loader, "sampler", None)
    if type(sampler) in _RANDOM_SAMPLERS and sampler.generator is None:
        reasons.append(f"the order of its {type(sampler).__name__}")
    return " and ".join(reasons) or None


def empty_packed() -> torch.Tensor:
    """A buffer to receive :meth:`RandomStreams.packed` into."""
    return torch.zeros(PACKED_BYTES, dtype=torch.uint8)


def _same_optional(one: Optional[torch.Tensor], other: Optional[torch.Tensor]) -> bool:
    if one is None or other is None:
        return one is other
    return torch.equal(one, other)


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
