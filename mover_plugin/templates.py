"""Pipeline templates: how a job can train on fewer hosts, planned in advance (pure, no torch).

When no standby is left, a job can go on with the hosts it has, in pipelines of different
lengths. This module plans that, from a per-layer profile (forward and backward time and memory
of every layer, the embedding and output layers included) and the memory of a host:

- A *template* for ``n`` hosts is the best split of the layers into ``n`` contiguous stages,
  one host each: the one whose slowest stage is fastest (under 1F1B an iteration of ``m``
  micro-batches takes the sum of the stages' times plus ``m - 1`` times the slowest stage's,
  and the sum does not depend on the split), where every stage fits its host's memory: its
  layers' static memory (parameters, gradients, optimizer state) plus their activations times
  the micro-batches in flight at that stage (``n - s`` at stage ``s`` under 1F1B).
  :func:`plan_templates` makes one for every host count up to the job's pipeline size that
  has a split that fits (usually every count from the smallest that fits the model; a count can
  fail where a smaller one fits, its first stage holding more micro-batches in flight). The split is found by a binary search over the candidate bottlenecks,
  each checked by an exact greedy split (see :func:`_furthest_split`), so a template costs
  O(L² log L) for L layers.
- An *instantiation* for ``H`` hosts (:func:`instantiate`) is a set of at least ``f + 1``
  pipelines, each a template, whose host counts sum to ``H`` exactly: as few pipelines as the
  templates allow (each pipeline more costs gradient traffic and groups), and among those the
  set with the highest throughput (the sum over pipelines of micro-batches per second in steady
  state), and the global batch's micro-batches split among them in whole
  numbers so that the slowest pipeline's iteration is as short as it can be (each next
  micro-batch goes to the pipeline that would finish it first): about in proportion to
  throughput, summing to the global batch. With at least ``f + 1`` pipelines, losing any ``f``
  hosts leaves one pipeline whole: every layer still has a live replica to copy from.
- :func:`check_fault_tolerance` is the check made before a job starts: ``f`` pipelines too many
  for the hosts, or a loss of up to ``f`` hosts after which no instantiation covers the hosts
  left, is an error that names the host counts.

``mover templates`` prints the templates and the instantiation for a job.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy

from mover_plugin.errors import ConfigError


class PlanningError(ConfigError):
    """No template or instantiation exists for what was asked; the message says why."""


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs on one host, per micro-batch."""

    name: str
    forward_s: float
    backward_s: float
    static_bytes: int
    """Parameters, gradients and optimizer state."""
    activation_bytes: int
    """Activations kept for the backward pass of one micro-batch."""

    @property
    def step_s(self) -> float:
        return self.forward_s + self.backward_s


@dataclass(frozen=True)
class Profile:
    layers: tuple[LayerCost, ...]
    host_memory_bytes: int

    def __post_init__(self) -> None:
        if not self.layers:
            raise PlanningError("the profile has no layers")
        for layer in self.layers:
            if min(layer.forward_s, layer.backward_s) < 0 or min(layer.static_bytes,
                                                                 layer.activation_bytes) < 0:
                raise PlanningError(f"layer {layer.name!r} has a negative time or memory")
        if self.host_memory_bytes <= 0:
            raise PlanningError(f"host memory {self.host_memory_bytes} must be positive")


@dataclass(frozen=True)
class Template:
    """The best split of the layers over ``hosts`` stages, one host each."""

    hosts: int
    stages: tuple[tuple[int, int], ...]
    """(first layer, end layer) of each stage: layers ``first .. end - 1``."""
    stage_s: tuple[float, ...]
    """Each stage's forward and backward time per micro-batch."""

    @property
    def bottleneck_s(self) -> float:
        return max(self.stage_s)

    def iteration_s(self, microbatches: int) -> float:
        """One iteration of ``microbatches`` under 1F1B: the pipeline fills, then the slowest
        stage sets the pace."""
        return sum(self.stage_s) + (microbatches - 1) * self.bottleneck_s


@dataclass(frozen=True)
class Instantiation:
    """Pipelines covering ``hosts`` hosts, and each one's share of the global batch."""

    hosts: int
    pipelines: tuple[Template, ...]
    microbatches: tuple[int, ...]

    @property
    def iteration_s(self) -> float:
        return max(t.iteration_s(m) for t, m in zip(self.pipelines, self.microbatches))

    @property
    def throughput(self) -> float:
        """Micro-batches per second of one iteration (the global batch over its time)."""
        return sum(self.microbatches) / self.iteration_s


# -- templates ----------------------------------------------------------------------------------


class _Prefix:
    """Prefix sums of a profile: a stage's time and memory in O(1)."""

    def __init__(self, profile: Profile) -> None:
        self.count = len(profile.layers)
        self.time = [0.0, *itertools.accumulate(l.step_s for l in profile.layers)]
        self.static = [0, *itertools.accumulate(l.static_bytes for l in profile.layers)]
        self.activation = [0, *itertools.accumulate(l.activation_bytes for l in profile.layers)]
        self.memory = profile.host_memory_bytes

    def stage_s(self, first: int, end: int) -> float:
        return self.time[end] - self.time[first]

    def fits(self, first: int, end: int, in_flight: int) -> bool:
        used = (self.static[end] - self.static[first]
                + in_flight * (self.activation[end] - self.activation[first]))
        return used <= self.memory


