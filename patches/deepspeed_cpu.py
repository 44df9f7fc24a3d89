"""``deepspeed-cpu``: what DeepSpeed 0.19 needs to train on CPU processes with gloo (or with the
``mover`` backend), and to let a training step be left and entered again.

- ``no-shm-op``: DeepSpeed's torch backend JIT-compiles its shared-memory all-reduce op (g++ and
  ninja, over a minute the first time on a CPU machine) whenever it is created on CPU. Training
  never uses that op (only ``inference_all_reduce`` does), so the build is skipped.
- ``cpu-adam-powers``: DeepSpeed's ``FusedAdam`` (its optimizer for ``"Adam"``/``"AdamW"``
  without ``torch_adam``) runs on the CPU through its CPU Adam kernel, which keeps the bias
  corrections' powers beta^t in the process and multiplies them by beta at each consecutive
  step, computing ``pow(beta, t)`` only at a jump. Its GPU kernel computes ``pow(beta, t)``
  from the step every time. A process that joins a job at step t (a standby in a lost rank's
  place) would jump where the lost rank had multiplied, and round otherwise. The kernel's
  powers are forgotten before every ``FusedAdam.step``, so each step computes them from t,
  as on a GPU.
- ``local-rank``: ``PipelineModule`` reads ``LOCAL_RANK`` from the environment and fails
  without it; a process started outside DeepSpeed's launcher (a standby, a test) gets ``0``
  when it has none.
- ``subgroup-timeout``: DeepSpeed creates its subgroups (pipeline, data-parallel, model groups)
  with ``torch.distributed.new_group(ranks)`` and no timeout, so a hung peer blocks them for
  torch's 30-minute default whatever timeout ``init_distributed`` was given. The subgroups get
  the default group's timeout instead (the ``mover`` group's own, or DeepSpeed's
  ``DEEPSPEED_TIMEOUT``).
- ``reentrant-train-batch``: a ``PipelineEngine.train_batch`` that raised (a peer was lost)
  leaves its timers started, and the next call fails with "timer has already been started";
  the engine's timers are reset when ``train_batch`` raises.

The last three are not about the CPU: they also form the ``deepspeed-resilience`` group, which
a resilient job applies on GPUs.

The ``deepspeed-local-collectives`` group complements ``local-collectives`` for a joining
standby's build and the forward that shapes its catch-up's stand-in outputs: DeepSpeed's torch
backend keeps its own references to ``all_gather_into_tensor`` and ``reduce_scatter_tensor``,
taken when it was created, and ZeRO stage 3's parameter coordinator checks that every rank
recorded the same trace (a broadcast from rank 0, which a local one cannot answer).
"""

from __future__ import annotations

import functools
import importlib
import os
from datetime import timedelta
from typing import Any

import torch

from mover_plugin.patches.local_collectives import _gather_into_tensor_locally, no_op
from mover_plugin.patches.registry import AttributeSwap, Patch, Undo, register_patch

GROUP = "deepspeed-cpu"
RESILIENCE_GROUP = "deepspeed-resilience"
"""The patches of :data:`GROUP` a resilient job needs on any device (all but ``no-shm-op``)."""
LOCAL_COLLECTIVES_GROUP = "deepspeed-local-collectives"
TESTED_VERSIONS = ">=0.19.8,<0.20"


def _torch_backend_module() -> Any:
    # ``import deepspeed.comm.torch as m`` would bind the torch package: deepspeed.comm
    # re-exports the name ``torch``.
    return importlib.import_module("deepspeed.comm.torch")


def _apply_no_shm_op() -> Undo:
    swap = AttributeSwap()
    swap.set_attr(_torch_backend_module(), "build_shm_op", lambda: None)
    return swap.restore


def _apply_local_rank() -> Undo:
    swap = AttributeSwap()
    if "LOCAL_RANK" not in os.environ:
        swap.set_item(os.environ, "LOCAL_RANK", "0")
    return swap.restore


def default_group_timeout() -> timedelta:
    """The default group's operation timeout, or DeepSpeed's default when it has none."""
    import torch.distributed.distributed_c10d as c10d
    from deepspeed.constants import default_pg_timeout

    group = c10d._get_default_group() if c10d.is_initialized() else None
    timeout = getattr(group, "timeout", None)
    return timeout if isinstance(timeout, timedelta) else default_pg_timeout


