"""argparse types of ``mover-launch``'s flags, and a parser that raises instead of exiting.

Each type names the bad value and what is valid."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence

from mover_plugin.errors import ConfigError


class ErrorRaisingParser(argparse.ArgumentParser):
    """Raises :class:`ConfigError` instead of printing usage and exiting."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(message)


def positive_int(text: str) -> int:
    """argparse type: an integer of 1 or more."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def non_negative_int(text: str) -> int:
    """argparse type: an integer of 0 or more."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def port_number(text: str) -> int:
    """argparse type of a TCP port (0: any free port)."""
    if not text.isdigit() or int(text) > 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0..65535)")
    return int(text)


def _number(text: str, valid: Callable[[float], bool], what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")  # valid for no check
    if not valid(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def factor_above_one(text: str) -> float:
    """argparse type: a number above 1 (a multiple of a median)."""
    return _number(text, lambda value: value > 1,
                   "a number above 1 (a multiple of the median busy time)")


def positive_float(text: str) -> float:
    """argparse type: seconds above 0."""
    return _number(text, lambda value: value > 0, "a positive number of seconds")


def non_negative_float(text: str) -> float:
    """argparse type: seconds of 0 or more."""
    return _number(text, lambda value: value >= 0, "a number of seconds of at least 0")


def choice(flag: str, choices: Sequence[str]) -> Callable[[str], str]:
    """argparse type accepting one of ``choices`` (``flag`` names the flag in the error)."""
    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not a valid {flag}; valid: {', '.join(choices)}"
            )
        return text

    return check
