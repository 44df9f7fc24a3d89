"""Steps drawn at random for a job test's faults: each run of the suite covers another step, and
the draw is printed (pytest shows it with a failure) with the seed that repeats it."""

from __future__ import annotations

import os
import random
import secrets

SEED_ENV = "MOVER_TEST_SEED"
"""Set to a printed seed to draw the same steps again."""


def drawn_step(what: str, low: int, high: int) -> int:
    """A step from ``low`` to ``high`` (both included) for ``what``, drawn from
    :data:`SEED_ENV` if it is set, else from a fresh seed."""
    if low > high:
        raise ValueError(f"no step from {low} to {high} for {what}")
    seed = int(os.environ.get(SEED_ENV) or secrets.randbits(32))
    step = random.Random(seed).randint(low, high)
    print(f"{what}: step {step}, drawn from {low}..{high} ({SEED_ENV}={seed} draws it again)")
    return step
