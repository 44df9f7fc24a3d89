"""Megatron-LM's own training loop (``megatron.training``) under mover_plugin: the drop-in.

A user keeps Megatron-LM's entry script (``pretrain_gpt.py``) and its flags, and swaps
``torchrun`` for ``mover-launch``. Every worker runs the script through
``python -m mover_plugin.launch.run``, which calls :func:`before_megatron_import` before the
first import of ``megatron.core`` and :func:`after_megatron_training_import` after the first
import of ``megatron.training``:

- without triton installed, stand-ins for the two modules of megatron-core that import it;
- on a machine without CUDA, the ``megatron-cpu`` and ``megatron-lm-cpu`` patch groups
  (:mod:`mover_plugin.patches.megatron_lm_cpu`) stand in for what Megatron-LM assumes of CUDA,
  with no flag from the user;
- :class:`DropInHooks` is installed at Megatron-LM's hook points
  (:mod:`mover_plugin.patches.megatron_lm_hooks`): it adds mover_plugin's flags to
  Megatron-LM's parser (``--resilient`` and its ``--resilient-*`` settings, as the example
  script has them, and ``--resilient-params-digest``), checks them after Megatron-LM's own
  ``validate_args``, answers ``mover-launch``'s flag check (``MOVER_PREFLIGHT=1``) right after
  the arguments are validated, before any process group exists, and at the end of ``train()``
  prints ``PARAMS_DIGEST`` when asked. With ``--resilient`` it hands Megatron-LM's distributed
  set-up, model set-up, data iterators and every ``train_step`` to the resilience runtime
  (:class:`~mover_plugin.megatron.lm_resilience.MegatronLMResilience`): a standby, warmed up
  with the model provider and forward step the script gave ``pretrain``, takes a lost rank's
  place inside the running loop.

``torchrun`` users get the same behaviour with ``torchrun ... -m mover_plugin.launch.run
pretrain_gpt.py ...``, which is how a failure-free ``torchrun`` run is compared with a
``mover-launch`` run.

Mixture-of-experts layers (``--num-experts``, ``--expert-model-parallel-size``) are resilient
when every rank's experts have a twin (an expert-data-parallel size of at least 2) or travel in
the distributed optimizer's shard. Not yet on this path with ``--resilient``: experts with
neither, context parallelism and Megatron-LM's own in-process restart are refused before the
job starts.
"""

from __future__ import annotations

import argparse
import functools
import logging
import time
import traceback
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Optional

from mover_plugin.errors import ConfigError
from mover_plugin.layout import ParallelLayout
from mover_plugin.progress import ProgressReporter
from mover_plugin.patches.megatron_lm_hooks import MegatronLMHooks, install_hooks
from mover_plugin.runtime.preflight import exit_checked, exit_with_error, in_preflight
from mover_plugin.runtime.settings import ResilienceSettings, add_resilience_args

if TYPE_CHECKING:
    from mover_plugin.megatron.lm_resilience import MegatronLMResilience
    from mover_plugin.megatron.lm_standby import PretrainCall

logger = logging.getLogger(__name__)

DIGEST_FLAG = "--resilient-params-digest"


def before_megatron_import() -> None:
    """Runs just before the first module of Megatron (``megatron.core``) is imported: without
    triton, the stand-ins for the two modules that import it (``notriton``), unless the
    script applied them itself."""
    from mover_plugin.patches import apply_inactive_patches

    apply_inactive_patches(["notriton"])


def after_megatron_training_import() -> None:
    """Runs right after ``megatron.training`` is imported, before the script's code binds any
    of its names: the CPU stand-ins (without CUDA), the ``mover`` backend's answers to
    Megatron-LM's helpers that ask for the backend's name, and the hooks."""
    import torch

    from mover_plugin.patches import apply_inactive_patches

    if not torch.cuda.is_available():
        apply_inactive_patches(["megatron-cpu", "megatron-lm-cpu"])
    apply_inactive_patches(["megatron-lm-backend"])
    install_hooks(DropInHooks())


