"""What a DeepSpeed engine holds, from the resilience runtime's point of view.

- :func:`shard_tensors`: a rank's own ZeRO optimizer shard — for each parameter group (at
  stage 3, each sub-group) the fp32 master partition and the optimizer's state of it (Adam's
  step, first and second moments) — as a list of live tensors, in a fixed order, equal in
  shapes on every rank of a data-parallel group (ZeRO pads the partitions to one size). A fresh
  optimizer has no state until its first step; :func:`ensure_optimizer_state` creates it
  (zeros) so that a joiner can receive a shard in place. Without ZeRO (stage 0) the optimizer
  state is replicated and the "shard" is the whole of it. DeepSpeed's own Adams count steps in
  Python ints, which travel apart (:func:`optimizer_steps` / :func:`set_optimizer_steps`).
- :func:`module_tensors`: the rest of a rank's state, its module's parameters and buffers (at
  stage 3 its buffers and frozen parameters' partitions; :func:`refresh_parameter_partitions`
  casts the trained parameters' partitions from a received shard).
- :func:`counters` / :func:`restore_counters`: the engine's step counters, and a
  ``PipelineModule``'s count of forwards (with ``seed_layers`` its layers seed the random
  streams from it before each forward, so a redo and a joiner need it to draw as before);
  :func:`loss_scale_state` / :func:`restore_loss_scale_state`: fp16's dynamic loss scale;
  :func:`hyperparameters` / :func:`set_hyperparameters`: the optimizer's parameter-group
  settings, which the learning-rate scheduler sets after each update;
  :func:`accumulation_boundary` / :func:`set_accumulation_boundary`: the boundary a script
  sets itself before a backward, which a redone backward needs as it was;
  :func:`last_grad_norm` / :func:`set_last_grad_norm`: the last update's gradient norm, which
  a joiner's script reads before its first update.
- :func:`reset_interrupted_step`: what an iteration that was left in the middle leaves
  behind — accumulated gradients, ZeRO's reduction buckets, its stage-2 partition buffer and
  backward bookkeeping, at stage 3 the gathered parameters and the prefetch trace
  (:func:`release_parameters`, also run at every switch), the pipeline's activation-shape
  handshake — cleared, so the iteration can be run again.

Written for DeepSpeed 0.19.8's ``DeepSpeedZeroOptimizer``, ``DeepSpeedZeroOptimizer_Stage3``
(and its parameter coordinator), ``DeepSpeedEngine`` and ``PipelineEngine``.
"""

from __future__ import annotations

from typing import Any

import torch

from mover_plugin.runtime.handover import module_state_tensors

_COUNTERS = ("global_steps", "global_samples", "micro_steps", "skipped_steps")
_FORWARDS = "micro_offset"
"""A ``PipelineModule``'s count of forwards."""
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def is_pipeline_engine(engine: Any) -> bool:
    """Whether ``engine`` is a pipeline engine (a ``PipelineModule``, ``train_batch``) rather
    than a data-parallel one (``engine(batch)``, ``backward``, ``step``)."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return isinstance(engine, PipelineEngine)


def data_parallel_group(engine: Any) -> Any:
    """The group over which ``engine`` reduces gradients and shards its optimizer."""
    if is_pipeline_engine(engine):
        return engine.grid.get_data_parallel_group()
    return engine.data_parallel_group


def zero_optimizer(engine: Any) -> Any:
    """The engine's ZeRO optimizer (stage 1, 2 or 3), or None without ZeRO."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    optimizer = engine.optimizer
    zero = isinstance(optimizer, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))
    return optimizer if zero else None


