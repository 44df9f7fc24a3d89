#!/usr/bin/env python
"""Benchmark: what the peer copy costs an unmodified DeepSpeed data-parallel script, ZeRO-1 to 3.

With ``"peer_copy": true`` in the ``"resilience"`` block, after every step each rank sends its
ZeRO optimizer shard (fp32 partition and Adam moments; at stage 3 too, where the parameters'
partition follows from the fp32 one) to the next rank of its data-parallel group, which
keeps it in host memory, so that a lost rank's shard can be taken from there instead of
restarting the job. The same failure-free job (tests/support/scripts/ds_dp_train.py: a user's
data-parallel script, DP4 on 4 CPU processes, two accumulation steps) runs under
``mover-launch`` with the block, with the copy on and off, at ZeRO stage 1, 2 and 3 (stage 3
keeping parameters of up to 100 elements whole, as in the tests), interleaved,
``--repeats`` times each. Printed per run: the median step time (the launcher's summary); then
per stage the medians, ``STEP_TIME_RATIO`` (copy on / off, the baseline measured in the same
run), the host memory each rank spends on the copy (the packed own shard and the held copy of
its peer's, as the workers report at their end) and the time each rank's training thread spent
in the exchange per step. Every run of a stage must end with the same PARAMS_DIGEST.

Usage::

    python bench/ds_peer_copy_cost.py --repeats 3 --steps 30 [--stages 1,2,3]
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from common import (
    add_out_argument,
    benchmark_parser,
    interleaved_in,
    joined,
    new_out_folder,
    percent_more,
)
from jobs import ROOT, mover_launch_command, read_events, run_job, summary_with_digest

SCRIPT = str(ROOT / "tests" / "support" / "scripts" / "ds_dp_train.py")
CONFIG = ROOT / "examples" / "ds_config.json"
STAGES = (1, 2, 3)
ZERO_SETTINGS = {3: {"stage3_param_persistence_threshold": 100}}
"""Beyond the stage: ZeRO-3 keeps parameters below the threshold (10^5 elements by default,
every parameter of this tiny model) whole on every rank; 100 keeps the biases and norms so
and partitions the matrices."""


def main() -> None:
    parser = benchmark_parser(__doc__, repeats=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--stages", default=",".join(map(str, STAGES)),
                        help="the ZeRO stages to run, comma-separated (default: %(default)s)")
    add_out_argument(parser, "ds-peer-copy-cost")
    args = parser.parse_args()
    stages = parse_stages(parser, args.stages)
    out = new_out_folder(args.out)
    out.mkdir(parents=True)
    configs = {}
    for stage in stages:
        for copy in (True, False):
            path = out / f"zero{stage}-{'copy' if copy else 'no-copy'}.json"
            path.write_text(json.dumps({**json.loads(CONFIG.read_text()),
                                        "zero_optimization": {"stage": stage,
                                                              **ZERO_SETTINGS.get(stage, {})},
                                        "resilience": {"standbys": 1, "peer_copy": copy}}))
            configs[path.stem] = path
    runs = interleaved_in(out, list(configs), args.repeats,
                          lambda mode, folder: run(folder, configs[mode], args.steps),
                          lambda r: f"median step {r['step_s'] * 1000:.2f} ms")
    for stage in stages:
        report(stage, runs[f"zero{stage}-copy"], runs[f"zero{stage}-no-copy"])


def run(folder: Path, config: Path, steps: int) -> dict:
    command = mover_launch_command(folder, 4, "--stop-grace-s", "2")
    result = run_job([*command, SCRIPT, "--steps", str(steps), "--deepspeed_config",
                      str(config)], f"the job with {config.name} failed")
    summary = summary_with_digest(folder, result)
    copies = [e for e in read_events(folder) if e["event"] == "peer_copy"]
    return {"digest": summary["digest"], "step_s": summary["median_step_time_s"],
            "bytes": {e["rank"]: e["bytes"] for e in copies},
            "copy_s": {e["rank"]: e["critical_s"] / e["exchanges"] for e in copies
                       if e["exchanges"]}}


def parse_stages(parser: Any, value: str) -> list[int]:
    try:
        stages = [int(item) for item in value.split(",")]
    except ValueError:
        stages = []
    if not stages or any(stage not in STAGES for stage in stages):
        parser.error(f"--stages {value!r}: give ZeRO stages among {list(STAGES)}, "
                     "comma-separated")
    return stages


def report(stage: int, copy: list[dict], no_copy: list[dict]) -> None:
    if len({r["digest"] for r in copy + no_copy}) != 1:
        raise SystemExit(f"ZeRO-{stage}: runs with and without the copy ended with different "
                         "parameters")
    on = statistics.median(r["step_s"] for r in copy)
    off = statistics.median(r["step_s"] for r in no_copy)
    print(f"\nZeRO-{stage}: step time median with the copy {on * 1000:.2f} ms "
          f"({joined((r['step_s'] * 1000 for r in copy), '.2f')}), without "
          f"{off * 1000:.2f} ms ({joined((r['step_s'] * 1000 for r in no_copy), '.2f')})")
    print(f"STEP_TIME_RATIO zero{stage} copy/no-copy {on / off:.4f} "
          f"({percent_more(on, off):+.2f} %)")
    per_rank = {rank: max(r["bytes"].get(rank, 0) for r in copy) for rank in range(4)}
    print(f"PEER_COPY_HOST_BYTES zero{stage} "
          + ", ".join(f"rank {rank}: {size}" for rank, size in per_rank.items()))
    in_copy = [1000 * statistics.median(r["copy_s"].values()) for r in copy if r["copy_s"]]
    print(f"zero{stage}: {joined(in_copy, '.3f')} ms per step in the exchange (median rank, "
          f"per run); no-copy runs reported a copy: {any(r['bytes'] for r in no_copy)}")


if __name__ == "__main__":
    main()
