"""What the benchmarks share: interleaved repetitions of several modes, and the check that
every run ended with the same parameters."""

from __future__ import annotations

import argparse
from typing import Callable, Sequence


def repeats_argument(doc: str, default: int) -> argparse.Namespace:
    """Parses ``--repeats`` (runs of each mode) for a benchmark described by ``doc``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=default)
    args = parser.parse_args()
    if args.repeats < 1:
        raise SystemExit(f"--repeats {args.repeats} must be at least 1")
    return args


def interleaved(modes: Sequence[str], repeats: int, run: Callable[[str, int], dict],
                describe: Callable[[dict], str]) -> dict[str, list[dict]]:
    """Runs ``run(mode, repeat)`` for every mode in turn, ``repeats`` times, printing
    ``describe(result)`` after each; returns the results by mode. The order of the modes is
    reversed every other repeat, so that neither always runs first (on a shared machine the
    first and second run of a pair can differ by 10 % or more)."""
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for repeat in range(repeats):
        for mode in (modes if repeat % 2 == 0 else list(reversed(modes))):
            result = run(mode, repeat)
            runs[mode].append(result)
            print(f"{mode} run {repeat}: {describe(result)}", flush=True)
    return runs


def check_same_digest(runs: dict[str, list[dict]]) -> None:
    """Stops the benchmark unless every run's ``digest`` (its PARAMS_DIGEST) is the same."""
    digests = {result["digest"] for results in runs.values() for result in results}
    if len(digests) != 1:
        raise SystemExit(f"PARAMS_DIGEST differs between runs: {sorted(digests)}")
    count = sum(len(results) for results in runs.values())
    print(f"all {count} runs end with the same PARAMS_DIGEST")
