"""Megatron-LM's own training loop on pipeline templates: what a survivor trains with once the
job shrank (:mod:`mover_plugin.megatron.templates.shrunk`), built from what the script gave
Megatron-LM's ``pretrain``.

- :func:`lm_stage_recipe`: a stage of any placement is built by the script's model provider
  (or its config container's model builder) with a transformer config of the stage's layers
  alone (pipeline size 1) and the stage's process groups; its optimizer and learning-rate
  schedule are Megatron-LM's, from its flags; its forward step is the script's. Slot ``s``
  of iteration ``i``'s global batch is the micro-batch of training samples ``C + s * mbs`` to
  ``C + (s + 1) * mbs``, where ``C`` is Megatron-LM's ``consumed_train_samples`` at the
  iteration's start: the samples the job's data-parallel ranks read in that iteration
  (Megatron-LM's ``MegatronPretrainingSampler`` gives them out in order), read from the
  training dataset and collated as its data loader does.
- :class:`StageView`: what the script's code reads of the parallel layout while it trains a
  stage — Megatron-Core's ``parallel_state`` groups (tensor, context and pipeline parallel, the
  embedding groups) set to the stage's groups as ``initialize_model_parallel`` would set them
  for a job of that one pipeline, the model-parallel group to every rank's (over which the
  gradient norm is the job's), and
  Megatron-LM's ``args.pipeline_model_parallel_size`` to the pipeline's length. The
  data-parallel groups stay unset: Megatron-LM's loop then counts a global batch of
  ``data_parallel_size x micro_batch_size x micro-batches`` samples from its flags, as the job
  does.
- :func:`lm_template_refusals`: why a job cannot train on templates on this path.
- :func:`built_on_this_rank_too`: a middle pipeline stage builds the training dataset too, as
  a first or last stage does (a template may make it one); Megatron-LM's loop is handed none
  there, as it would have built none.
- :class:`MegatronLMLoop`: where Megatron-LM's loop differs from a Megatron-Core script's
  for the adapters' template unit (:mod:`mover_plugin.megatron.templates.participant`): an
  iteration runs inside Megatron-Core's rerun state machine and returns what Megatron-LM's
  ``train_step`` returns, the stage's view of the layout is left before a shrink and after
  growing back, a survivor's training data starts again where the job is, and the joining
  standbys get Megatron-LM's counters with the schedule.

While shrunk, the script's own model and optimizer rest: Megatron-LM's checkpoints and
evaluations are skipped (logged), and ``training_log`` reports the loss over the whole global
batch on every rank.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import logging
from typing import Any, Callable, Iterator, Optional

import torch

from mover_plugin.megatron.lm_counters import load_loop_state, loop_state
from mover_plugin.megatron.lm_standby import PretrainCall
from mover_plugin.megatron.templates.participant import Repeat
from mover_plugin.megatron.templates.stage import StageRecipe, StageStep, inner_model

logger = logging.getLogger(__name__)

STAGE_GROUPS = (
    ("_TENSOR_MODEL_PARALLEL_GROUP", "_TENSOR_MODEL_PARALLEL_GLOBAL_RANKS", "tp"),
    ("_CONTEXT_PARALLEL_GROUP", "_CONTEXT_PARALLEL_GLOBAL_RANKS", "cp"),
    ("_PIPELINE_MODEL_PARALLEL_GROUP", "_PIPELINE_GLOBAL_RANKS", "pp"),
    ("_MODEL_PARALLEL_GROUP", "_MODEL_PARALLEL_GLOBAL_RANKS", "mp"),
    ("_EMBEDDING_GROUP", "_EMBEDDING_GLOBAL_RANKS", "embd"),
    ("_POSITION_EMBEDDING_GROUP", "_POSITION_EMBEDDING_GLOBAL_RANKS", "pos_embd"),
)
"""Megatron-Core 0.16-0.19 ``parallel_state`` globals (group, its global ranks) a stage sets,
and the stage's ``ProcessGroupCollection`` field each comes from."""


UNEVEN_SPLIT_FLAGS = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                      "pipeline_model_parallel_layout", "account_for_embedding_in_pipeline_split",
                      "account_for_loss_in_pipeline_split")
"""Megatron-LM's flags that split the layers over the job's stages other than evenly (the
templates take a stage's first layer from an even split)."""


def lm_template_refusals(args: argparse.Namespace, call: Optional[PretrainCall]) -> list[str]:
    """Why Megatron-LM's loop with ``args``, started by ``call``, cannot train on pipeline
    templates (none: it can); the reasons common to every Megatron-Core job are
    :func:`~mover_plugin.megatron.templates.shrunk.template_spec`'s."""
    missing = call is None or (call.model_provider is None and _model_config(call) is None)
    return [*(["neither a model provider nor a model config given to pretrain()"]
              if missing else []), *lm_flag_refusals(args)]


