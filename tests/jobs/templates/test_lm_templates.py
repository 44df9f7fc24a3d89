"""The parts of Megatron-LM's loop on pipeline templates that need no job
(:mod:`mover_plugin.megatron.templates.megatron_lm`): which samples a slot reads, which jobs are
refused, and the layout a stage shows the script's code. The jobs themselves run in
tests/jobs/templates/test_megatron_lm_templates.py."""

from __future__ import annotations

import argparse

import pytest
import torch

from mover_plugin.megatron.lm_standby import PretrainCall
from mover_plugin.megatron.templates.megatron_lm import (built_on_this_rank_too,
                                                        lm_template_refusals, training_microbatch)
from mover_plugin.patches import apply_patches
from mover_plugin.testing import run_ranks

pytest.importorskip("megatron.training")

MICRO, DATA_PARALLEL, GLOBAL = 2, 2, 8


class Samples(torch.utils.data.Dataset):
    """Sample ``i`` holds its own index."""

    def __len__(self) -> int:
        return 10_000

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(index)}


@pytest.mark.parametrize("consumed", [0, 24, 8 * 37])
def test_the_slots_of_an_iteration_read_the_samples_megatron_lm_gives_its_ranks(consumed):
    """Megatron-LM's own sampler, one data-parallel rank after the other, for one iteration of
    GLOBAL / (MICRO x DATA_PARALLEL) micro-batches each, against the slots of the global batch."""
    from megatron.training.datasets.data_samplers import MegatronPretrainingSampler

    per_rank = GLOBAL // (MICRO * DATA_PARALLEL)
    given = []
    for rank in range(DATA_PARALLEL):
        sampler = iter(MegatronPretrainingSampler(
            total_samples=len(Samples()), consumed_samples=consumed, micro_batch_size=MICRO,
            data_parallel_rank=rank, data_parallel_size=DATA_PARALLEL))
        given += [index for _ in range(per_rank) for index in next(sampler)]
    args = argparse.Namespace(consumed_train_samples=consumed, micro_batch_size=MICRO)
    slots = [training_microbatch(args, Samples(), slot)["index"]
             for slot in range(GLOBAL // MICRO)]
    assert all(batch.shape == (MICRO,) for batch in slots)
    read = [int(index) for batch in slots for index in batch]
    assert sorted(read) == sorted(given) == list(range(consumed, consumed + GLOBAL))


def megatron_lm_args(**overrides) -> argparse.Namespace:
    values = dict(pipeline_model_parallel_size=2, dataloader_type="single",
                  rampup_batch_size=None, phase_transition_iterations=None,
                  calculate_per_token_loss=False, log_params_norm=False, use_mup=False,
                  decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None,
                  pipeline_model_parallel_layout=None,
                  account_for_embedding_in_pipeline_split=False,
                  account_for_loss_in_pipeline_split=False, mtp_num_layers=None,
                  virtual_pipeline_model_parallel_size=None)
    return argparse.Namespace(**{**values, **overrides})


CALL = PretrainCall(model_type=None, forward_step=print, model_provider=print,
                    cfg_container=None)


def test_a_job_megatron_lm_can_train_on_templates_is_refused_nothing():
    assert lm_template_refusals(megatron_lm_args(), CALL) == []
    assert lm_template_refusals(megatron_lm_args(pipeline_model_parallel_size=4), CALL) == []
    container = argparse.Namespace(model=object())
    assert lm_template_refusals(megatron_lm_args(), PretrainCall(
        None, print, model_provider=None, cfg_container=container)) == []


@pytest.mark.parametrize("overrides, reason", [
    ({"virtual_pipeline_model_parallel_size": 2}, "virtual pipeline stages"),
    ({"dataloader_type": "cyclic"}, "--dataloader-type cyclic"),
    ({"rampup_batch_size": [4, 4, 100]}, "--rampup-batch-size"),
    ({"phase_transition_iterations": [10]}, "--phase-transition-iterations"),
    ({"decoder_first_pipeline_num_layers": 1}, "an uneven or custom pipeline split"),
    ({"pipeline_model_parallel_layout": "Et|tL"}, "an uneven or custom pipeline split"),
    ({"account_for_loss_in_pipeline_split": True}, "an uneven or custom pipeline split"),
    ({"mtp_num_layers": 1}, "--mtp-num-layers"),
    ({"calculate_per_token_loss": True}, "--calculate-per-token-loss"),
    ({"log_params_norm": True}, "--log-params-norm"),
    ({"use_mup": True}, "--use-mup"),
])
def test_what_megatron_lm_cannot_train_on_templates_is_named(overrides, reason):
    (refused,) = lm_template_refusals(megatron_lm_args(**overrides), CALL)
    assert refused.startswith(reason)


def test_a_middle_stage_builds_the_datasets_with_megatron_cores_builder_too():
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )

    init = BlendedMegatronDatasetBuilder.__init__
    never = lambda *_, **__: False  # noqa: E731 - a script's answer on a middle stage
    for args, kwargs in (((int, [1, 0, 0], never, None), {}),
                         ((int, [1, 0, 0]), {"is_built_on_rank": never, "config": None})):
        args, kwargs = built_on_this_rank_too(init, "builder", args, kwargs)
        every = {**dict(zip(("cls", "sizes", "is_built_on_rank", "config"), args)), **kwargs}
        assert every["is_built_on_rank"]() is True
        assert (every["cls"], every["sizes"], every["config"]) == (int, [1, 0, 0], None)


def test_a_job_whose_model_comes_from_neither_provider_nor_config_is_refused():
    for call in (None, PretrainCall(None, print, model_provider=None, cfg_container=None)):
        assert lm_template_refusals(megatron_lm_args(), call) == [
            "neither a model provider nor a model config given to pretrain()"]


def test_a_loss_validated_outside_an_iteration_passes_with_the_reruns_off():
    """Megatron-LM's GPT loss validates every loss with the rerun state machine, which in its
    default mode accepts that only inside an iteration; a stage's measurement before the first
    step runs its forward step with the reruns off, and the machine's mode is put back."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    from mover_plugin.megatron.templates.megatron_lm import rerun_checks_off

    machine = get_rerun_state_machine()
    mode = machine.mode
    machine.mode = RerunMode.VALIDATE_RESULTS

    def validate(loss: float) -> None:
        machine.validate_result(result=torch.tensor(loss), rejection_func=torch.isnan,
                                message="NaN in the loss", tolerance=0.0, fatal=True)

    try:
        with pytest.raises(AssertionError, match="outside of the forward-backward pass"):
            validate(1.0)
        with rerun_checks_off():
            validate(1.0)
            # (its message names the device: the CPU stand-in for torch.cuda.current_device)
            with apply_patches("curdev"), pytest.raises(RuntimeError, match="NaN in the loss"):
                validate(float("nan"))
        assert machine.mode == RerunMode.VALIDATE_RESULTS
    finally:
        machine.mode = mode


def stage_view(rank: int, world_size: int) -> dict:
    """On 3 ranks: a 2-stage pipeline [0 1] and rank 2 alone; what Megatron-Core's
    parallel_state and Megatron-LM's args say in a stage's view, and after it."""
    from megatron.core import parallel_state

    from mover_plugin.megatron.templates.megatron_lm import StageView
    from mover_plugin.megatron.templates.stage import PlacementGroups
    from mover_plugin.placement import Placement

    placement = Placement.of_pipelines([([(0, 3), (3, 4)], 2), ([(0, 4)], 2)], [0, 1, 2], 4)
    groups = PlacementGroups(placement, rank)
    args = argparse.Namespace(pipeline_model_parallel_size=2,
                              transformer_pipeline_model_parallel_size=2)
    StageView.enter(args, groups.collection(placement.role(rank)))
    seen = {
        "first": parallel_state.is_pipeline_first_stage(),
        "last": parallel_state.is_pipeline_last_stage(),
        "pipeline": parallel_state.get_pipeline_model_parallel_world_size(),
        "pipeline_ranks": list(parallel_state._PIPELINE_GLOBAL_RANKS),
        "tensor": (parallel_state.get_tensor_model_parallel_rank(),
                   parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_tensor_model_parallel_src_rank()),
        "context": parallel_state.get_context_parallel_world_size(),
        "initialized": parallel_state.model_parallel_is_initialized(),
        "args": args.pipeline_model_parallel_size,
    }
    parallel_state.destroy_model_parallel()
    StageView.leave(args)
    seen["args_after"] = (args.pipeline_model_parallel_size,
                          args.transformer_pipeline_model_parallel_size)
    groups.destroy()
    return seen


def test_a_stage_shows_the_script_its_own_pipeline_and_no_data_parallel_group():
    first, last, alone = run_ranks(stage_view, 3, timeout_s=60)
    assert (first["first"], first["last"], last["first"], last["last"]) == (
        True, False, False, True)
    assert alone["first"] and alone["last"]
    assert [view["pipeline"] for view in (first, last, alone)] == [2, 2, 1]
    assert [view["args"] for view in (first, last, alone)] == [2, 2, 1]
    assert first["pipeline_ranks"] == last["pipeline_ranks"] == [0, 1]
    assert alone["pipeline_ranks"] == [2]
    assert [view["tensor"] for view in (first, last, alone)] == [(0, 1, 0), (0, 1, 1), (0, 1, 2)]
    assert all(view["context"] == 1 for view in (first, last, alone))
    # no data-parallel group: Megatron-LM's loop counts the global batch from its flags
    assert not any(view["initialized"] for view in (first, last, alone))
    assert all(view["args_after"] == (2, 2) for view in (first, last, alone))