def partitions_parameters(engine: Any) -> bool:
    """Whether the engine's parameters are partitioned too (ZeRO stage 3): a rank holds only
    its partition of each (persistent small ones excepted) and gathers them in every forward
    and backward."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3)


def _optimized_tensors(engine: Any) -> tuple[Any, list[torch.Tensor]]:
    """The base optimizer and the tensors it updates (ZeRO's fp32 partitions, or the
    parameters)."""
    zero = zero_optimizer(engine)
    if zero is None:
        optimizer = engine.optimizer
        return optimizer, [p for group in optimizer.param_groups for p in group["params"]]
    if partitions_parameters(engine):
        return zero.optimizer, list(zero.fp32_partitioned_groups_flat)
    return zero.optimizer, list(zero.single_partition_of_fp32_groups)


def refresh_parameter_partitions(engine: Any) -> None:
    """ZeRO stage 3: this rank's partitions of the parameters in their training precision (the
    flat buffers every parameter's partition is a view of) from its fp32 partitions, as
    DeepSpeed's ``step`` writes them after each update. The shard therefore carries the fp32
    partitions only; a rank that received them calls this."""
    if not partitions_parameters(engine):
        return
    zero = engine.optimizer
    for low, master in zip(zero.fp16_partitioned_groups_flat,
                           zero.fp32_partitioned_groups_flat, strict=True):
        if low.data_ptr() != master.data_ptr():
            low.data.copy_(master.data)


def ensure_optimizer_state(engine: Any) -> None:
    """Gives every optimized tensor an (all-zero) Adam state if it has none yet."""
    optimizer, tensors = _optimized_tensors(engine)
    for tensor in tensors:
        state = optimizer.state[tensor]
        if not state:
            state["step"] = 0 if _steps_in_python(optimizer) else torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(tensor, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(tensor, memory_format=torch.preserve_format)


def _steps_in_python(optimizer: Any) -> bool:
    """Whether the optimizer counts each state's steps in a Python int: DeepSpeed's own
    Adams (``FusedAdam``, its default for ``"Adam"``/``"AdamW"``; ``DeepSpeedCPUAdam``) hand
    the count to their kernels as a number; torch's Adam keeps a tensor."""
    return type(optimizer).__module__.startswith("deepspeed.ops.")


def shard_tensors(engine: Any) -> list[torch.Tensor]:
    """This rank's optimizer shard as live tensors (writing into them changes the shard). A
    step counted in a Python int is not among them (:func:`optimizer_steps`)."""
    optimizer, tensors = _optimized_tensors(engine)
    shard = []
    for tensor in tensors:
        state = optimizer.state[tensor]
        missing = [key for key in _ADAM_STATE if key not in state]
        if missing:
            raise KeyError(f"optimizer state lacks {missing}: mover_plugin handles Adam/AdamW "
                           "state (step, exp_avg, exp_avg_sq)")
        shard.append(tensor.data)
        if isinstance(state["step"], torch.Tensor):
            shard.append(state["step"].view(-1))
        shard.extend((state["exp_avg"], state["exp_avg_sq"]))
    return shard


def optimizer_steps(engine: Any) -> list[Any]:
    """Each optimized tensor's step where the optimizer counts it in a Python int (None where
    it is a tensor of the shard). Every rank of a data-parallel group updates together, so
    a live rank's steps are also those of the rank it replaces."""
    optimizer, tensors = _optimized_tensors(engine)
    steps = (optimizer.state[tensor].get("step") for tensor in tensors)
    return [None if isinstance(step, torch.Tensor) else step for step in steps]


def set_optimizer_steps(engine: Any, steps: list[Any]) -> None:
    """Sets the steps :func:`optimizer_steps` returned (on another rank)."""
    optimizer, tensors = _optimized_tensors(engine)
    for tensor, step in zip(tensors, steps, strict=True):
        if step is not None:
            optimizer.state[tensor]["step"] = step


def hyperparameters(engine: Any) -> list[dict[str, Any]]:
    """The optimizer's parameter-group settings (learning rate, betas, weight decay, ...)."""
    return [{key: value for key, value in group.items() if key != "params"}
            for group in engine.optimizer.param_groups]


def set_hyperparameters(engine: Any, settings: list[dict[str, Any]]) -> None:
    for group, values in zip(engine.optimizer.param_groups, settings, strict=True):
        group.update(values)


_LOSS_SCALE_STATE = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")
"""What DeepSpeed's dynamic loss scaler changes as it trains (fp16)."""


def loss_scale_state(engine: Any) -> dict[str, Any]:
    """The fp16 loss scaler's state (empty without one): it moves before the commit, so an
    iteration redone after a peer lost there must start from it, and a joiner needs it."""
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    return {name: getattr(scaler, name) for name in _LOSS_SCALE_STATE if hasattr(scaler, name)}


