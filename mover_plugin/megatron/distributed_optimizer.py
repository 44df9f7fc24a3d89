"""What Megatron-Core's distributed optimizer holds, from the resilience runtime's point of view.

With ``--use-distributed-optimizer`` each rank of a data-parallel group updates one shard of
the parameters: it keeps the optimizer's state (Adam's moments) of that shard only, and, when
the model trains in fp16 or bf16, the fp32 main copy of it. The model's parameters themselves
are whole on every rank (gathered after each update), so a data-parallel twin still holds them;
the shard exists nowhere else.

- :func:`distributed_optimizers`: the distributed optimizers behind Megatron's optimizer (one,
  or those a ``ChainedOptimizer`` chains);
- :func:`shard_tensors`: this rank's shard as live tensors in a fixed order (per optimizer,
  parameter group and parameter: the fp32 main copy where it is a tensor of its own, then each
  tensor of the optimizer's state); the ``step`` counters travel with the optimizer's
  ``state_dict()``. With ``--overlap-param-gather`` the parameters are gathered at the next
  forward pass, so between two iterations no other rank holds this rank's shard of them
  current: the shard then also carries the fp32 parameters where they are views of the model's
  (:func:`gathers_late`), and a receiver writes the model's own shard from the main copy
  (:func:`publish_received_shard`). The same holds for an optimizer whose data-parallel group
  is its rank alone (:func:`held_alone`: the experts of a mixture-of-experts model whose
  expert-data-parallel size is 1): its shard is all of its parameters, which no other rank
  holds;
- :func:`ensure_shard_state`: a fresh optimizer has no state until its first step; a joiner
  creates it (Megatron-Core's own dummy step) before the shard is received in place, and loads
  the sender's ``state_dict()`` after, which keeps those tensors;
- :func:`restore_step_counters`: with torch's Adam (no TE or Apex, as on CPU) the step
  counters need care after a load. ``DistributedOptimizer.load_state_dict`` gives every
  parameter's state one and the same ``step`` tensor, and torch's Adam adds 1 to each
  parameter's ``step`` in place, so the shared counter would advance once per parameter;
  Megatron-LM's ``load_checkpoint`` (``torch_dist`` format) restores the parameter groups'
  ``step`` but leaves each parameter's counter as it was (a joiner's at its dummy step, a
  running rank's at the iteration it had reached). Either way every later bias correction
  would be wrong. After each load every parameter gets a counter of its own, equal to its
  group's.
- :func:`load_with_torch_adam`: a checkpoint load of a distributed optimizer over torch's Adam
  (Megatron-LM's start-up ``load_checkpoint``). The load writes in place into the shard's fp32
  parameters, which are views of the model's parameters when the model trains in fp32 and
  need grad, so it runs without autograd; the step counters are restored after. (Without
  state before its first step, such an optimizer cannot build the sharded state dict of a
  ``torch_dist`` load at all: the ``optstate`` patch of ``megatron-cpu``.) With TE's or Apex's
  Adam the load is left as it is.

Written for Megatron-Core 0.19's ``DistributedOptimizer`` with a torch or TE Adam.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar

import torch

Loaded = TypeVar("Loaded")


def distributed_optimizers(optimizer: Any) -> list[Any]:
    """The ``DistributedOptimizer`` instances behind ``optimizer`` (empty without one)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    chained = getattr(optimizer, "chained_optimizers", None)
    members = list(chained) if chained is not None else [optimizer]
    return [item for item in members if isinstance(item, DistributedOptimizer)]


def uses_distributed_optimizer(optimizer: Any) -> bool:
    return bool(distributed_optimizers(optimizer))


def shard_tensors(optimizer: Any) -> list[torch.Tensor]:
    """This rank's optimizer shard as live tensors (writing into them changes the shard)."""
    tensors: list[torch.Tensor] = []
    for item in distributed_optimizers(optimizer):
        separate = {id(p) for group in item.shard_fp32_from_float16_groups for p in group}
        late = gathers_late(item) or held_alone(item)
        keys = item.optimizer_state_keys
        for group in item.optimizer.param_groups:
            for main in group["params"]:
                if id(main) in separate or late:
                    tensors.append(main.data)
                state = item.optimizer.state.get(main, {})
                tensors.extend(state[key] for key in keys if key in state)
    return tensors