def lm_flag_refusals(args: argparse.Namespace) -> list[str]:
    """The flags of Megatron-LM's loop among :func:`lm_template_refusals`' reasons (known before
    the script calls ``pretrain``)."""
    refused = {
        "virtual pipeline stages (--num-layers-per-virtual-pipeline-stage)":
            args.virtual_pipeline_model_parallel_size is not None,
        f"--dataloader-type {args.dataloader_type}": args.dataloader_type != "single",
        "--rampup-batch-size": getattr(args, "rampup_batch_size", None) is not None,
        "--phase-transition-iterations": bool(getattr(args, "phase_transition_iterations",
                                                      None)),
        "an uneven or custom pipeline split (--decoder-first/last-pipeline-num-layers, "
        "--pipeline-model-parallel-layout, --account-for-embedding/loss-in-pipeline-split)":
            any(getattr(args, name, None) for name in UNEVEN_SPLIT_FLAGS),
        "--mtp-num-layers": bool(getattr(args, "mtp_num_layers", None)),
        "--calculate-per-token-loss": getattr(args, "calculate_per_token_loss", False),
        "--log-params-norm": getattr(args, "log_params_norm", False),
        "--use-mup": getattr(args, "use_mup", False),
    }
    return [reason for reason, applies in refused.items() if applies]


def built_on_this_rank_too(init: Callable[..., None], builder: Any, args: tuple,
                           kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]]:
    """The arguments of Megatron-Core's ``BlendedMegatronDatasetBuilder.__init__(builder,
    *args, **kwargs)`` with ``is_built_on_rank`` answering yes: a middle pipeline stage of a job
    that may shrink onto pipeline templates builds the datasets too, since a template may make
    it a first or last stage (tensor-parallel size 1: every rank reads its own data)."""
    import inspect

    bound = inspect.signature(init).bind(builder, *args, **kwargs)
    bound.arguments["is_built_on_rank"] = lambda *_, **__: True
    return bound.args[1:], bound.kwargs


def _model_config(call: PretrainCall) -> Any:
    """The model config of the config container given to ``pretrain`` (None without one)."""
    return getattr(call.cfg_container, "model", None)


def lm_stage_recipe(args: argparse.Namespace, call: PretrainCall,
                    train_dataset: Any) -> StageRecipe:
    """How a survivor builds and trains a stage of a placement on Megatron-LM's loop."""
    from megatron.training.training import (
        get_megatron_optimizer_config,
        get_optimizer_param_scheduler,
    )

    optimizer_config, overrides = get_megatron_optimizer_config(args)
    return StageRecipe(
        build_model=lambda **stage: build_stage(args, call, **stage),
        optimizer_config=optimizer_config,
        optimizer_overrides=overrides,
        build_scheduler=get_optimizer_param_scheduler,
        forward_step=call.forward_step,
        microbatch=lambda iteration, slot: training_microbatch(args, train_dataset, slot),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size,
        grad_reduce_in_fp32=bool(getattr(args, "accumulate_allreduce_grads_in_fp32", False)),
    )


def build_stage(args: argparse.Namespace, call: PretrainCall, *, num_layers: int,
                pre_process: bool, post_process: bool, pg_collection: Any) -> Any:
    """The script's model for a stage of ``num_layers`` transformer layers, with the stage's
    groups: from its model provider (as Megatron-LM's ``get_model`` calls it) or its config
    container's model builder (as ``setup_model_and_optimizer`` uses it), given a transformer
    config of those layers alone. The script's code sees the stage's layout from here
    (:class:`StageView`)."""
    StageView.enter(args, pg_collection)
    if call.model_provider is not None:
        from megatron.training.arguments import core_transformer_config_from_args

        config = _stage_config(core_transformer_config_from_args(args), num_layers)
        return call.model_provider(pre_process=pre_process, post_process=post_process,
                                   config=config, pg_collection=pg_collection)
    model_config = copy.copy(_model_config(call))
    model_config.transformer = _stage_config(model_config.transformer, num_layers)
    builder = model_config.get_builder_cls()(model_config)
    return builder.build_model(pg_collection, pre_process=pre_process,
                               post_process=post_process)


def _stage_config(config: Any, num_layers: int) -> Any:
    """A transformer config of ``num_layers`` layers, all in one pipeline stage."""
    return dataclasses.replace(config, num_layers=num_layers, pipeline_model_parallel_size=1)


