"""A standby's warm-up on Megatron-LM's own training loop, with Megatron-LM's own code.

On the drop-in path (:mod:`mover_plugin.megatron.training_loop`) a standby warms up inside
Megatron-LM's distributed set-up (``_initialize_distributed``), before it waits for its
promotion, as a Megatron-Core script's standby does (:mod:`mover_plugin.megatron.standby`:
every pipeline role played in the sandbox, each role's objects kept and adopted on promotion
where they fit). Each role is played with what Megatron-LM runs itself:

- its groups: Megatron-LM's ``_initialize_distributed`` on the sandbox's default group, then
  the seeding ``initialize_megatron`` does next (``_set_random_seed``);
- its model, optimizer and scheduler: Megatron-LM's ``setup_model_and_optimizer`` with the
  model type and model provider (or config container) the script gave ``pretrain``
  (:class:`PretrainCall`), without loading ``--load``;
- each shadow iteration: Megatron-LM's ``train_step`` with the script's forward step, the
  training settings ``train()`` puts on the model's config, and *shadow batches*
  (:func:`shadow_batches`).

Shadow batches are micro-batches in the form of Megatron-Core's GPT datasets (``tokens``,
``labels``, ``loss_mask``, ``position_ids``, and ``attention_mask`` with
``--create-attention-mask-in-dataloader``) of random tokens: no dataset is built or read in the
sandbox (building one there would write its index cache beside the job's first rank). A script
whose forward step needs other fields fails its warm-up; the standby then stays cold (logged)
and builds its model once promoted.

What the warm-up changes of Megatron-LM's global state is put back afterwards
(:func:`megatron_state_kept`): ``args`` (the rank, the iteration the set-up wrote), the timers
and the rerun state machine's iteration counter.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch

from mover_plugin.megatron.standby import StandbyWarmUp, TrainingObjects
from mover_plugin.patches.hook_points import unhooked

TRAINING_SETTINGS = ("grad_scale_func", "timers", "no_sync_func", "grad_sync_func",
                     "param_sync_func", "finalize_model_grads_func")
"""The model config's fields Megatron-LM's ``train()`` sets before its first iteration."""


@dataclass
class TrainingSettings:
    """The :data:`TRAINING_SETTINGS` of a model's config as they were, to put back."""

    config: Any
    values: dict[str, Any]

    @classmethod
    def of(cls, model: list[Any]) -> "TrainingSettings":
        from megatron.core.utils import get_model_config

        config = get_model_config(model[0])
        return cls(config, {name: getattr(config, name, None) for name in TRAINING_SETTINGS})

    def restore(self) -> None:
        for name, value in self.values.items():
            setattr(self.config, name, value)