def restore_loss_scale_state(engine: Any, state: dict[str, Any]) -> None:
    scaler = getattr(engine.optimizer, "loss_scaler", None)
    for name, value in state.items():
        setattr(scaler, name, value)


def counters(engine: Any) -> dict[str, int]:
    values = {name: getattr(engine, name) for name in _COUNTERS}
    if is_pipeline_engine(engine):
        values[_FORWARDS] = engine.module.micro_offset
    return values


def restore_counters(engine: Any, values: dict[str, int]) -> None:
    for name, value in values.items():
        setattr(engine.module if name == _FORWARDS else engine, name, value)


def last_grad_norm(engine: Any) -> Any:
    """The gradient norm of the last update (``get_global_grad_norm``: the same on every rank;
    the Transformers Trainer logs it)."""
    return engine.get_global_grad_norm()


def set_last_grad_norm(engine: Any, norm: Any) -> None:
    """What ``get_global_grad_norm`` returns until the next update."""
    engine._global_grad_norm = norm


def accumulation_boundary(engine: Any) -> Any:
    """The accumulation boundary the script set (``set_gradient_accumulation_boundary``, as
    Accelerate does before each backward), or None where the engine counts micro-batches."""
    return engine._is_gradient_accumulation_boundary


def set_accumulation_boundary(engine: Any, boundary: Any) -> None:
    """Sets the boundary back to what :func:`accumulation_boundary` returned."""
    if boundary is None:
        engine._is_gradient_accumulation_boundary = None
    else:
        engine.set_gradient_accumulation_boundary(boundary)


def reset_interrupted_step(engine: Any) -> None:
    """Clears what an interrupted ``train_batch`` left behind (see the module docstring)."""
    zero = zero_optimizer(engine)
    if partitions_parameters(engine):
        release_parameters(engine)
        _reset_stage3_reduction(zero)
    elif zero is not None:
        _reset_zero_reduction(zero)
    engine.optimizer.zero_grad(set_to_none=True)
    for parameter in engine.module.parameters():
        parameter.grad = None
    if is_pipeline_engine(engine):
        engine.reset_activation_shape()
    for timer in engine.timers.timers.values():
        timer.reset()


def _reset_zero_reduction(zero: Any) -> None:
    from deepspeed.runtime.zero.stage_1_and_2 import INITIAL_MICRO_STEP_ID

    for bucket in zero.ipg_buckets.values():
        bucket.clear()
        bucket.buffer.clear()
        bucket.index = 0
    for index in range(len(zero.params_already_reduced)):
        zero.params_already_reduced[index] = False
    for table in (zero.averaged_gradients, zero.all_grad_tensors):
        for key in list(table):
            table[key] = None
    zero.extra_large_param_to_reduce.clear()
    zero.previous_reduced_grads.clear()
    for partition in zero.single_partition_of_fp32_groups:
        partition.grad = None
    zero.micro_step_id = INITIAL_MICRO_STEP_ID
    # ZeRO-2 accumulates each micro-batch's reduced gradients into a buffer of its partition,
    # and tracks the backward it is in: back to the state before the iteration's first one.
    zero._release_ipg_buffers()
    if zero.partition_gradients:
        zero.reset_partition_gradient_structures()
    _reset_backward_hooks(zero)
    for group in zero.bit16_groups:
        for parameter in group:
            parameter.grad_accum = None


def module_tensors(engine: Any) -> list[torch.Tensor]:
    """The module's tensors in a rank's state besides its shard: its parameters and buffers.
    At ZeRO stage 3 a parameter is its partitions (its gathered data is released at a switch,
    :func:`release_parameters`): a trained one's come from the shard's fp32 partitions
    (:func:`refresh_parameter_partitions`), a frozen one's partition is sent here, with the
    buffers."""
    if not partitions_parameters(engine):
        return module_state_tensors(engine.module)
    tensors = []
    for _, tensor in sorted(engine.module.state_dict(keep_vars=True).items()):
        if not isinstance(tensor, torch.Tensor):
            continue
        if not hasattr(tensor, "ds_id"):
            tensors.append(tensor.data)
        elif not tensor.requires_grad:
            tensors.append(tensor.ds_tensor.data)
    return tensors


