"""A per-layer profile of a Megatron-Core GPT model, measured on one rank, for the pipeline
template planner (:class:`mover_plugin.templates.Profile`).

The whole model (every transformer layer, with the embeddings and the output layer) runs
forward and backward on one micro-batch a few times; hooks time each part:

- forward: from a module's pre-hook to its hook; the output layer (final norm, logits, loss)
  is the rest of the forward after the last transformer layer;
- backward: gradients arrive at each part's output in reverse order, so a part's backward time
  is the time between the gradient reaching its output and reaching its input (for the
  embedding, the end of the backward pass);
- activations: the bytes autograd saves for the backward pass while the part runs forward
  (each storage once; the parameters it saves, for a matrix product's gradient, are not
  activations);
- static memory: the parameters, their gradients (Megatron-Core's ``main_grad``, in the
  parameters' dtype), Adam's two fp32 moments, and an fp32 master copy when the parameters are
  not fp32. A tied word embedding is counted in the embedding and again in the output layer:
  a pipeline of more than one stage holds a copy on each end (one of a single stage is
  over-counted by that copy).

On a GPU each hook synchronises first, so that the times are the kernels', not their launches'.

The medians over the repeats are taken; the first run only warms up. The profile's layers are
``embedding``, ``layer 0`` .. ``layer L-1`` and ``output``, as
:func:`mover_plugin.placement.transformer_stages` expects.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from mover_plugin.templates import LayerCost, Profile

ADAM_BYTES_PER_PARAMETER = 8
"""Two fp32 moments."""


class _Clock:
    """Times and saved bytes of one forward and backward pass, by part."""

    def __init__(self, parts: list[str], parameters: set[int], device: torch.device) -> None:
        self.parts = parts
        self.parameters = parameters
        """The storages of the model's parameters (saved by a part, not its activations)."""
        self.device = device
        self.forward: dict[str, float] = {}
        self.grad_at_output: dict[str, float] = {}
        self.saved: dict[str, int] = dict.fromkeys(parts, 0)
        self.current = parts[0]
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
            self.saved[self.current] += tensor.untyped_storage().nbytes()
        return tensor


def measure_profile(model: Any, forward_step: Callable[[Iterator[Any], Any], Any],
                    batch: Any, host_memory_bytes: int, repeats: int = 3) -> Profile:
    """The profile of ``model`` (a Megatron-Core ``GPTModel`` holding every layer, unwrapped)
    on micro-batch ``batch``; ``forward_step`` is the training script's (it returns the output
    and the loss function)."""
    layers = list(model.decoder.layers)
    parts = ["embedding"] + [f"layer {i}" for i in range(len(layers))] + ["output"]
    runs = [_one_pass(model, layers, parts, forward_step, batch) for _ in range(repeats + 1)][1:]
    static = _static_bytes(model, layers)
    costs = []
    for part in parts:
        forward = statistics.median(run[0][part] for run in runs)
        backward = statistics.median(run[1][part] for run in runs)
        costs.append(LayerCost(part, forward, backward, static[part], runs[-1][2][part]))
    return Profile(tuple(costs), host_memory_bytes)


def _one_pass(model: Any, layers: list, parts: list[str], forward_step: Callable,
              batch: Any) -> tuple[dict[str, float], dict[str, float], dict[str, int]]:
    params = list(model.parameters())
    clock = _Clock(parts, {p.untyped_storage().data_ptr() for p in params}, params[0].device)
    modules = [model.embedding, *layers]
    handles = []
    for part, module in zip(parts, modules):
        handles.append(module.register_forward_pre_hook(_enter(clock, part)))
        handles.append(module.register_forward_hook(_leave(clock, part)))
    try:
        model.zero_grad(set_to_none=True)
        with torch.autograd.graph.saved_tensors_hooks(clock.save, lambda tensor: tensor):
            output, loss_func = forward_step(iter([batch]), model)
            loss = loss_func(output)[0]
        forward_end = clock.now()
        backward_start = clock.now()
        loss.backward()
        backward_end = clock.now()
    finally:
        for handle in handles:
            handle.remove()
    forward = {part: clock.forward[part] for part in parts[:-1]}
    forward["output"] = forward_end - clock.forward_end_of_last
    arrivals = [clock.grad_at_output[part] for part in parts[:-1]]  # embedding .. last layer
    backward = {"output": arrivals[-1] - backward_start, "embedding": backward_end - arrivals[0]}
    for index, part in enumerate(parts[1:-1], start=1):
        backward[part] = arrivals[index - 1] - arrivals[index]
    return forward, backward, dict(clock.saved)


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


def _static_bytes(model: Any, layers: list) -> dict[str, int]:
    def of(params: Any) -> int:
        total = 0
        for param in params:
            master = 0 if param.dtype == torch.float32 else 4
            total += param.numel() * (2 * param.element_size() + ADAM_BYTES_PER_PARAMETER
                                      + master)
        return total

    per_layer = {f"layer {i}": of(layer.parameters()) for i, layer in enumerate(layers)}
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    embedding = {id(p) for p in model.embedding.parameters()}
    rest = [p for p in model.parameters() if id(p) not in in_layers and id(p) not in embedding]
    embedding_bytes = of(model.embedding.parameters())
    output = of(rest)
    if getattr(model, "share_embeddings_and_output_weights", False):
        output += of([model.embedding.word_embeddings.weight])
    return {"embedding": embedding_bytes, **per_layer, "output": output}


def write_profile(profile: Profile, path: Path) -> None:
    """The JSON ``mover templates --profile`` reads."""
    path.write_text(json.dumps({
        "host_memory_bytes": profile.host_memory_bytes,
        "layers": [{"name": c.name, "forward_s": c.forward_s, "backward_s": c.backward_s,
                    "static_bytes": c.static_bytes, "activation_bytes": c.activation_bytes}
                   for c in profile.layers]}, indent=1) + "\n")