@dataclass(frozen=True)
class PretrainCall:
    """What the script gave Megatron-LM's ``pretrain`` that a standby's warm-up needs."""

    model_type: Any
    forward_step: Callable[..., Any]
    model_provider: Optional[Callable[..., Any]]
    cfg_container: Any

    @classmethod
    def of(cls, pretrain: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> Optional["PretrainCall"]:
        """The call ``pretrain(*args, **kwargs)``; None if it does not name a model type and
        a forward step (then no warm-up)."""
        try:
            given = inspect.signature(pretrain).bind(*args, **kwargs).arguments
        except TypeError:
            return None
        if given.get("model_type") is None or given.get("forward_step_func") is None:
            return None
        return cls(given["model_type"], given["forward_step_func"],
                   given.get("model_provider"), given.get("cfg_container"))


def lm_warm_up(args: argparse.Namespace, call: PretrainCall, initialize: Callable[[], Any],
               parallel: dict[str, Any]) -> StandbyWarmUp:
    """The warm-up of a standby of Megatron-LM's loop: ``initialize`` is Megatron-LM's
    ``_initialize_distributed`` as ``initialize_megatron`` called it, ``parallel`` the
    layout's ``initialize_model_parallel`` arguments."""

    def initialize_groups() -> None:
        from megatron.training.initialize import _set_random_seed

        initialize()  # the sandbox's default group exists: only the model-parallel groups
        _set_random_seed(args.seed, args.data_parallel_random_init, args.te_rng_tracker,
                         args.inference_rng_tracker,
                         use_cudagraphable_rng=args.cuda_graph_impl != "none")

    def build() -> TrainingObjects:
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.training import training

        setup = unhooked(training.setup_model_and_optimizer)
        with without_checkpoint(args):
            return setup(call.model_type, model_provider_func=call.model_provider,
                         checkpointing_context={}, cfg_container=call.cfg_container,
                         pg_collection=ProcessGroupCollection.use_mpu_process_groups())

    def shadow_step(model: Any, optimizer: Any, scheduler: Any) -> Any:
        from megatron.core.pipeline_parallel import get_forward_backward_func
        from megatron.core.rerun_state_machine import RerunDataIterator
        from megatron.training import training

        train_step = unhooked(training.train_step)
        # With virtual pipeline stages, one data iterator per model chunk (as pretrain's).
        batches = [RerunDataIterator(shadow_batches(args)) for _ in model]
        with training_settings(args, model, optimizer) as config:
            return train_step(call.forward_step, batches[0] if len(batches) == 1 else batches,
                              model, optimizer, scheduler, config,
                              get_forward_backward_func(), iteration=0)

    return StandbyWarmUp(parallel, build, shadow_step, initialize_groups=initialize_groups)


def shadow_batches(args: argparse.Namespace) -> Iterator[dict[str, torch.Tensor]]:
    """Endless micro-batches of random tokens in the form of Megatron-Core's GPT datasets,
    collated as Megatron-LM's data loader collates them."""
    generator = torch.Generator().manual_seed(args.seed)
    size, length = args.micro_batch_size, args.seq_length
    position_ids = torch.arange(length, dtype=torch.int64).expand(size, length)
    causal_mask = None
    if getattr(args, "create_attention_mask_in_dataloader", False):
        causal_mask = (torch.tril(torch.ones(length, length)) < 0.5).expand(size, 1, length,
                                                                             length)
    while True:
        text = torch.randint(0, args.padded_vocab_size, (size, length + 1),
                             generator=generator, dtype=torch.int64)
        batch = {"tokens": text[:, :-1].contiguous(), "labels": text[:, 1:].contiguous(),
                 "loss_mask": torch.ones(size, length), "position_ids": position_ids.clone()}
        if causal_mask is not None:
            batch["attention_mask"] = causal_mask.clone()
        yield batch


@contextlib.contextmanager
def training_settings(args: argparse.Namespace, model: list[Any],
                      optimizer: Any) -> Iterator[Any]:
    """The model config as Megatron-LM's ``train()`` sets it up for ``train_step``; put back
    as it was afterwards (``train()`` checks that some of them are unset)."""
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.training.global_vars import get_timers

    saved = TrainingSettings.of(model)
    config = saved.config
    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    if isinstance(model[0], DistributedDataParallel) and args.overlap_grad_reduce:
        config.no_sync_func = _per_chunk([chunk.no_sync for chunk in model])
        if args.align_grad_reduce:
            config.grad_sync_func = _per_chunk([chunk.start_grad_sync for chunk in model])
    if args.overlap_param_gather and args.align_param_gather:
        config.param_sync_func = _per_chunk([chunk.start_param_sync for chunk in model])
    if config.finalize_model_grads_func is None:
        config.finalize_model_grads_func = finalize_model_grads
    try:
        yield config
    finally:
        saved.restore()


def _per_chunk(functions: list[Callable[..., Any]]) -> Any:
    return functions[0] if len(functions) == 1 else functions


@contextlib.contextmanager
def megatron_state_kept(args: argparse.Namespace) -> Iterator[None]:
    """Megatron-LM's global state as it was before the block: every value of ``args``, the
    timers, and the rerun state machine's state and iteration counter."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine
    from megatron.training.global_vars import get_timers

    values = dict(vars(args))
    timers = get_timers()
    kept_timers = {name: dict(getattr(timers, name, {})) for name in ("_timers", "_log_levels")}
    machine = get_rerun_state_machine()
    machine_state = (machine.state, machine.current_iteration)
    try:
        yield
    finally:
        vars(args).clear()
        vars(args).update(values)
        for name, kept in kept_timers.items():
            if hasattr(timers, name):
                setattr(timers, name, kept)
        machine.state, machine.current_iteration = machine_state


@contextlib.contextmanager
def without_checkpoint(args: argparse.Namespace) -> Iterator[None]:
    """Megatron-LM's model set-up without loading its checkpoint (a joiner's state comes
    from its twin; a warm-up's is never used)."""
    names = ("load", "pretrained_checkpoint")
    saved = {name: getattr(args, name, None) for name in names}
    for name in names:
        setattr(args, name, None)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)
