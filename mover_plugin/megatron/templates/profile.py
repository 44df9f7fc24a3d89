"""A per-layer profile of a Megatron-Core GPT model, for the pipeline template planner
(:class:`mover_plugin.templates.Profile`).

A model, or one pipeline stage of it, runs forward and backward on one micro-batch a few times;
hooks time each part it holds (the embedding on the first stage, its transformer layers, the
output layer on the last stage):

- forward: from a module's pre-hook to its hook; the output layer (final norm, logits, loss)
  is the rest of the forward after the last transformer layer;
- backward: gradients arrive at each part's output in reverse order, so a part's backward time
  is the time between the gradient reaching its output and reaching its input (for the
  stage's first part, the end of the backward pass);
- activations: the bytes autograd saves for the backward pass while the part runs forward
  (each storage once; the parameters it saves, for a matrix product's gradient, are not
  activations);
- static memory: the parameters, their gradients (Megatron-Core's ``main_grad``, in the
  parameters' dtype), Adam's two fp32 moments, and an fp32 master copy when the parameters are
  not fp32. A tied word embedding is counted in the embedding and again in the output layer:
  a pipeline of more than one stage holds a copy on each end (one of a single stage is
  over-counted by that copy).

A stage other than the first is fed a hidden state of the micro-batch's shape, and one other
than the last is given a gradient of ones at its output. On a GPU each hook synchronises
first, so that the times are the kernels', not their launches'.

The medians over the repeats are taken; the first run only warms up. The profile's layers are
``embedding``, ``layer 0`` .. ``layer L-1`` and ``output``, as
:func:`mover_plugin.placement.transformer_stages` expects; a stage's are its own run of them.

:func:`measure_profile` measures a model that holds every layer (before a job, for
``--resilient-template-profile``); :func:`measure_training_stage` measures one rank's stage of
a running job, which the controller assembles into the job's profile
(:func:`mover_plugin.shrink.assemble_profile`).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from mover_plugin.templates import LayerCost, Profile

ADAM_BYTES_PER_PARAMETER = 8
"""Two fp32 moments."""


class _Clock:
    """Times and saved bytes of one forward and backward pass, by part."""

    def __init__(self, first_part: str, parameters: set[int], device: torch.device) -> None:
        self.parameters = parameters
        """The storages of the model's parameters (saved by a part, not its activations)."""
        self.device = device
        self.forward: dict[str, float] = {}
        self.grad_at_output: dict[str, float] = {}
        self.saved: dict[str, int] = {}
        self.current = first_part
        self.forward_end_of_last = 0.0
        """When the last transformer layer's forward ended (the output layer's start)."""
        self._storages: set[tuple[str, int]] = set()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def save(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage().data_ptr()
        key = (self.current, storage)
        if storage not in self.parameters and key not in self._storages:
            self._storages.add(key)
            self.saved[self.current] = (self.saved.get(self.current, 0)
                                        + tensor.untyped_storage().nbytes())
        return tensor


@dataclass(frozen=True)
class _Stage:
    """The parts of a model (a ``GPTModel``, unwrapped) and how one pass over them runs."""

    model: Any
    modules: list[tuple[str, Any]]
    """(part, module) in forward order: the embedding, then the transformer layers."""
    forward_step: Callable[[Iterator[Any], Any], Any]
    batch: Any
    input_shape: Optional[tuple[int, ...]]
    """The hidden state a stage other than the first is fed ([sequence, micro-batch, hidden])."""

    @classmethod
    def of(cls, model: Any, forward_step: Callable, batch: Any, first_layer: int,
           input_shape: Optional[tuple[int, ...]]) -> "_Stage":
        modules = [("embedding", model.embedding)] if model.pre_process else []
        modules += [(f"layer {first_layer + index}", layer)
                    for index, layer in enumerate(model.decoder.layers)]
        return cls(model, modules, forward_step, batch,
                   None if model.pre_process else input_shape)

    @property
    def parts(self) -> list[str]:
        return [part for part, _ in self.modules] + (["output"] if self.model.post_process
                                                     else [])


def measure_profile(model: Any, forward_step: Callable[[Iterator[Any], Any], Any],
                    batch: Any, host_memory_bytes: int, repeats: int = 3) -> Profile:
    """The profile of ``model`` (a Megatron-Core ``GPTModel`` holding every layer, unwrapped)
    on micro-batch ``batch``; ``forward_step`` is the training script's (it returns the output
    and the loss function)."""
    return Profile(_measure(_Stage.of(model, forward_step, batch, 0, None), repeats),
                   host_memory_bytes)


def measure_training_stage(model: Any, forward_step: Callable[[Iterator[Any], Any], Any],
                           batch: Any, *, first_layer: int, input_shape: tuple[int, ...],
                           repeats: int = 3) -> tuple[LayerCost, ...]:
    """The costs of the parts of a running job's pipeline stage ``model`` (a model chunk as
    the script built it, wrapped in Megatron-Core's DDP or not) on micro-batch ``batch``: its
    first transformer layer is the model's ``first_layer``; ``input_shape`` is the hidden
    state a stage other than the first receives. Nothing of the training changes: the passes
    accumulate no gradient into the data-parallel buffers that the next iteration keeps, start
    no gradient reduction, and draw no random number the training would have drawn."""
    from mover_plugin.megatron.checkpoint import capture_rng_state, restore_rng_state

    unwrapped = model
    while hasattr(unwrapped, "module"):
        unwrapped = unwrapped.module
    stage = _Stage.of(unwrapped, forward_step, batch, first_layer, input_shape)
    rng = capture_rng_state()
    cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    no_sync = getattr(model, "no_sync", contextlib.nullcontext)
    try:
        with no_sync():
            return _measure(stage, repeats)
    finally:
        if stage.input_shape is not None:
            unwrapped.set_input_tensor(None)
        if hasattr(model, "zero_grad_buffer"):
            model.zero_grad_buffer()
        for param in unwrapped.parameters():
            param.grad = None
        restore_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)