def gathers_late(item: Any) -> bool:
    """Whether a distributed optimizer leaves the parameters' gather to the next forward pass
    (``--overlap-param-gather``): the model's parameters are then current in its own shard
    only between an update and that gather."""
    return bool(getattr(getattr(item, "ddp_config", None), "overlap_param_gather", False))


def held_alone(item: Any) -> bool:
    """Whether no other rank holds a distributed optimizer's parameters: its data-parallel
    group (for the experts' optimizer, the expert-data-parallel group) is this rank alone."""
    return item.data_parallel_group.size() == 1


def publish_received_shard(optimizer: Any) -> None:
    """After a shard was received: where the parameters are gathered late or held by this
    rank alone, the model's own shard of the parameters is written from the received fp32
    main copy (as the update writes it), since the sender's model parameters are not this
    rank's there."""
    for item in distributed_optimizers(optimizer):
        if gathers_late(item) or held_alone(item):
            item._copy_main_params_to_model_params()


def create_state_up_front(optimizer: Any) -> None:
    """Gives every distributed optimizer over torch's Adam (or AdamW) the state its first
    update would create (a zero ``step`` and zero moments, as torch's Adam creates them),
    before that update: the math of every update is unchanged, and the shard has its full
    size from the first iteration on. Otherwise the state appears at the first update that
    is applied, which with ``--fp16`` may come after iterations whose update the loss scaler
    skipped: the shard would grow within a generation (the peer copy's buffers are sized
    once per generation), and a joiner of such an early iteration, whose state is created
    before it receives its shard, would step differently from the ranks without one."""
    for item in distributed_optimizers(optimizer):
        inner = item.optimizer
        if not isinstance(inner, torch.optim.Adam):
            continue
        for group in inner.param_groups:
            for main in group["params"]:
                if len(inner.state[main]) == 0:
                    inner.state[main].update(adam_state_before_first_step(main, group))


def adam_state_before_first_step(main: torch.Tensor,
                                 group: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The state torch's Adam creates for a parameter at its first step (torch 2.13/2.14)."""
    on_device = group.get("capturable", False) or group.get("fused", False)
    step = (torch.zeros((), dtype=torch.float32, device=main.device) if on_device
            else torch.tensor(0.0, dtype=torch.float32))
    moments = ["exp_avg", "exp_avg_sq", *(["max_exp_avg_sq"] if group.get("amsgrad") else [])]
    return {"step": step, **{name: torch.zeros_like(main, memory_format=torch.preserve_format)
                             for name in moments}}


def ensure_shard_state(optimizer: Any) -> None:
    """Creates the optimizer state of every distributed optimizer that has none yet (a dummy
    step with zero gradients; the values are overwritten by the shard received)."""
    for item in distributed_optimizers(optimizer):
        if len(item.optimizer.state) == 0:
            item._init_optimizer_states_with_dummy_values()


def restore_step_counters(optimizer: Any) -> None:
    """Gives every parameter's optimizer state a ``step`` tensor of its own, equal to its
    parameter group's ``step`` where the group has one (see the module docstring)."""
    for item in distributed_optimizers(optimizer):
        for group in item.optimizer.param_groups:
            for main in group["params"]:
                state = item.optimizer.state.get(main, {})
                step = state.get("step")
                if not isinstance(step, torch.Tensor):
                    continue
                value = group.get("step", None)
                state["step"] = (step.clone() if value is None
                                 else torch.full_like(step, float(value)))


def uses_torch_adam() -> bool:
    """Whether Megatron-Core's distributed optimizer runs torch's Adam (neither TE nor Apex is
    installed)."""
    from megatron.core.optimizer import distrib_optimizer

    return not distrib_optimizer.HAVE_APEX_OR_TE


def load_with_torch_adam(load: Callable[[], Loaded], optimizer: Optional[Any]) -> Loaded:
    """``load()`` of a checkpoint into ``optimizer`` (among others); with a distributed
    optimizer over torch's Adam, without autograd and with its step counters restored after
    (see the module docstring)."""
    if optimizer is None or not uses_distributed_optimizer(optimizer) or not uses_torch_adam():
        return load()
    with torch.no_grad():  # in place into fp32 parameters (and views of them) that need grad
        loaded = load()
    restore_step_counters(optimizer)
    return loaded
