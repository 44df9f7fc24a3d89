"""DeepSpeed adapter, pure logic: the "resilience" config block, the example's flag checks,
mover-launch reading the block, the decision after a crash, and the opt-in patches."""

import json

import pytest

from mover_plugin.deepspeed.arguments import parse_args
from mover_plugin.deepspeed.config import config_path_in, load_ds_config, parse_block
from mover_plugin.runtime.peer_copy import decide_continuation
from mover_plugin.errors import ConfigError
from mover_plugin.launch.config import parse_launch_args
from support.paths import SCRIPTS

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}


def write_config(tmp_path, **extra):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BASE, **extra}))
    return str(path)


def test_an_empty_block_means_the_defaults():
    block = parse_block({}, "ds.json")
    assert block.settings.enabled and block.standbys == 1 and not block.peer_copy
    assert block.settings.failure_timeout_s == 5.0
    assert block.settings.standby_shadow_iterations == 0  # opt-in (unlike the Megatron flag)
    assert parse_block({"standby_shadow_iterations": 3}, "ds.json").settings \
        .standby_shadow_iterations == 3


@pytest.mark.parametrize("block, message", [
    ({"standbys": -1}, '"resilience.standbys" -1 must be a whole number of at least 0'),
    ({"peer_copy": "yes"}, '"resilience.peer_copy" \'yes\' must be true or false'),
    ({"failure_timeout": 5}, '"resilience.failure_timeout" is not a setting; valid keys: '
     "['collective_timeout_s', 'enabled', 'failure_timeout_s', 'heartbeat_interval_s', "
     "'peer_copy', 'standby_shadow_iterations', 'standbys']"),
    ({"heartbeat_interval_s": 9}, '"resilience.heartbeat_interval_s" 9 must be below '
     '"resilience.failure_timeout_s" 5.0'),
    ({"collective_timeout_s": 0}, '"resilience.collective_timeout_s" 0 must be a positive'),
    ({"enabled": 1}, '"resilience.enabled" 1 must be true or false'),
    ({"standby_shadow_iterations": -1}, '"resilience.standby_shadow_iterations" -1 must be a '
     "whole number of at least 0"),
    ({"fault_tolerance": 1}, '"resilience.fault_tolerance" is not a DeepSpeed setting'),
    ([1], '"resilience" must be an object of settings'),
])
def test_a_bad_block_names_the_key_and_the_valid_values(block, message):
    with pytest.raises(ConfigError) as error:
        parse_block(block, "ds.json")
    assert str(error.value).startswith("ds.json: ") and message in str(error.value)


def test_the_block_is_taken_out_of_the_config_for_deepspeed(tmp_path):
    path = write_config(tmp_path, resilience={"standbys": 2, "peer_copy": True})
    config, block = load_ds_config(path)
    assert config == BASE and block.standbys == 2 and block.peer_copy
    assert config_path_in(["--deepspeed", "--deepspeed_config", path]) == path
    assert config_path_in([f"--deepspeed_config={path}"]) == path
    assert config_path_in(["--lr", "1"]) is None


def test_a_transformers_script_names_its_config_with_deepspeed_and_a_json_path():
    """``TrainingArguments``' ``--deepspeed PATH``; DeepSpeed's own ``--deepspeed`` is a
    switch, so a value counts only if it is a ``.json`` path, and ``--deepspeed_config`` wins."""
    assert config_path_in(["--output_dir", "o", "--deepspeed", "ds.json"]) == "ds.json"
    assert config_path_in(["--deepspeed=conf/ds.json"]) == "conf/ds.json"
    assert config_path_in(["--deepspeed", "--steps", "3"]) is None
    assert config_path_in(["--deepspeed", "data.txt"]) is None
    assert config_path_in(["--deepspeed", "a.json", "--deepspeed_config", "b.json"]) == "b.json"


def test_the_example_flags_are_checked_against_world_and_config(tmp_path):
    good = write_config(tmp_path)
    args = parse_args(["--deepspeed_config", good], world_size=4)
    assert args.data_parallel_size == 2 and args.resilience is None
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 3 must divide the world "
                       "size 4"):
        parse_args(["--deepspeed_config", good, "--pipeline-parallel-size", "3"], world_size=4)
    bad = write_config(tmp_path, train_batch_size=16)
    with pytest.raises(ConfigError, match='"train_batch_size" 16 must equal .* = 8'):
        parse_args(["--deepspeed_config", bad], world_size=4)
    with pytest.raises(ConfigError, match="does not exist"):
        parse_args(["--deepspeed_config", str(tmp_path / "none.json")], world_size=4)