def _furthest_split(prefix: _Prefix, hosts: int, bottleneck: float) -> Optional[list[int]]:
    """The stage ends of a split into ``hosts`` stages with no stage slower than
    ``bottleneck`` and every stage fitting its host, or None when there is none.

    The stages are laid from the last to the first, each as long as it can be (leaving a
    layer for every stage before it). That is exact: a stage that fits still fits with fewer
    layers, and a layer pushed into a later stage than in another split has fewer micro-batches
    in flight there, so needs less memory."""
    starts, end = [], prefix.count
    for stage in reversed(range(hosts)):
        start = end
        while (start > stage and prefix.stage_s(start - 1, end) <= bottleneck
               and prefix.fits(start - 1, end, hosts - stage)):
            start -= 1
        if start == end:
            return None
        starts.append(start)
        end = start
    if end != 0:
        return None
    starts.reverse()
    return [*starts[1:], prefix.count]


def best_template(profile: Profile, hosts: int, prefix: Optional[_Prefix] = None
                  ) -> Optional[Template]:
    """The template for ``hosts`` hosts, or None when the model fits no split over them."""
    prefix = prefix or _Prefix(profile)
    if not 1 <= hosts <= prefix.count:
        return None
    candidates = sorted({prefix.stage_s(i, j) for i in range(prefix.count)
                         for j in range(i + 1, prefix.count + 1)})
    index = bisect.bisect_left(candidates, 0.0)
    low, high = index, len(candidates) - 1
    if _furthest_split(prefix, hosts, candidates[high]) is None:
        return None  # memory, not time, rules it out
    while low < high:
        middle = (low + high) // 2
        if _furthest_split(prefix, hosts, candidates[middle]) is None:
            low = middle + 1
        else:
            high = middle
    ends = _furthest_split(prefix, hosts, candidates[low])
    assert ends is not None
    firsts = [0, *ends[:-1]]
    return Template(hosts, tuple(zip(firsts, ends)),
                    tuple(prefix.stage_s(a, b) for a, b in zip(firsts, ends)))


def plan_templates(profile: Profile, pipeline_size: int) -> dict[int, Template]:
    """A template for every host count up to ``pipeline_size`` that has a split that fits;
    raises :class:`PlanningError` when none does."""
    if pipeline_size < 1:
        raise PlanningError(f"pipeline size {pipeline_size} must be at least 1")
    prefix = _Prefix(profile)
    templates = {}
    for hosts in range(1, min(pipeline_size, prefix.count) + 1):
        # (More hosts may fit less: the first stage holds more micro-batches in flight.)
        template = best_template(profile, hosts, prefix)
        if template is not None:
            templates[hosts] = template
    if not templates:
        need = profile_bytes(profile)
        raise PlanningError(
            f"the model fits no pipeline of 1 to {min(pipeline_size, prefix.count)} hosts of "
            f"{profile.host_memory_bytes} bytes (it needs {need} bytes of static memory in "
            "all, and every stage also holds its layers' activations)")
    return templates


def profile_bytes(profile: Profile) -> int:
    return sum(layer.static_bytes for layer in profile.layers)


# -- instantiation ------------------------------------------------------------------------------


def instantiate(templates: dict[int, Template], hosts: int, microbatches: int,
                fault_tolerance: int = 1) -> Instantiation:
    """Pipelines for exactly ``hosts`` hosts, at least ``fault_tolerance + 1`` of them, and the
    ``microbatches`` of the global batch split among them; raises :class:`PlanningError` when
    there is none.

    The pipelines are as few as can cover the hosts (as long as the templates allow, so close
    to the job's own pipeline size: every pipeline more costs gradient traffic and groups the
    profile does not count), and among those the set with the highest steady-state throughput."""
    least = fault_tolerance + 1
    sizes = sorted(templates)
    chosen = _fastest_cover(templates, hosts, least) if hosts >= 1 else None
    if chosen is None:
        raise PlanningError(
            f"no {least} or more pipelines of {_sizes(sizes)} hosts (the templates) cover "
            f"exactly {hosts} hosts")
    pipelines = tuple(templates[n] for n in sorted(chosen, reverse=True))
    if microbatches < len(pipelines):
        raise PlanningError(f"the global batch has {microbatches} micro-batches, fewer than the "
                            f"{len(pipelines)} pipelines")
    return Instantiation(hosts, pipelines, split_batch(pipelines, microbatches))


