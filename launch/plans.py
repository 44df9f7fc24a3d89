"""``mover templates``: the pipeline templates and instantiations planned for a job, printed.

::

    mover templates --hosts 1024 --pipeline-size 16 --num-layers 96 --global-batch-size 4096
    mover templates --hosts 3 --pipeline-size 2 --profile profile.json --fault-tolerance 1

The per-layer profile comes from ``--profile FILE`` (JSON: ``host_memory_bytes`` and
``layers``, each with ``name``, ``forward_s``, ``backward_s``, ``static_bytes`` and
``activation_bytes`` for one micro-batch on one host), or, for a first look before anything was
measured, from a GPT-like model of ``--num-layers`` equal transformer layers plus the embedding
and output layers (:func:`mover_plugin.templates.transformer_profile`). It prints a template
for every host count up to the pipeline size that has one, then the
instantiation for ``--hosts`` and for every loss of up to ``--fault-tolerance`` hosts; a
fault tolerance that the hosts cannot meet is one error line (exit status 2). What the planner
optimises is in :mod:`mover_plugin.templates`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mover_plugin.errors import ConfigError
from mover_plugin.launch.flag_types import non_negative_int, positive_int
from mover_plugin.templates import (
    Instantiation,
    Profile,
    Template,
    check_fault_tolerance,
    load_profile,
    plan_templates,
    transformer_profile,
)

GIB = 1 << 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--hosts", type=positive_int, required=True,
                        help="hosts the job trains on (each a pipeline stage)")
    parser.add_argument("--pipeline-size", type=positive_int, required=True,
                        help="the job's pipeline-parallel size: the longest template")
    parser.add_argument("--fault-tolerance", type=non_negative_int, default=1,
                        help="hosts lost at once that must leave a whole pipeline (default 1)")
    parser.add_argument("--global-batch-size", type=positive_int, required=True)
    parser.add_argument("--micro-batch-size", type=positive_int, default=1)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--profile", type=Path, help="a measured per-layer profile (JSON)")
    source.add_argument("--num-layers", type=positive_int,
                        help="plan a GPT-like model of this many transformer layers")
    parser.add_argument("--layer-ms", type=float, default=10.0,
                        help="with --num-layers: a layer's forward and backward time per "
                        "micro-batch (default 10)")
    parser.add_argument("--layer-gib", type=float, default=2.0,
                        help="with --num-layers: a layer's parameters, gradients and optimizer "
                        "state (default 2)")
    parser.add_argument("--activation-gib", type=float, default=0.25,
                        help="with --num-layers: a layer's activations per micro-batch "
                        "(default 0.25)")
    parser.add_argument("--host-gib", type=float, default=80.0,
                        help="with --num-layers: memory of one host (default 80)")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The templates and instantiations as a JSON-ready dict; raises ConfigError on bad input
    or when no plan meets the fault tolerance."""
    if args.global_batch_size % args.micro_batch_size:
        raise ConfigError(f"--global-batch-size {args.global_batch_size} is not a multiple of "
                          f"--micro-batch-size {args.micro_batch_size}")
    profile = load_profile(args.profile) if args.profile else transformer_profile(
        args.num_layers, layer_s=args.layer_ms / 1000, layer_bytes=int(args.layer_gib * GIB),
        activation_bytes=int(args.activation_gib * GIB),
        host_memory_bytes=int(args.host_gib * GIB))
    microbatches = args.global_batch_size // args.micro_batch_size
    templates = plan_templates(profile, args.pipeline_size)
    plans = check_fault_tolerance(templates, args.hosts, microbatches, args.fault_tolerance)
    return {"layers": len(profile.layers), "microbatches": microbatches,
            "fault_tolerance": args.fault_tolerance,
            "templates": [_template(t, profile) for t in templates.values()],
            "plans": [_plan(plans[h]) for h in sorted(plans, reverse=True)]}


def describe(result: dict[str, Any]) -> str:
    lines = [f"templates ({result['layers']} layers, 1F1B; a stage is one host):",
             f"{'hosts':>6}  {'slowest stage':>13}  layers per stage"]
    for template in result["templates"]:
        lines.append(f"{template['hosts']:>6}  {template['bottleneck_s'] * 1000:>10.1f} ms  "
                     + " ".join(str(n) for n in template["layers_per_stage"]))
    for plan in result["plans"]:
        kinds: dict[tuple[int, int], int] = {}
        for pipeline in plan["pipelines"]:
            key = (pipeline["hosts"], pipeline["microbatches"])
            kinds[key] = kinds.get(key, 0) + 1
        parts = ", ".join(f"{count} x {hosts} hosts with {batches} micro-batches"
                          for (hosts, batches), count in kinds.items())
        lines.append(f"{plan['hosts']} hosts: {len(plan['pipelines'])} pipeline(s) ({parts}); "
                     f"iteration {plan['iteration_s']:.3f} s, "
                     f"{plan['microbatches_per_s']:.1f} micro-batches/s")
    return "\n".join(lines)


def _template(template: Template, profile: Profile) -> dict[str, Any]:
    return {"hosts": template.hosts, "bottleneck_s": template.bottleneck_s,
            "stages": [[a, b] for a, b in template.stages],
            "layers_per_stage": [b - a for a, b in template.stages],
            "first_layers": [profile.layers[a].name for a, _ in template.stages]}


def _plan(plan: Instantiation) -> dict[str, Any]:
    return {"hosts": plan.hosts, "iteration_s": plan.iteration_s,
            "microbatches_per_s": plan.throughput,
            "pipelines": [{"hosts": t.hosts, "microbatches": m}
                          for t, m in zip(plan.pipelines, plan.microbatches)]}
