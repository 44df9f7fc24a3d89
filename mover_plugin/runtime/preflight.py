"""The script side of ``mover-launch``'s flag check (see ``mover_plugin.launch.preflight``).

A training script parses its flags through :func:`checked_or_exit`: bad input gives one error
line and exit code 2; with ``MOVER_PREFLIGHT=1`` (the launcher's check run, before any worker
starts) the outcome is reported in the form the launcher reads and the script exits either way.
This module imports no framework.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

from mover_plugin.contract import PREFLIGHT_ENV, PREFLIGHT_ERROR, PREFLIGHT_OK
from mover_plugin.errors import ConfigError

Parsed = TypeVar("Parsed")


def checked_or_exit(parse: Callable[[], Parsed]) -> Parsed:
    """``parse()``'s result; on :class:`ConfigError` one error line on stderr and exit 2."""
    preflight = os.environ.get(PREFLIGHT_ENV) == "1"
    try:
        parsed = parse()
    except ConfigError as error:
        prefix = f"{PREFLIGHT_ERROR}: " if preflight else "error: "
        print(f"{prefix}{error}", file=sys.stderr)
        sys.exit(2)
    if preflight:
        print(PREFLIGHT_OK, flush=True)
        sys.exit(0)
    return parsed