def _measure(stage: _Stage, repeats: int) -> tuple[LayerCost, ...]:
    runs = [_one_pass(stage) for _ in range(repeats + 1)][1:]
    static = _static_bytes(stage)
    costs = []
    for part in stage.parts:
        forward = statistics.median(run[0][part] for run in runs)
        backward = statistics.median(run[1][part] for run in runs)
        costs.append(LayerCost(part, forward, backward, static[part],
                               runs[-1][2].get(part, 0)))
    return tuple(costs)


def _one_pass(stage: _Stage) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    model, parts = stage.model, stage.parts
    params = list(model.parameters())
    clock = _Clock(parts[0], {p.untyped_storage().data_ptr() for p in params}, params[0].device)
    handles = []
    for part, module in stage.modules:
        handles.append(module.register_forward_pre_hook(_enter(clock, part)))
        handles.append(module.register_forward_hook(_leave(clock, part)))
    if stage.input_shape is not None:
        hidden = torch.randn(stage.input_shape, generator=torch.Generator().manual_seed(0),
                             dtype=params[0].dtype).to(params[0].device)
        model.set_input_tensor(hidden.requires_grad_())
    try:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(clock.save, lambda tensor: tensor):
            output, loss_func = stage.forward_step(iter([stage.batch]), model)
            if model.post_process:
                output = loss_func(output)[0]
        forward_end = clock.now()
        backward_start = clock.now()
        output.backward(None if model.post_process else torch.ones_like(output))
        backward_end = clock.now()
    finally:
        for handle in handles:
            handle.remove()
    return (_forward_times(stage, clock, forward_end),
            _backward_times(stage, clock, backward_start, backward_end), dict(clock.saved))


def _forward_times(stage: _Stage, clock: _Clock, forward_end: float) -> dict[str, float]:
    forward = {part: clock.forward[part] for part, _ in stage.modules}
    if stage.model.post_process:
        forward["output"] = forward_end - clock.forward_end_of_last
    return forward


def _backward_times(stage: _Stage, clock: _Clock, backward_start: float,
                    backward_end: float) -> dict[str, float]:
    names = [part for part, _ in stage.modules]
    arrivals = [clock.grad_at_output[part] for part in names]
    backward = {names[0]: backward_end - arrivals[0]}
    for index in range(1, len(names)):
        backward[names[index]] = arrivals[index - 1] - arrivals[index]
    if stage.model.post_process:
        backward["output"] = arrivals[-1] - backward_start
    return backward


def _enter(clock: _Clock, part: str) -> Callable:
    def hook(module: Any, args: Any) -> None:
        clock.current = part
        clock.forward[part] = -clock.now()
    return hook


def _leave(clock: _Clock, part: str) -> Callable:
    def hook(module: Any, args: Any, output: Any) -> None:
        now = clock.now()
        clock.forward[part] += now
        clock.forward_end_of_last = now
        clock.current = "output"  # until the next part's pre-hook
        hidden = output[0] if isinstance(output, tuple) else output
        if hidden.requires_grad:
            hidden.register_hook(_arrived(clock, part))
    return hook


def _arrived(clock: _Clock, part: str) -> Callable:
    def hook(grad: torch.Tensor) -> None:
        clock.grad_at_output[part] = clock.now()
    return hook


def _static_bytes(stage: _Stage) -> dict[str, int]:
    def of(params: Any) -> int:
        total = 0
        for param in params:
            master = 0 if param.dtype == torch.float32 else 4
            total += param.numel() * (2 * param.element_size() + ADAM_BYTES_PER_PARAMETER
                                      + master)
        return total

    model = stage.model
    static = {part: of(module.parameters()) for part, module in stage.modules}
    if model.post_process:
        held = {id(p) for _, module in stage.modules for p in module.parameters()}
        static["output"] = of(p for p in model.parameters() if id(p) not in held)
        if model.pre_process and getattr(model, "share_embeddings_and_output_weights", False):
            # the output layer reads the embedding's matrix; a last stage of its own holds a
            # copy (counted above with the stage's other parameters)
            static["output"] += of([model.embedding.word_embeddings.weight])
    return static


def host_memory_bytes(device: torch.device) -> int:
    """The memory one rank may plan with: its GPU's, or on a CPU the machine's physical memory
    shared by the ranks its launcher started there (``LOCAL_WORLD_SIZE``)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return physical // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def write_profile(profile: Profile, path: Path) -> None:
    """The JSON ``mover templates --profile`` reads."""
    path.write_text(json.dumps({
        "host_memory_bytes": profile.host_memory_bytes,
        "layers": [{"name": c.name, "forward_s": c.forward_s, "backward_s": c.backward_s,
                    "static_bytes": c.static_bytes, "activation_bytes": c.activation_bytes}
                   for c in profile.layers]}, indent=1) + "\n")