def release_parameters(engine: Any) -> None:
    """ZeRO stage 3: every gathered or in-flight parameter back to its partition, persistent
    ones included (an interrupted forward or backward leaves them gathered; an all-gather of a
    lost peer never completes, and its handle is dropped, not waited for), the module stack of
    the forward hooks back to the engine's module, and the recorded prefetch trace forgotten.

    Done at every switch, on every rank, and on a joiner once it has its state, so that all
    ranks gather the same parameters in the same order in the next iteration: a rank with a
    trace prefetches in the trace's order, a rank without one (a joiner) gathers parameters as
    they are used, and a persistent parameter is gathered only where it is not yet. Without
    traces, every rank records one again in the next iteration, as at the start of training."""
    import deepspeed.runtime.zero.parameter_offload as offload
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    module = engine.module
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    for submodule in module.modules():
        # An interrupted engine forward leaves its "in forward" mark, with which reading a
        # partitioned parameter gathers it on this rank alone.
        if isinstance(submodule._parameters, offload.ZeROOrderedDict):
            submodule._parameters._in_forward = False
        recompute = getattr(submodule, "ds_recompute_parameters", None)
        if recompute is not None:
            recompute.clear()
    module.ds_inflight_param_registry.clear()
    for parameter in module.parameters():
        parameter.ds_active_sub_modules.clear()
        if parameter.ds_status == ZeroParamStatus.INFLIGHT:  # an all-gather left unfinished
            parameter.ds_status = ZeroParamStatus.AVAILABLE
        if parameter.ds_status == ZeroParamStatus.AVAILABLE:
            parameter.partition()
    getattr(coordinator, "_PartitionedParameterCoordinator__active_backward_submodules").clear()
    stack = offload.FWD_MODULE_STACK
    if module in stack:
        del stack[stack.index(module) + 1:]
    if not coordinator.is_invalid_trace():
        coordinator._invalidate_trace()
    _forget_release_sets(coordinator)


def discard_engine(engine: Any) -> None:
    """An engine that is not used again, made collectable: DeepSpeed's own ``destroy`` takes
    the ZeRO optimizer's gradient hooks off (they hold the engine in a reference cycle through
    torch's autograd that the garbage collector does not see), and at stage 3 the release sets
    the coordinator cached (keyed by the coordinator) are cleared."""
    coordinator = (engine.optimizer.parameter_offload.get_param_coordinator()
                   if partitions_parameters(engine) else None)
    engine.destroy()
    if coordinator is not None:
        _forget_release_sets(coordinator)


def _forget_release_sets(coordinator: Any) -> None:
    """The coordinator caches which parameters each module releases at each step of a trace
    (an ``lru_cache`` inside DeepSpeed's NVTX wrapper); a new trace must not meet the old
    trace's sets."""
    method = type(coordinator).__dict__["_PartitionedParameterCoordinator__params_to_release"]
    for cell in method.__closure__ or ():
        if hasattr(cell.cell_contents, "cache_clear"):
            cell.cell_contents.cache_clear()
            return
    raise RuntimeError("DeepSpeed's parameter coordinator has no release-set cache where "
                       "mover_plugin expects it (written for DeepSpeed 0.19.8)")


def _reset_stage3_reduction(zero: Any) -> None:
    """ZeRO stage 3's gradient reduction back to an iteration's start: no bucket pending, no
    parameter counted as reduced, the next backward's partitions copied rather than added
    (``micro_step_id`` 0), and the backward bookkeeping of the hooks cleared."""
    for bucket in zero.ipg_buckets.values():
        bucket.clear_params()
    for key in zero.params_already_reduced:
        zero.params_already_reduced[key] = False
    for group in zero.fp16_groups:
        for parameter in group:
            # A gradient the interrupted backward had not yet reduced. (DeepSpeed's zero_grad
            # would record it on the accelerator's stream, which fails on CPU.)
            parameter.grad = None
    zero.zero_grad(set_to_none=True)
    for partition in zero.fp32_partitioned_groups_flat:
        partition.grad = None
    _reset_backward_hooks(zero)


def _reset_backward_hooks(zero: Any) -> None:
    """The ZeRO optimizer's record of the backward it is in, back to none begun."""
    hooks = zero._backward_hook_state
    hooks.backward_active_depth = 0
    hooks.remaining_grad_acc_hooks = 0
    hooks.reset_for_new_step()
    zero._epilogue_ran_this_backward = False
