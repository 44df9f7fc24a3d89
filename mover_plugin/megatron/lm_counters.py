"""Megatron-LM's own place in the training, kept in ``args``: what a joiner takes from the rank
that hands it its state, besides the model, optimizer and schedule."""

from __future__ import annotations

import argparse
from typing import Any

COUNTERS = ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples")
"""Megatron-LM's data counters in ``args``, handed to a joiner with the iteration."""
DATA_FLAGS = ("do_train", "do_valid", "do_test")
"""What Megatron-LM's data set-up decides on the first rank and broadcasts to every rank; a
joiner builds its data iterators with local collectives, so it gets them from its twin (a
rank that builds no data loader itself, such as tensor-parallel rank 1, would otherwise skip
training and exit)."""


def counters(args: argparse.Namespace) -> dict[str, Any]:
    """The data counters now."""
    return {name: getattr(args, name) for name in COUNTERS}


def data_flags(args: argparse.Namespace) -> dict[str, bool]:
    """The data flags now."""
    return {name: bool(getattr(args, name, False)) for name in DATA_FLAGS}


def loop_state(args: argparse.Namespace) -> dict[str, Any]:
    """The counters and data flags now, as :func:`load_loop_state` takes them."""
    return {"counters": counters(args), "data_flags": data_flags(args)}


def load_loop_state(args: argparse.Namespace, state: dict[str, Any]) -> None:
    """Sets the counters and data flags of ``state`` (see :func:`loop_state`) in ``args``."""
    for name, value in {**state["counters"], **state["data_flags"]}.items():
        setattr(args, name, value)
