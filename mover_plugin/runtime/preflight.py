"""The script side of ``mover-launch``'s flag check (see ``mover_plugin.launch.preflight``).

A training script parses its flags through :func:`checked_or_exit`: bad input gives one error
line and exit code 2; with ``MOVER_PREFLIGHT=1`` (the launcher's check run, before any worker
starts) the outcome is reported in the form the launcher reads and the script exits either way:
a line ``MOVER_PREFLIGHT_OK resilient=0|1`` on stdout (whether the script will run under the
resilience runtime), or ``MOVER_PREFLIGHT_ERROR: <message>`` on stderr and exit code 2.
This module imports no framework.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, NoReturn, TypeVar

from mover_plugin.contract import PREFLIGHT_ENV, PREFLIGHT_ERROR, PREFLIGHT_OK
from mover_plugin.errors import ConfigError

Parsed = TypeVar("Parsed")


def in_preflight() -> bool:
    """Whether this process is the launcher's check run."""
    return os.environ.get(PREFLIGHT_ENV) == "1"


def runs_resilient(parsed: Any) -> bool:
    """Whether parsed flags enable the resilience runtime (``args.resilience.enabled``)."""
    settings = getattr(parsed, "resilience", None)
    return bool(getattr(settings, "enabled", False))


def exit_with_error(message: object) -> NoReturn:
    """One error line (in the launcher's form during a check run) and exit code 2."""
    prefix = f"{PREFLIGHT_ERROR}: " if in_preflight() else "error: "
    print(f"{prefix}{message}", file=sys.stderr, flush=True)
    sys.exit(2)


def exit_checked(resilient: bool) -> NoReturn:
    """Ends a check run whose flags are good."""
    print(f"{PREFLIGHT_OK} resilient={int(resilient)}", flush=True)
    sys.exit(0)


def checked_or_exit(parse: Callable[[], Parsed]) -> Parsed:
    """``parse()``'s result; on :class:`ConfigError` one error line on stderr and exit 2."""
    try:
        parsed = parse()
    except ConfigError as error:
        exit_with_error(error)
    if in_preflight():
        exit_checked(runs_resilient(parsed))
    return parsed
