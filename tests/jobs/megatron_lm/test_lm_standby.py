"""A standby's warm-up on Megatron-LM's loop, the parts without processes: what it takes from
the script's pretrain() call, its shadow batches, and the global state it puts back.

The warm-up itself (Megatron-LM's set-up and train_step in the sandbox, and the adoption of
the kept objects after a SIGKILL) runs in ``tests/jobs/megatron_lm/test_megatron_lm.py``."""

from __future__ import annotations

import argparse

import pytest
import torch

from mover_plugin.megatron.lm_standby import (
    PretrainCall,
    megatron_state_kept,
    shadow_batches,
    without_checkpoint,
)


def pretrain(cfg_container, train_valid_test_dataset_provider, model_type, forward_step_func,
             model_provider=None, store=None):
    """The shape of Megatron-LM 0.19's pretrain()."""


def test_the_pretrain_call_gives_the_model_type_provider_and_forward_step() -> None:
    def forward_step(data_iterator, model):
        return None

    def provider(pre_process=True, post_process=True):
        return None

    call = PretrainCall.of(pretrain, ("config", "datasets", "decoder", forward_step),
                           {"model_provider": provider, "store": None})
    assert call == PretrainCall("decoder", forward_step, provider, "config")
    # Positional or by keyword, the same call.
    assert PretrainCall.of(pretrain, (), {
        "cfg_container": "config", "train_valid_test_dataset_provider": "datasets",
        "model_type": "decoder", "forward_step_func": forward_step,
        "model_provider": provider}) == call


def test_a_pretrain_call_without_forward_step_or_of_another_shape_gives_no_warm_up() -> None:
    assert PretrainCall.of(pretrain, ("config", "datasets", "decoder", None), {}) is None
    assert PretrainCall.of(pretrain, ("config",), {"unknown": 1}) is None


def shadow_args(**overrides) -> argparse.Namespace:
    values = {"seed": 1234, "micro_batch_size": 2, "seq_length": 8, "padded_vocab_size": 128,
              "create_attention_mask_in_dataloader": False}
    return argparse.Namespace(**{**values, **overrides})


def test_shadow_batches_have_the_form_of_megatron_gpt_samples_as_collated() -> None:
    batches = shadow_batches(shadow_args())
    first, second = next(batches), next(batches)
    assert sorted(first) == ["labels", "loss_mask", "position_ids", "tokens"]
    for key, dtype in (("tokens", torch.int64), ("labels", torch.int64),
                       ("loss_mask", torch.float32), ("position_ids", torch.int64)):
        assert first[key].shape == (2, 8) and first[key].dtype == dtype, key
    assert int(first["tokens"].min()) >= 0 and int(first["tokens"].max()) < 128
    # Labels are the next tokens, as Megatron-Core's GPTDataset makes them.
    assert torch.equal(first["labels"][:, :-1], first["tokens"][:, 1:])
    assert torch.equal(first["position_ids"][1], torch.arange(8))
    assert not torch.equal(first["tokens"], second["tokens"])


def test_shadow_batches_carry_the_causal_mask_when_the_data_loader_would() -> None:
    batch = next(shadow_batches(shadow_args(create_attention_mask_in_dataloader=True)))
    mask = batch["attention_mask"]
    assert mask.shape == (2, 1, 8, 8) and mask.dtype == torch.bool
    # Megatron's convention: True where a position may not attend (the future).
    assert bool(mask[0, 0, 0, 1]) and not bool(mask[0, 0, 1, 0]) and not bool(mask[0, 0, 3, 3])


def test_without_checkpoint_hides_load_and_puts_it_back() -> None:
    args = argparse.Namespace(load="/ckpt", pretrained_checkpoint=None)
    with without_checkpoint(args):
        assert args.load is None and args.pretrained_checkpoint is None
    assert args.load == "/ckpt"


def test_megatron_state_is_put_back_after_a_warm_up() -> None:
    pytest.importorskip("megatron.training")
    from megatron.core.rerun_state_machine import (
        RerunMode,
        RerunState,
        destroy_rerun_state_machine,
        get_rerun_state_machine,
        initialize_rerun_state_machine,
    )
    from megatron.training import global_vars

    args = argparse.Namespace(rank=5, iteration=None, timing_log_level=0,
                              timing_log_option="minmax")
    global_vars._GLOBAL_TIMERS = None
    global_vars._set_timers(args)
    timers = global_vars.get_timers()
    timers("before", log_level=0)
    destroy_rerun_state_machine()  # the one another test of this process may have made
    initialize_rerun_state_machine(mode=RerunMode.VALIDATE_RESULTS)
    machine = get_rerun_state_machine()
    before = (machine.state, machine.current_iteration)
    try:
        with megatron_state_kept(args):
            args.rank, args.iteration, args.added = 0, 0, True
            timers("shadow", log_level=0)
            machine.state, machine.current_iteration = RerunState.INITIAL_RUN, 7
        assert vars(args) == {"rank": 5, "iteration": None, "timing_log_level": 0,
                              "timing_log_option": "minmax"}
        assert sorted(timers._timers) == ["before"]
        assert (machine.state, machine.current_iteration) == before
    finally:
        destroy_rerun_state_machine()
        global_vars._GLOBAL_TIMERS = None
