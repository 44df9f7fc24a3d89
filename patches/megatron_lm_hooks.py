"""Hook points in Megatron-LM's training loop (``megatron.training``): the ``megatron-lm-hooks``
patch group.

mover_plugin runs an unmodified Megatron-LM entry script (``pretrain_gpt.py``). It enters
Megatron-LM's loop through the module attributes that Megatron-LM looks up at call time; this
module replaces each of them with a wrapper that hands the original to the installed
:class:`MegatronLMHooks` object. The base class passes every call straight through, so an
installed hooks object changes only what its subclass overrides. The policy (which flags, what
happens around a training step) lives with the caller (``mover_plugin.megatron.training_loop``);
this module only swaps attributes, reversibly. Each wrapper's ``__wrapped__`` is the original
(:func:`~mover_plugin.patches.hook_points.unhooked`), for a caller that must run Megatron-LM's
own function without the hooks.

Hook points (each checked on megatron-core 0.19.2 with ``pretrain_gpt.py`` at core_v0.19.0):

- ``parse_args`` in ``megatron.training.arguments`` (called by ``parse_and_validate_args`` and by
  ``inprocess_restart``): :meth:`MegatronLMHooks.add_arguments` adds flags to Megatron-LM's
  parser, after the script's own ``extra_args_provider``.
- ``parse_and_validate_args`` in ``megatron.training.arguments`` (bound by name when the
  script's module code runs, so the hooks must be installed before):
  :meth:`MegatronLMHooks.around_arguments`.
- ``pretrain`` in ``megatron.training.training`` and its re-export in ``megatron.training``
  (called by the script): :meth:`MegatronLMHooks.around_pretrain`.
- ``_initialize_distributed`` in ``megatron.training.initialize`` (called by
  ``initialize_megatron``): :meth:`MegatronLMHooks.around_initialize_distributed`.
- ``setup_model_and_optimizer``, ``build_train_valid_test_data_iterators`` and ``train`` in
  ``megatron.training.training`` (called by ``pretrain``):
  :meth:`MegatronLMHooks.around_setup`, :meth:`MegatronLMHooks.around_data_iterators` and
  :meth:`MegatronLMHooks.around_train`.
- ``load_checkpoint`` in ``megatron.training.training`` (called by
  ``setup_model_and_optimizer`` with ``--load``): :meth:`MegatronLMHooks.around_load`.
- ``train_step`` and ``training_log`` in ``megatron.training.training`` (called by ``train``
  for every iteration): :meth:`MegatronLMHooks.around_train_step` and
  :meth:`MegatronLMHooks.around_training_log`.
- ``build_train_valid_test_datasets`` (called by the data iterators' set-up),
  ``save_checkpoint_and_time`` and ``evaluate_and_print_results`` (called by ``train`` and
  ``pretrain``) in ``megatron.training.training``: :meth:`MegatronLMHooks.around_datasets`,
  :meth:`MegatronLMHooks.around_save` and :meth:`MegatronLMHooks.around_evaluation`.
- ``BlendedMegatronDatasetBuilder.__init__`` in ``megatron.core.datasets`` (the scripts'
  dataset providers make one): :meth:`MegatronLMHooks.around_dataset_builder`.

Use::

    from mover_plugin.patches.megatron_lm_hooks import MegatronLMHooks, install_hooks

    applied = install_hooks(MyHooks())   # imports megatron.training
    ...
    applied.revert()
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from typing import Any

from mover_plugin.patches.hook_points import HookPoints
from mover_plugin.patches.megatron_cpu import DISTRIBUTION, TESTED_VERSIONS
from mover_plugin.patches.registry import (
    AppliedPatches,
    AttributeSwap,
    Patch,
    Undo,
    register_patch,
)

GROUP = "megatron-lm-hooks"


class MegatronLMHooks:
    """What runs at each hook point; every method passes the call through unchanged."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Adds flags to Megatron-LM's parser (the shape of an ``extra_args_provider``)."""
        return parser

    def around_arguments(self, parse: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``parse_and_validate_args``; returns Megatron-LM's ``args``."""
        return parse(*args, **kwargs)

    def around_pretrain(self, pretrain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``pretrain(cfg_container, datasets_provider, model_type, forward_step_func,
        model_provider=..., ...)``: the whole run."""
        return pretrain(*args, **kwargs)

    def around_initialize_distributed(self, initialize: Callable[..., Any], *args: Any,
                                      **kwargs: Any) -> Any:
        """Runs ``_initialize_distributed(get_embedding_ranks, get_position_embedding_ranks,
        store, ...)``: ``init_process_group`` unless the default group exists, then the
        model-parallel groups."""
        return initialize(*args, **kwargs)

    def around_setup(self, setup: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``setup_model_and_optimizer(model_type, ...)``; returns (model chunks,
        optimizer, scheduler)."""
        return setup(*args, **kwargs)

    def around_load(self, load: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``load_checkpoint(model, optimizer, opt_param_scheduler, ...)`` at start-up;
        returns (iteration, floating-point operations so far)."""
        return load(*args, **kwargs)

    def around_data_iterators(self, build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``build_train_valid_test_data_iterators(provider, ...)``."""
        return build(*args, **kwargs)

    def around_train(self, train: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``train(forward_step_func, model, optimizer, opt_param_scheduler, ...)``."""
        return train(*args, **kwargs)

    def around_train_step(self, train_step: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        """Runs ``train_step(forward_step_func, data_iterator, model, optimizer, scheduler,
        config, forward_backward_func, iteration=...)``: one iteration."""
        return train_step(*args, **kwargs)

    def around_training_log(self, training_log: Callable[..., Any], *args: Any,
                            **kwargs: Any) -> Any:
        """Runs ``training_log(loss_dict, total_loss_dict, ..., is_first_iteration=...)``
        after every iteration; returns its ``report_memory_flag``."""
        return training_log(*args, **kwargs)

    def around_datasets(self, build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``build_train_valid_test_datasets(provider, ...)``; returns the training,
        validation and test datasets (None where this rank builds none)."""
        return build(*args, **kwargs)

    def around_dataset_builder(self, init: Callable[..., None], builder: Any, *args: Any,
                               **kwargs: Any) -> None:
        """Runs Megatron-Core's ``BlendedMegatronDatasetBuilder.__init__(builder, cls, sizes,
        is_built_on_rank, config)``: the builder of every dataset a script builds with it."""
        init(builder, *args, **kwargs)

    def around_save(self, save: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``save_checkpoint_and_time(iteration, model, optimizer, ...)``: every
        checkpoint ``train()`` and ``pretrain`` write."""
        return save(*args, **kwargs)

    def around_evaluation(self, evaluate: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Runs ``evaluate_and_print_results(prefix, forward_step_func, data_iterator, model,
        ...)``: every evaluation ``train()`` and ``pretrain`` run."""
        return evaluate(*args, **kwargs)


_HOOKS: HookPoints[MegatronLMHooks] = HookPoints(GROUP, "Megatron-LM hooks")


def installed_hooks() -> MegatronLMHooks:
    """The hooks object the patched hook points call."""
    return _HOOKS.installed()


def install_hooks(hooks: MegatronLMHooks) -> AppliedPatches:
    """Points every hook point at ``hooks``; ``revert()`` of the result takes them out."""
    return _HOOKS.install(hooks)


def _hook_point(name: str, description: str
                ) -> Callable[[Callable[[AttributeSwap], None]], Callable[[AttributeSwap], None]]:
    def decorate(swap_in: Callable[[AttributeSwap], None]) -> Callable[[AttributeSwap], None]:
        def apply() -> Undo:
            swap = AttributeSwap()
            swap_in(swap)
            return _HOOKS.undo_with(swap)

        register_patch(Patch(name=name, distribution=DISTRIBUTION,
                             tested_versions=TESTED_VERSIONS, description=description,
                             apply=apply, groups=(GROUP,)))
        return swap_in

    return decorate


@_hook_point("lm-arguments", "Megatron-LM's argument parsing calls the installed hooks")
def _swap_arguments(swap: AttributeSwap) -> None:
    arguments = importlib.import_module("megatron.training.arguments")
    parse_args = arguments.parse_args
    parse_and_validate = arguments.parse_and_validate_args

    def parse_args_with_hooks(extra_args_provider: Any = None, *args: Any, **kwargs: Any) -> Any:
        def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
            if extra_args_provider is not None:
                parser = extra_args_provider(parser)
            return installed_hooks().add_arguments(parser)

        return parse_args(provider, *args, **kwargs)

    def parse_and_validate_with_hooks(*args: Any, **kwargs: Any) -> Any:
        return installed_hooks().around_arguments(parse_and_validate, *args, **kwargs)

    swap.set_attr(arguments, "parse_args", parse_args_with_hooks)
    swap.set_attr(arguments, "parse_and_validate_args", parse_and_validate_with_hooks)


def _wrap(swap: AttributeSwap, module_name: str, name: str, hook: str) -> None:
    _HOOKS.swap_to_hook(swap, module_name, name, hook)


@_hook_point("lm-pretrain", "Megatron-LM's pretrain() runs inside the installed hooks")
def _swap_pretrain(swap: AttributeSwap) -> None:
    _wrap(swap, "megatron.training.training", "pretrain", "around_pretrain")
    _wrap(swap, "megatron.training", "pretrain", "around_pretrain")


@_hook_point("lm-distributed", "Megatron-LM's distributed set-up runs inside the installed "
             "hooks")
def _swap_distributed(swap: AttributeSwap) -> None:
    _wrap(swap, "megatron.training.initialize", "_initialize_distributed",
          "around_initialize_distributed")


@_hook_point("lm-load", "Megatron-LM's start-up load_checkpoint() runs inside the installed "
             "hooks")
def _swap_load(swap: AttributeSwap) -> None:
    _wrap(swap, "megatron.training.training", "load_checkpoint", "around_load")


@_hook_point("lm-train", "Megatron-LM's model set-up, data iterators, train(), train_step(), "
             "training_log(), datasets, checkpoints and evaluations run inside the installed "
             "hooks")
def _swap_train(swap: AttributeSwap) -> None:
    for name, hook in (("setup_model_and_optimizer", "around_setup"),
                       ("build_train_valid_test_data_iterators", "around_data_iterators"),
                       ("train", "around_train"), ("train_step", "around_train_step"),
                       ("training_log", "around_training_log"),
                       ("build_train_valid_test_datasets", "around_datasets"),
                       ("save_checkpoint_and_time", "around_save"),
                       ("evaluate_and_print_results", "around_evaluation")):
        _wrap(swap, "megatron.training.training", name, hook)


@_hook_point("lm-dataset-builder", "Megatron-Core's dataset builder is set up inside the "
             "installed hooks")
def _swap_dataset_builder(swap: AttributeSwap) -> None:
    module = importlib.import_module("megatron.core.datasets.blended_megatron_dataset_builder")
    builder_class = module.BlendedMegatronDatasetBuilder
    init = builder_class.__init__

    def init_with_hooks(builder: Any, *args: Any, **kwargs: Any) -> None:
        installed_hooks().around_dataset_builder(init, builder, *args, **kwargs)

    init_with_hooks.__wrapped__ = init  # type: ignore[attr-defined]
    swap.set_attr(builder_class, "__init__", init_with_hooks)