def failing_line(error: BaseException) -> str:
    """The source line where ``error`` was raised (``assert args.save_interval is not
    None``)."""
    frames = traceback.extract_tb(error.__traceback__)
    return (frames[-1].line or "").strip() if frames else ""


class DropInHooks(MegatronLMHooks):
    """mover_plugin's behaviour at Megatron-LM's hook points (see the module docstring)."""

    def __init__(self) -> None:
        self.resilience: Optional["MegatronLMResilience"] = None
        """The runtime of a ``--resilient`` process, from its distributed set-up on."""
        self._data_iterators = DataIteratorBuilds()
        """Megatron-LM's data iterators built again (after a rollback)."""
        self._progress: Optional[ProgressReporter] = None
        """Step reports to ``mover-launch``'s agent without ``--resilient`` (the runtime makes
        its own): for ``--inject-failure``, the restart policy's summary and hang detection."""
        self._pretrain: Optional["PretrainCall"] = None
        """What the script gave Megatron-LM's ``pretrain`` (a standby warms up with it)."""
        self._train_dataset: Any = None
        """The training dataset Megatron-LM built on this rank, last time it built one."""
        self._build_everywhere = False
        """While a middle pipeline stage builds the datasets for the pipeline templates."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """mover_plugin's flags on Megatron-LM's parser."""
        if in_preflight():
            parser.error = _raise_config_error  # type: ignore[method-assign]
        add_resilience_args(parser)
        parser.add_argument_group("mover_plugin").add_argument(
            DIGEST_FLAG, action="store_true",
            help="At the end of training print PARAMS_DIGEST <hex>: one hash of every rank's "
            "parameters, equal between two runs only if every parameter is bit-identical.")
        return parser

    def around_arguments(self, parse: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's ``parse_and_validate_args``, then mover_plugin's checks; during the
        launcher's flag check, reports the outcome and exits."""
        preflight = in_preflight()
        try:
            parsed = parse(*args, **kwargs)
            check_arguments(parsed)
        except ConfigError as error:
            exit_with_error(error)
        except (AssertionError, ValueError, TypeError) as error:
            if not preflight:
                raise
            # Megatron-LM's validate_args reports bad values with assertions, most of them
            # without a message: the failing line names the flag.
            exit_with_error(str(error) or f"{type(error).__name__} in Megatron-LM's "
                            f"validate_args: {failing_line(error)}")
        if preflight:
            exit_checked(bool(parsed.resilient))
        return parsed

    def around_pretrain(self, pretrain: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's ``pretrain``, its model type, model provider and forward step noted
        for a standby's warm-up."""
        from mover_plugin.megatron.lm_standby import PretrainCall

        self._pretrain = PretrainCall.of(pretrain, args, kwargs)
        return pretrain(*args, **kwargs)

    def around_initialize_distributed(self, initialize: Callable[..., Any], *args: Any,
                                      **kwargs: Any) -> Any:
        """With ``--resilient``: the runtime's default group (a standby waits for its rank
        first), and Megatron-LM's model-parallel groups on it."""
        from megatron.training import get_args

        megatron_args = get_args()
        if not megatron_args.resilient:
            return initialize(*args, **kwargs)
        from mover_plugin.megatron.lm_resilience import MegatronLMResilience

        self.resilience = MegatronLMResilience(megatron_args, self._pretrain)
        self.resilience.start_distributed(lambda: initialize(*args, **kwargs))
        return None

    def around_setup(self, setup: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self.resilience is None:
            return setup(*args, **kwargs)
        return self.resilience.setup(lambda: setup(*args, **kwargs))

    def around_load(self, load: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's start-up ``load_checkpoint``; with a distributed optimizer over torch's
        Adam (no TE or Apex, as on CPU) without autograd, and its step counters set from the
        loaded parameter groups after (:func:`~mover_plugin.megatron.distributed_optimizer.
        load_with_torch_adam`)."""
        from mover_plugin.megatron.distributed_optimizer import load_with_torch_adam

        return load_with_torch_adam(lambda: load(*args, **kwargs),
                                    _argument(args, kwargs, 1, "optimizer"))

    def around_data_iterators(self, build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """With virtual pipeline stages Megatron-LM builds the data iterators once per model
        chunk (its provider bound to the chunk's ``vp_stage``): a joiner receives its state
        before the first chunk's, and the job may shrink once the last chunk's exist."""
        chunk = virtual_stage(_argument(args, kwargs, 0,
                                        "build_train_valid_test_datasets_provider"))
        if chunk in (None, 0):
            self._data_iterators = DataIteratorBuilds()
            if self.resilience is not None:
                self.resilience.before_data_iterators()
        self._data_iterators.add(lambda: build(*args, **kwargs))
        iterators = build(*args, **kwargs)
        if self.resilience is not None and self._is_last_chunk(chunk):
            self.resilience.after_data_iterators(self._train_dataset)
        return iterators

    @staticmethod
    def _is_last_chunk(chunk: Optional[int]) -> bool:
        from megatron.training import get_args

        chunks = get_args().virtual_pipeline_model_parallel_size
        return chunk is None or chunks is None or chunk == chunks - 1

    def around_datasets(self, build: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The datasets, and the training one kept for the pipeline templates. A middle
        pipeline stage of a job that may shrink onto templates builds them too (a template
        may make it a first or last stage) and hands Megatron-LM's loop none, as it would have
        built none."""
        everywhere = self.resilience is not None and self.resilience.middle_stage_reads_data()
        self._build_everywhere = everywhere
        try:
            datasets = build(*args, **kwargs)
        finally:
            self._build_everywhere = False
        self._train_dataset = datasets[0]
        return tuple(None for _ in datasets) if everywhere else datasets

    def around_dataset_builder(self, init: Callable[..., None], builder: Any, *args: Any,
                               **kwargs: Any) -> None:
        if self._build_everywhere:
            from mover_plugin.megatron.templates.megatron_lm import built_on_this_rank_too

            args, kwargs = built_on_this_rank_too(init, builder, args, kwargs)
        init(builder, *args, **kwargs)

    def around_save(self, save: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's checkpoint, skipped while the job trains on pipeline templates (the
        script's model rests; the final parameters are written by unit at the end)."""
        if self._on_templates():
            from mover_plugin.megatron.templates.megatron_lm import skipped_on_templates

            iteration = _argument(args, kwargs, 0, "iteration")
            return skipped_on_templates(f"Megatron-LM's checkpoint at iteration {iteration}")
        return save(*args, **kwargs)

    def around_evaluation(self, evaluate: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's evaluation, skipped while the job trains on pipeline templates."""
        if self._on_templates():
            from mover_plugin.megatron.templates.megatron_lm import skipped_on_templates

            prefix = _argument(args, kwargs, 0, "prefix")
            return skipped_on_templates(f"Megatron-LM's evaluation ({prefix})")
        return evaluate(*args, **kwargs)

    def _on_templates(self) -> bool:
        return self.resilience is not None and self.resilience.on_templates

    def around_train_step(self, train_step: Callable[..., Any], *args: Any,
                          **kwargs: Any) -> Any:
        if self.resilience is None:
            return self._reported_step(lambda: train_step(*args, **kwargs), kwargs["iteration"])
        data_iterator = kwargs["data_iterator"] if "data_iterator" in kwargs else args[1]
        return self.resilience.train_step(lambda: train_step(*args, **kwargs),
                                          kwargs["iteration"], data_iterator)

    def _reported_step(self, train_step: Callable[[], Any], iteration: int) -> Any:
        if self._progress is None:
            self._progress = ProgressReporter.from_env()
            self._progress.ready(iteration)
        started = time.perf_counter()
        self._progress.step_begin(iteration + 1)
        result = train_step()
        self._progress.step_end(iteration + 1, time.perf_counter() - started)
        return result

    def around_training_log(self, training_log: Callable[..., Any], *args: Any,
                            **kwargs: Any) -> Any:
        if self.resilience is None:
            return training_log(*args, **kwargs)
        if self.resilience.joined_in_place:
            # Megatron-LM logs a process's first iteration whatever the log interval, with a
            # WORLD barrier and gather; a joiner's first is not the job's: log as the others.
            kwargs["is_first_iteration"] = False
        if self.resilience.on_templates:
            kwargs["pg_collection"] = self.resilience.templates.stage_groups  # the model's rest
        report_memory_flag = kwargs["report_memory_flag"] if "report_memory_flag" in kwargs \
            else args[5]
        return self.resilience.between_steps(lambda: training_log(*args, **kwargs),
                                             report_memory_flag)

    def around_train(self, train: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Megatron-LM's ``train()`` (entered again from the checkpoint after a rollback);
        then ``PARAMS_DIGEST`` when asked, and the runtime of a ``--resilient`` process stops
        following the job."""
        from mover_plugin.megatron.lm_resilience import RolledBack
        from mover_plugin.megatron.lm_standby import TrainingSettings

        # train() sets up the model config at its start and checks some fields are unset.
        settings = TrainingSettings.of(_argument(args, kwargs, 1, "model"))
        while True:
            if self.resilience is not None:
                self.resilience.entering_train(_argument(args, kwargs, 8,
                                                         "checkpointing_context"))
            try:
                result = train(*args, **kwargs)
                break
            except RolledBack:
                settings.restore()
                args, kwargs = self._with_new_data_iterators(args, kwargs)
            except SystemExit:
                # Megatron-LM ends train() early (--exit-interval, --exit-duration-in-mins,
                # its signal handler) with a checkpoint, which is skipped while shrunk: the
                # parameters go to --save by unit instead.
                if self.resilience is not None and self.resilience.on_templates:
                    self.resilience.finish()
                raise
        from megatron.training import get_args

        megatron_args = get_args()
        if megatron_args.resilient_params_digest:
            self._report_digest(megatron_args, kwargs["model"] if "model" in kwargs else args[1])
        if self.resilience is not None:
            self.resilience.finish()
        return result

    def _report_digest(self, megatron_args: argparse.Namespace, model: Any) -> None:
        """``PARAMS_DIGEST`` of the script's model; none for a job that ended on pipeline
        templates, whose parameters go to --save by unit (the resilience's finish)."""
        if not self._on_templates():
            report_digest(megatron_args, model)
            return
        import torch.distributed as dist

        if dist.get_rank() == 0:  # the first survivor
            print("PARAMS_DIGEST none: the job ended on pipeline templates", flush=True)

    def _with_new_data_iterators(self, args: tuple[Any, ...], kwargs: dict[str, Any]
                                 ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``train()``'s arguments with training and validation data iterators built again
        (from the counters the checkpoint restored)."""
        assert self.resilience is not None, "only a --resilient job rolls back"
        train_iterator, valid_iterator, _ = self.resilience.rebuild_data_iterators(
            self._data_iterators.build)
        positional = list(args)
        for index, name, value in ((4, "train_data_iterator", train_iterator),
                                   (5, "valid_data_iterator", valid_iterator)):
            if name in kwargs:
                kwargs[name] = value
            else:
                positional[index] = value
        return tuple(positional), kwargs


class DataIteratorBuilds:
    """How Megatron-LM built this rank's data iterators, to build them again after a rollback:
    one call of ``build_train_valid_test_data_iterators``, or one per model chunk with
    virtual pipeline stages (then each of the training, validation and test iterators is a
    list with one per chunk, as ``pretrain`` makes them)."""

    def __init__(self) -> None:
        self._builds: list[Callable[[], Any]] = []

    def add(self, build: Callable[[], Any]) -> None:
        self._builds.append(build)

    def build(self) -> Any:
        if not self._builds:
            return None, None, None
        if len(self._builds) == 1:
            return self._builds[0]()
        per_chunk = [build() for build in self._builds]
        return tuple([iterators[kind] for iterators in per_chunk] for kind in range(3))


def virtual_stage(provider: Any) -> Optional[int]:
    """The model chunk a dataset provider builds for: Megatron-LM binds ``vp_stage`` to its
    provider (a ``functools.partial``) with virtual pipeline stages; None without."""
    if isinstance(provider, functools.partial):
        return provider.keywords.get("vp_stage")
    return None


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str) -> Any:
    """An argument of a hooked call, by keyword or by position (None if not given)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def _raise_config_error(message: str) -> NoReturn:
    raise ConfigError(message)


def check_arguments(args: argparse.Namespace) -> None:
    """mover_plugin's checks of Megatron-LM's validated ``args``. Nothing but plain values is
    added to ``args`` (``args.template_profile``: the checked profile's record, a dict of
    numbers and names): Megatron-LM saves them in its checkpoints, which load with
    ``weights_only`` (and where mover_plugin is not installed)."""
    settings = ResilienceSettings.from_args(args)
    if not args.resilient:
        return
    from mover_plugin.megatron.arguments import (checked_template_profile,
                                                 refuse_given_fault_tolerance)
    from mover_plugin.megatron.templates.megatron_lm import lm_flag_refusals

    args.template_profile = checked_template_profile(args, settings.fault_tolerance)
    refuse_given_fault_tolerance(args, settings.fault_tolerance, lm_flag_refusals(args))
    if args.data_parallel_size < 2:
        raise ConfigError(
            f"--resilient needs a data-parallel twin for every rank, but the data-parallel "
            f"size is {args.data_parallel_size} (world size {args.world_size} / tensor "
            f"{args.tensor_model_parallel_size} x pipeline {args.pipeline_model_parallel_size}"
            f" x context {args.context_parallel_size}); use at least 2 data-parallel replicas")
    if not lm_layout(args).data_parallel_twins(0):
        raise ConfigError(
            f"--resilient needs a twin for every rank's experts or the distributed optimizer "
            f"(whose shard then carries them), but the expert-data-parallel size is 1 "
            f"(data-parallel size {args.data_parallel_size} x tensor "
            f"{args.tensor_model_parallel_size} / expert-model-parallel size "
            f"{args.expert_model_parallel_size} x expert-tensor-parallel size "
            f"{args.expert_tensor_parallel_size}); add --use-distributed-optimizer, or use at "
            f"least twice as many ranks per pipeline stage as the experts are split over")
    refused = {
        "--inprocess-restart": getattr(args, "inprocess_restart", False),
        "--context-parallel-size > 1": args.context_parallel_size > 1,
    }
    for flag, used in refused.items():
        if used:
            raise ConfigError(f"--resilient with {flag} is not supported yet on Megatron-LM's "
                              "training loop; drop one of them")
    # Plain gloo groups can be neither left when a peer dies nor replaced in place.
    args.use_gloo_process_groups = False


def lm_layout(args: argparse.Namespace) -> ParallelLayout:
    """The parallel layout of Megatron-LM's validated ``args``."""
    return ParallelLayout.for_world(
        args.world_size, args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
        ep=args.expert_model_parallel_size, etp=args.expert_tensor_parallel_size,
        experts_in_shard=bool(args.use_distributed_optimizer))


def report_digest(args: argparse.Namespace, model: list[Any]) -> None:
    """``PARAMS_DIGEST`` over the model chunks of every rank (same definition as the example's:
    :mod:`mover_plugin.digest`)."""
    from mover_plugin.digest import report_params_digest

    if len(model) == 1:
        named = list(model[0].module.named_parameters())
    else:
        named = [(f"chunk{index}.{name}", tensor) for index, chunk in enumerate(model)
                 for name, tensor in chunk.module.named_parameters()]
    report_params_digest(named, lm_layout(args))