def test_mover_launch_takes_policy_and_standbys_from_the_block(tmp_path):
    script = ["examples/ds_pretrain_gpt.py", "--deepspeed_config"]
    resilient = write_config(tmp_path, resilience={"standbys": 2})
    config = parse_launch_args(["--num_gpus", "4", "--standalone", *script, resilient], "py")
    assert (config.policy, config.standbys, config.world_size) == ("resilient", 2, 4)
    config = parse_launch_args(["--num_gpus", "4", "--standbys", "1", "--standalone", *script,
                                resilient], "py")
    assert config.standbys == 1
    with pytest.raises(ConfigError, match="--policy restart: the DeepSpeed config"):
        parse_launch_args(["--policy", "restart", *script, resilient], "py")
    broken = write_config(tmp_path, resilience={"standbys": "two"})
    with pytest.raises(ConfigError, match='"resilience.standbys" \'two\''):
        parse_launch_args(["--num_gpus", "4", *script, broken], "py")
    plain = write_config(tmp_path)
    assert parse_launch_args([*script, plain], "py").policy == "restart"
    with pytest.raises(ConfigError, match='--policy resilient needs a "resilience" block'):
        parse_launch_args(["--policy", "resilient", *script, plain], "py")


def test_zero_settings_the_runtime_cannot_recover_are_refused_before_anything_starts(
        tmp_path):
    script = [str(SCRIPTS / "ds_dp_train.py"), "--deepspeed_config"]
    stage_4 = write_config(tmp_path, resilience={}, zero_optimization={"stage": 4})
    with pytest.raises(ConfigError, match='"zero_optimization.stage" 4 cannot run with an '
                       r'enabled "resilience" block; supported stages: \[0, 1, 2, 3\]'):
        parse_launch_args(["--num_gpus", "4", *script, stage_4], "py")
    offload = write_config(tmp_path, resilience={}, zero_optimization={
        "stage": 3, "offload_param": {"device": "cpu"}})
    with pytest.raises(ConfigError, match='"zero_optimization.offload_param.device" \'cpu\' '
                       'cannot run with an enabled "resilience" block; supported: "none"'):
        parse_launch_args(["--num_gpus", "4", *script, offload], "py")
    for key, value, valid in (("cpu_offload", True, "false"), ("zero_hpz_partition_size", 8, "1"),
                              ("zero_quantized_weights", True, "false")):
        refused = write_config(tmp_path, resilience={}, zero_optimization={"stage": 3,
                                                                            key: value})
        with pytest.raises(ConfigError, match=f'"zero_optimization.{key}" {value!r} cannot run '
                           f'with an enabled "resilience" block; supported: {valid}'):
            load_ds_config(refused)
    stage_3 = write_config(tmp_path, resilience={}, zero_optimization={
        "stage": 3, "offload_optimizer": {"device": "none"}, "zero_hpz_partition_size": 1})
    assert load_ds_config(stage_3)[1] is not None
    off = write_config(tmp_path, resilience={"enabled": False}, zero_optimization={"stage": 4})
    assert load_ds_config(off)[1] is not None


def record(applied, updating=False, held_of=-1, held_version=-1):
    return {"applied": applied, "updating": updating, "held_of": held_of,
            "held_version": held_version}


def test_a_lost_shard_held_current_by_a_peer_needs_no_rollback():
    records = [record(5, held_of=1, held_version=5), None, record(5, held_of=3, held_version=5),
               record(5, held_of=2, held_version=5)]
    assert decide_continuation(records, peer_copy=True) == (5, None, {1: 0})


@pytest.mark.parametrize("records, reason", [
    ([record(5), None], "no live rank holds a current copy of the optimizer shard of rank(s) "
     "[1] (peer_copy is off)"),
    ([record(5, held_of=1, held_version=4), None], "no live rank holds a current copy"),
    ([record(5, updating=True, held_of=1, held_version=5), None],
     "lost while the optimizer update was being applied"),
    ([record(6, held_of=2, held_version=6), record(5, held_of=2, held_version=5), None],
     "different numbers of iterations"),
])
def test_otherwise_every_rank_rolls_back(records, reason):
    target, why, holders = decide_continuation(records, peer_copy=records[0]["held_of"] >= 0,
                                               off="peer_copy is off")
    assert reason in why and holders == {}