def _fastest_cover(templates: dict[int, Template], hosts: int,
                   least: int) -> Optional[list[int]]:
    """The host counts of the fewest pipelines (at least ``least``) summing to ``hosts``, with
    the largest summed steady-state rate (micro-batches per second) among those; None when no
    such set exists. A dynamic program over (pipelines, hosts), one pipeline more per round."""
    sizes = sorted(templates)
    rates = [1.0 / templates[n].bottleneck_s if templates[n].bottleneck_s > 0 else 1e300
             for n in sizes]
    best = numpy.full(hosts + 1, -numpy.inf)
    best[0] = 0.0
    picks = []
    for count in range(1, hosts // sizes[0] + 1):
        after = numpy.full(hosts + 1, -numpy.inf)
        pick = numpy.zeros(hosts + 1, dtype=numpy.int64)
        for size, rate in zip(sizes, rates):
            if size > hosts:
                continue
            candidate = numpy.full(hosts + 1, -numpy.inf)
            candidate[size:] = best[:hosts + 1 - size] + rate
            better = candidate > after
            after[better], pick[better] = candidate[better], size
        best = after
        picks.append(pick)
        if count >= least and numpy.isfinite(best[hosts]):
            chosen, left = [], hosts
            for round_pick in reversed(picks):
                chosen.append(int(round_pick[left]))
                left -= chosen[-1]
            return chosen
    return None


def _sizes(sizes: list[int]) -> str:
    """``1 to 4``, or ``1, 2, 4`` when the host counts have a gap."""
    if sizes == list(range(sizes[0], sizes[-1] + 1)) and len(sizes) > 1:
        return f"{sizes[0]} to {sizes[-1]}"
    return ", ".join(str(n) for n in sizes)


def split_batch(pipelines: Sequence[Template], microbatches: int) -> tuple[int, ...]:
    """Whole micro-batch counts per pipeline, at least one each, summing to ``microbatches``,
    that make the slowest pipeline's iteration as short as it can be."""
    counts = [1] * len(pipelines)
    heap = [(t.iteration_s(2), i) for i, t in enumerate(pipelines)]
    heapq.heapify(heap)
    for _ in range(microbatches - len(pipelines)):
        _, index = heapq.heappop(heap)
        counts[index] += 1
        heapq.heappush(heap, (pipelines[index].iteration_s(counts[index] + 1), index))
    return tuple(counts)


def check_fault_tolerance(templates: dict[int, Template], hosts: int, microbatches: int,
                          fault_tolerance: int) -> dict[int, Instantiation]:
    """The instantiation for ``hosts`` and for every loss of up to ``fault_tolerance`` hosts
    (by the hosts left); raises :class:`PlanningError` naming the first host count that has
    none."""
    if fault_tolerance < 0:
        raise PlanningError(f"fault tolerance {fault_tolerance} must be at least 0")
    plans = {hosts: instantiate(templates, hosts, microbatches, fault_tolerance)}
    smallest = min(templates)
    for lost in range(1, fault_tolerance + 1):
        left = hosts - lost
        try:
            plans[left] = instantiate(templates, left, microbatches, 0)
        except PlanningError as error:
            raise PlanningError(
                f"fault tolerance {fault_tolerance} is too large for {hosts} hosts: after "
                f"losing {lost}, {error} (the smallest template has {smallest} hosts)"
            ) from None
    return plans


# -- a profile from a file --------------------------------------------------------------------


def load_profile(path: Path) -> Profile:
    """A profile from its JSON (``write_profile`` of
    :mod:`mover_plugin.megatron.templates.profile`); raises :class:`ConfigError` naming the file."""
    try:
        raw = json.loads(path.read_text())
        layers = tuple(LayerCost(str(layer["name"]), float(layer["forward_s"]),
                                 float(layer["backward_s"]), int(layer["static_bytes"]),
                                 int(layer["activation_bytes"])) for layer in raw["layers"])
        return Profile(layers, int(raw["host_memory_bytes"]))
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such profile") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as error:
        raise ConfigError(f"{path}: not a profile ({type(error).__name__}: {error}); it needs "
                          "host_memory_bytes and layers with name, forward_s, backward_s, "
                          "static_bytes, activation_bytes") from None


# -- a synthetic profile --------------------------------------------------------------------------


def transformer_profile(num_layers: int, *, layer_s: float = 0.010,
                        layer_bytes: int = 2 << 30, activation_bytes: int = 256 << 20,
                        host_memory_bytes: int = 80 << 30) -> Profile:
    """A GPT-like profile for planning before any measurement: an embedding layer (little
    time, a transformer layer's static memory), ``num_layers`` equal transformer layers, and
    an output layer (the logits: twice a layer's time, a layer's memory)."""
    if num_layers < 1:
        raise PlanningError(f"the model needs at least 1 transformer layer, not {num_layers}")
    third = layer_s / 3
    layers = [LayerCost("embedding", third * 0.1, third * 0.2, layer_bytes, activation_bytes)]
    layers += [LayerCost(f"layer {i}", third, 2 * third, layer_bytes, activation_bytes)
               for i in range(num_layers)]
    layers.append(LayerCost("output", 2 * third, 4 * third, layer_bytes, 2 * activation_bytes))
    return Profile(tuple(layers), host_memory_bytes)