def _new_group_with_timeout(self: Any, ranks: list[int]) -> Any:
    import torch.distributed as dist

    return dist.new_group(ranks, timeout=default_group_timeout())


def _apply_subgroup_timeout() -> Undo:
    swap = AttributeSwap()
    swap.set_attr(_torch_backend_module().TorchBackend, "new_group", _new_group_with_timeout)
    return swap.restore


def _forget_adam_powers(optimizer: Any) -> None:
    """One update of a one-element scratch tensor with betas 0: the kernel's next step sees
    other betas than its last and computes its powers from the step."""
    scratch = [[torch.zeros(1)] for _ in range(4)]
    optimizer.multi_tensor_adam(1, optimizer._dummy_overflow_buf, scratch, 0.0, 0.0, 0.0, 1.0,
                                1, optimizer.adam_w_mode, 0, 0.0)


def _apply_cpu_adam_powers() -> Undo:
    from deepspeed.ops.adam import FusedAdam

    original = FusedAdam.step

    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        _forget_adam_powers(self)
        return original(self, *args, **kwargs)

    swap = AttributeSwap()
    swap.set_attr(FusedAdam, "step", step)
    return swap.restore


def _apply_reentrant_train_batch() -> Undo:
    from deepspeed.runtime.pipe.engine import PipelineEngine

    original = PipelineEngine.train_batch

    @functools.wraps(original)
    def train_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, *args, **kwargs)
        except BaseException:
            for timer in self.timers.timers.values():
                timer.reset()
            raise

    swap = AttributeSwap()
    swap.set_attr(PipelineEngine, "train_batch", train_batch)
    return swap.restore


def _apply_local_backend_functions() -> Undo:
    """The torch backend's own all-gather and reduce-scatter references act locally."""
    import deepspeed.comm.comm as ds_comm

    swap = AttributeSwap()
    backend = ds_comm.cdb
    if backend is not None:
        swap.set_attr(backend, "all_gather_function", _gather_into_tensor_locally)
        swap.set_attr(backend, "reduce_scatter_function", no_op)
    return swap.restore


def _apply_local_trace_checks() -> Undo:
    """ZeRO stage 3's parameter coordinator compares its recorded trace with rank 0's (a
    broadcast) at the start of a forward: done locally, it passes."""
    import deepspeed.runtime.zero.partitioned_param_coordinator as coordinator

    swap = AttributeSwap()
    swap.set_attr(coordinator, "assert_ints_same_as_other_ranks", no_op)
    return swap.restore


for _name, _description, _apply, _groups in (
    ("no-shm-op", "DeepSpeed's torch backend skips building its shared-memory op",
     _apply_no_shm_op, (GROUP,)),
    ("cpu-adam-powers", "FusedAdam's CPU kernel computes beta^t from the step at every step",
     _apply_cpu_adam_powers, (GROUP,)),
    ("local-rank", "LOCAL_RANK defaults to 0 for PipelineModule", _apply_local_rank,
     (GROUP, RESILIENCE_GROUP)),
    ("subgroup-timeout", "DeepSpeed's subgroups get the default group's timeout",
     _apply_subgroup_timeout, (GROUP, RESILIENCE_GROUP)),
    ("reentrant-train-batch", "a train_batch that raised resets the engine's timers",
     _apply_reentrant_train_batch, (GROUP, RESILIENCE_GROUP)),
):
    register_patch(Patch(name=_name, distribution="deepspeed", tested_versions=TESTED_VERSIONS,
                         description=_description, apply=_apply, groups=_groups))

for _name, _description, _apply in (
    ("deepspeed-local-backend-functions",
     "DeepSpeed's all-gather and reduce-scatter act locally (a joiner's build)",
     _apply_local_backend_functions),
    ("deepspeed-local-trace-checks",
     "ZeRO-3's checks that every rank recorded the same trace pass locally",
     _apply_local_trace_checks),
):
    register_patch(Patch(name=_name, distribution="deepspeed", tested_versions=TESTED_VERSIONS,
                         description=_description, apply=_apply,
                         groups=(LOCAL_COLLECTIVES_GROUP,)))
