"""Pure tests of the Megatron adapters' template unit (mover_plugin.megatron.templates.participant):
who publishes the job's template spec, and what Megatron-LM's loop carries to a standby that
joins a job growing back."""

import argparse
import types

import pytest

from mover_plugin.megatron.templates.megatron_lm import MegatronLMLoop
from mover_plugin.megatron.templates.participant import CoreLoop, MegatronTemplates
from mover_plugin.runtime.settings import ResilienceSettings


class Control:
    """The control channel's two calls the unit makes before the first step, recorded."""

    def __init__(self) -> None:
        self.templates: list[dict] = []
        self.profiles: list[tuple] = []

    def publish_templates(self, record: dict) -> None:
        self.templates.append(record)

    def publish_stage_profile(self, *measured: object) -> None:
        self.profiles.append(measured)


def job(rank: int = 0, joiner_of=None, profile=None, **flags) -> types.SimpleNamespace:
    args = argparse.Namespace(tensor_model_parallel_size=1, num_layers=4,
                              untie_embeddings_and_output_weights=False, global_batch_size=8,
                              micro_batch_size=2, fp16=False, bf16=False,
                              template_profile=profile, **flags)
    runtime = types.SimpleNamespace(rank=rank, joiner_of=joiner_of, control=Control(),
                                    settings=ResilienceSettings())
    return types.SimpleNamespace(args=args, runtime=runtime, sharded=False,
                                 training_objects=(None, None, None))


GIVEN = {"layers": []}
"""A profile given with ``--resilient-template-profile``: no stage measures its layers."""


def test_the_first_rank_of_a_job_with_a_recipe_publishes_its_spec():
    first = job(profile=GIVEN)
    MegatronTemplates(first, CoreLoop()).publish_spec()  # no recipe: the job cannot shrink
    assert first.runtime.control.templates == []
    unit = MegatronTemplates(first, CoreLoop())
    unit.recipe = object()
    unit.publish_spec()
    assert [(r["num_layers"], r["microbatches"], r["profile"])
            for r in first.runtime.control.templates] == [(4, 4, GIVEN)]
    other = job(rank=1, profile=GIVEN)
    unit = MegatronTemplates(other, CoreLoop())
    unit.recipe = object()
    unit.publish_spec()
    assert other.runtime.control.templates == []


@pytest.mark.parametrize("case", [{"joiner_of": 3}, {"tensor_model_parallel_size": 2},
                                  {"sharded": True}])
def test_a_joiner_or_a_job_the_templates_cannot_train_publishes_nothing(case):
    first = job(profile=GIVEN, joiner_of=case.get("joiner_of"))
    first.sharded = case.get("sharded", False)
    first.args.tensor_model_parallel_size = case.get("tensor_model_parallel_size", 1)
    unit = MegatronTemplates(first, CoreLoop())
    unit.recipe = object()
    unit.publish_spec()
    assert first.runtime.control.templates == [] and not unit.on_templates


def test_megatron_lm_counters_reach_a_standby_joining_a_job_that_grows_back():
    counters = {"consumed_train_samples": 96, "skipped_train_samples": 2,
                "consumed_valid_samples": 16}
    survivor = argparse.Namespace(do_train=True, do_valid=False, do_test=1, **counters)
    state = MegatronLMLoop(survivor, lambda: None).growth_state()
    assert state == {"counters": counters,
                     "data_flags": {"do_train": True, "do_valid": False, "do_test": True}}
    standby = argparse.Namespace(iteration=0, consumed_train_samples=0)
    MegatronLMLoop(standby, lambda: None).load_growth_state(state, 12)
    assert vars(standby) == {"iteration": 12, **counters, "do_train": True, "do_valid": False,
                             "do_test": True}
    assert CoreLoop().growth_state() == {}


def test_megatron_lm_survivors_read_their_data_again_after_growing_back():
    restarted = []
    loop = MegatronLMLoop(argparse.Namespace(), lambda: restarted.append(True))
    loop.after_growth()
    assert restarted == [True]
