"""Pure tests of the Megatron-LM-style flags and their checks (no framework import)."""

import subprocess
import sys

import pytest

from mover_plugin.errors import ConfigError
from mover_plugin.megatron.arguments import parse_args


def test_defaults_are_derived_from_the_world_size():
    args = parse_args(["--pipeline-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 2
    assert args.global_batch_size == args.micro_batch_size * 2
    assert args.ffn_hidden_size == 4 * args.hidden_size
    assert args.lr_decay_iters == args.train_iters


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tensor-model-parallel-size", "3"], "world size 4 is not divisible by tensor"),
        (["--pipeline-model-parallel-size", "2", "--num-layers", "3"],
         "--num-layers 3 is not divisible by --pipeline-model-parallel-size 2"),
        (["--global-batch-size", "6", "--micro-batch-size", "4"],
         "--global-batch-size 6 is not divisible by --micro-batch-size 4"),
        (["--data-path", "/nonexistent/corpus"], "/nonexistent/corpus.bin"),
        (["--lr-decay-style", "exponential"], "invalid choice: 'exponential'"),
        (["--save-interval", "1"], "--save-interval needs --save"),
        (["--hidden-size", "30", "--num-attention-heads", "4"], "--hidden-size 30 is not divisible"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)
def test_bad_flags_name_the_value_and_what_is_valid(argv, message):
    with pytest.raises(ConfigError) as error:
        parse_args(argv, world_size=4)
    assert message in str(error.value)


def test_a_file_given_as_checkpoint_folder_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a folder")
    with pytest.raises(ConfigError, match="is a file; it must be a folder"):
        parse_args(["--save", str(path)], world_size=1)


def test_checking_flags_imports_neither_torch_nor_megatron():
    code = (
        "import sys; from mover_plugin.megatron.arguments import parse_args; "
        "parse_args([], world_size=1); "
        "assert not {'torch', 'megatron'} & set(m.split('.')[0] for m in sys.modules), "
        "sorted(m for m in sys.modules if m.startswith(('torch', 'megatron')))[:5]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_resilient_implies_no_plain_gloo_groups():
    from mover_plugin.runtime.settings import add_resilience_args

    plain = parse_args([], world_size=1, extra_args_provider=add_resilience_args)
    assert plain.enable_gloo_process_groups is True
    assert parse_args(["--disable-gloo-process-groups"],
                      world_size=1).enable_gloo_process_groups is False
    resilient = parse_args(["--resilient"], world_size=1,
                           extra_args_provider=add_resilience_args)
    assert resilient.enable_gloo_process_groups is False


def test_a_fault_tolerance_the_hosts_cannot_hold_is_refused():
    from mover_plugin.runtime.settings import add_resilience_args

    def parse(*flags, world_size=4):
        return parse_args(["--resilient", "--pipeline-model-parallel-size", "2",
                           "--global-batch-size", "8", "--micro-batch-size", "2", *flags],
                          world_size=world_size, extra_args_provider=add_resilience_args)

    assert parse().resilience.fault_tolerance == 1
    assert parse("--resilient-fault-tolerance", "3").resilience.fault_tolerance == 3
    with pytest.raises(ConfigError, match=r"--resilient-fault-tolerance 4 is too large: it "
                       r"needs 5 pipelines .* the job has 4 ranks .* give at most 3"):
        parse("--resilient-fault-tolerance", "4")
    # not held to it without --resilient; a job that never shrinks refuses it when given
    plain = parse_args(["--pipeline-model-parallel-size", "2", "--global-batch-size", "2",
                        "--micro-batch-size", "2"], world_size=2,
                       extra_args_provider=add_resilience_args)
    assert plain.resilience.fault_tolerance == 1
    at_tp2 = parse("--tensor-model-parallel-size", "2", world_size=8)
    assert at_tp2.resilience.fault_tolerance == 1 and at_tp2.template_profile is None
    with pytest.raises(ConfigError, match=r"^--resilient-fault-tolerance 1: this job cannot "
                       r"shrink onto pipeline templates \(tensor-parallel size 2, the "
                       r"distributed optimizer\), so a rank lost with no standby ready "
                       r"restarts it; leave the flag out$"):
        parse("--tensor-model-parallel-size", "2", "--use-distributed-optimizer",
              "--resilient-fault-tolerance", "1", world_size=8)
    with pytest.raises(ConfigError, match="must be a whole number of at least 0"):
        parse("--resilient-fault-tolerance", "-1")
    assert parse(world_size=2).resilience.fault_tolerance == 1  # PP2 x DP1: two hosts


def test_a_template_profile_is_checked_against_the_model_and_the_hosts(tmp_path):
    import json

    from mover_plugin.runtime.settings import add_resilience_args
    from mover_plugin.shrink import profile_record
    from mover_plugin.templates import transformer_profile

    def parse(profile, *flags):
        path = tmp_path / "profile.json"
        path.write_text(json.dumps(profile_record(profile)))
        return parse_args(["--resilient", "--pipeline-model-parallel-size", "2", "--num-layers",
                           "4", "--global-batch-size", "8", "--micro-batch-size", "2",
                           "--resilient-template-profile", str(path), *flags],
                          world_size=4, extra_args_provider=add_resilience_args)

    gib = 1 << 30
    fits = transformer_profile(4, layer_bytes=gib, activation_bytes=gib // 8,
                               host_memory_bytes=80 * gib)
    assert parse(fits).template_profile == profile_record(fits)
    with pytest.raises(ConfigError, match=r"profile.json: 8 layers, but this model has 6"):
        parse(transformer_profile(6))
    with pytest.raises(ConfigError, match="the model fits no pipeline of 1 to 2 hosts"):
        parse(transformer_profile(4, host_memory_bytes=gib))
    # half the model fits a host, the whole does not: 3 hosts left have no plan
    halves = transformer_profile(4, layer_bytes=gib, activation_bytes=gib // 8,
                                 host_memory_bytes=4 * gib)
    with pytest.raises(ConfigError, match=r"fault tolerance 1 is too large for 4 hosts: after "
                       r"losing 1, no 1 or more pipelines of 2 hosts .* cover exactly 3"):
        parse(halves)
    assert parse(halves, "--resilient-fault-tolerance", "0").template_profile is not None
    with pytest.raises(ConfigError, match="no such profile"):
        parse_args(["--resilient", "--resilient-template-profile", str(tmp_path / "none.json")],
                   world_size=1, extra_args_provider=add_resilience_args)