def training_microbatch(args: argparse.Namespace, dataset: Any, slot: int) -> dict[str, Any]:
    """Slot ``slot`` of the current iteration's global batch (module docstring)."""
    from torch.utils.data import default_collate

    first = args.consumed_train_samples + slot * args.micro_batch_size
    return default_collate([dataset[index]
                            for index in range(first, first + args.micro_batch_size)])


class StageView:
    """The parallel layout the script's code reads while this rank trains a stage (module
    docstring)."""

    _job_pipeline_size: Optional[int] = None

    @classmethod
    def enter(cls, args: argparse.Namespace, pg_collection: Any) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state

        missing = [name for names in STAGE_GROUPS for name in names[:2]
                   if not hasattr(parallel_state, name)]
        if missing:
            raise RuntimeError(f"megatron.core.parallel_state has no {', '.join(missing)}: "
                               "pipeline templates on Megatron-LM's loop are written for "
                               "megatron-core 0.16-0.19")
        for group_name, ranks_name, field in STAGE_GROUPS:
            group = getattr(pg_collection, field, None)
            setattr(parallel_state, group_name, group)
            setattr(parallel_state, ranks_name,
                    None if group is None else dist.get_process_group_ranks(group))
        if cls._job_pipeline_size is None:
            cls._job_pipeline_size = args.pipeline_model_parallel_size
        args.pipeline_model_parallel_size = pg_collection.pp.size()
        args.transformer_pipeline_model_parallel_size = pg_collection.pp.size()

    @classmethod
    def leave(cls, args: argparse.Namespace) -> None:
        """The job's own layout again (its ``parallel_state`` is built anew by the caller)."""
        if cls._job_pipeline_size is not None:
            args.pipeline_model_parallel_size = cls._job_pipeline_size
            args.transformer_pipeline_model_parallel_size = cls._job_pipeline_size
            cls._job_pipeline_size = None


@contextlib.contextmanager
def rerun_checks_off() -> Iterator[None]:
    """Megatron-Core's rerun state machine with its reruns off, for forward and backward passes
    outside an iteration (the measurement of a stage before the first step): a loss function
    that reports to it (Megatron-LM's GPT loss validates each micro-batch's loss) would
    otherwise fail, as the machine expects reports only inside an iteration. NaN and Inf losses
    are still refused."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()
    mode = machine.mode
    machine.mode = RerunMode.DISABLED
    try:
        yield
    finally:
        machine.mode = mode


def skipped_on_templates(what: str) -> None:
    """Logs (on the first rank) that ``what`` of Megatron-LM's loop is skipped while shrunk."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        logger.warning("%s skipped: the job trains on pipeline templates, and the script's own "
                       "model rests", what)


class MegatronLMLoop:
    """Megatron-LM's training loop, as the template unit sees it (module docstring)."""

    def __init__(self, args: argparse.Namespace, restart_data: Callable[[], None]) -> None:
        """``restart_data``: starts a survivor's training data iterator again where the job
        is (it read nothing while on the templates)."""
        self._args = args
        self._restart_data = restart_data

    def measuring(self) -> contextlib.AbstractContextManager[Any]:
        return rerun_checks_off()

    def job_module(self, model: Any) -> torch.nn.Module:
        return inner_model(model[0].module)

    def before_shrink(self) -> None:
        # A shrink started again after another loss: the job's layout is read first.
        StageView.leave(self._args)

    def step(self, train: Callable[[Optional[Repeat]], StageStep]) -> Any:
        """Its forward and backward passes inside Megatron-Core's rerun state machine (which
        the script's loss function reports to, and which may run them again); then the loss
        over the global batch (on every rank, so that whichever rank logs prints it), the
        gradient norm, and the machine's checkpoint and exit requests."""
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        machine = get_rerun_state_machine()
        requests = (False, False, 0)

        def as_megatron_lm_runs(forward_backward: Callable[[], list]) -> list:
            nonlocal requests
            losses: list = []
            # The templates read their micro-batches by slot, not from the data iterator.
            while machine.should_run_forward_backward(None):
                losses = forward_backward()
            requests = machine.should_checkpoint_and_exit()
            return losses

        result = train(as_megatron_lm_runs)
        should_checkpoint, should_exit, exit_code = requests
        return ({"lm loss": torch.tensor(result.loss, dtype=torch.float32)}, int(result.skipped),
                should_checkpoint, should_exit, exit_code, result.grad_norm, None, 0)

    def after_leaving(self) -> None:
        StageView.leave(self._args)

    def after_growth(self) -> None:
        self._restart_data()

    def growth_state(self) -> dict[str, Any]:
        return loop_state(self._args)

    def load_growth_state(self, state: dict[str, Any], iteration: int) -> None:
        self._args.iteration = iteration
        load_loop_state(self._args, state)