def test_the_deepspeed_patches_apply_and_revert():
    import importlib

    from deepspeed.ops.adam import FusedAdam
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mover_plugin.patches import apply_patches

    backend = importlib.import_module("deepspeed.comm.torch")
    originals = (backend.build_shm_op, backend.TorchBackend.new_group,
                 PipelineEngine.train_batch, FusedAdam.step)
    with apply_patches("deepspeed-cpu") as applied:
        assert applied.names == ("no-shm-op", "cpu-adam-powers", "local-rank",
                                 "subgroup-timeout", "reentrant-train-batch")
        assert backend.build_shm_op() is None
        assert PipelineEngine.train_batch is not originals[2]
        assert FusedAdam.step is not originals[3]
    assert (backend.build_shm_op, backend.TorchBackend.new_group,
            PipelineEngine.train_batch, FusedAdam.step) == originals
    # On GPUs a resilient job applies those not about the CPU: no shared-memory op skipped.
    with apply_patches("deepspeed-resilience") as applied:
        assert applied.names == ("local-rank", "subgroup-timeout", "reentrant-train-batch")
        assert backend.build_shm_op is originals[0]
        assert PipelineEngine.train_batch is not originals[2]
    assert PipelineEngine.train_batch is originals[2]


def test_the_fp16_loss_scale_is_captured_and_restored_whole():
    """DeepSpeed's dynamic loss scaler moves before the commit (an overflow halves the scale,
    every step counts): the snapshot a redo starts from, and a joiner's state, carry it."""
    from types import SimpleNamespace

    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler

    from mover_plugin.deepspeed.engine_state import loss_scale_state, restore_loss_scale_state

    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=2, min_scale=1.0,
                               delayed_shift=2, consecutive_hysteresis=False)
    engine = SimpleNamespace(optimizer=SimpleNamespace(loss_scaler=scaler))
    before = loss_scale_state(engine)
    for _ in range(3):
        scaler.update_scale(False)  # (an overflow would log through DeepSpeed's comm)
    scaler.cur_hysteresis, scaler.last_overflow_iter = 1, 2
    assert loss_scale_state(engine) == {"cur_scale": 2.0**17, "cur_iter": 3,
                                        "last_overflow_iter": 2, "cur_hysteresis": 1}
    restore_loss_scale_state(engine, before)
    assert loss_scale_state(engine) == before == {
        "cur_scale": 2.0**16, "cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": 2}
    assert loss_scale_state(SimpleNamespace(optimizer=object())) == {}


def test_a_block_mover_launch_could_not_see_fails_deepspeed_initialize_with_the_reason(tmp_path):
    """A script that names its config in code (``TrainingArguments(deepspeed=...)``): under
    mover-launch its ``deepspeed.initialize`` refuses a config that enables the block."""
    from types import SimpleNamespace

    from mover_plugin.deepspeed.config import unseen_block_error
    from mover_plugin.deepspeed.drop_in import UnseenBlockCheck

    enabled = {**BASE, "resilience": {"standbys": 1}}
    path = write_config(tmp_path, resilience={"standbys": 1})
    assert unseen_block_error(BASE) is None
    assert unseen_block_error({**BASE, "resilience": {"enabled": False}}) is None
    assert "--deepspeed_config or --deepspeed-config PATH" in unseen_block_error(enabled)
    assert unseen_block_error(path) == unseen_block_error(enabled)

    check = UnseenBlockCheck()
    built = []
    initialize = lambda *args, **kwargs: built.append(kwargs) or "engine"  # noqa: E731
    for kwargs in ({"config_params": enabled}, {"config": path},
                   {"args": SimpleNamespace(deepspeed_config=path)}):
        with pytest.raises(ConfigError, match="would run unprotected"):
            check.around_initialize(initialize, model=None, **kwargs)
    assert built == []
    assert check.around_initialize(initialize, model=None, config=BASE) == "engine"
