"""Pure logic of the drop-in for Megatron-LM's loop and of the data-parallel state an
interrupted iteration leaves: no processes."""

from __future__ import annotations

import functools
import types

from mover_plugin.megatron.ddp_syncs import drop_syncs_in_flight
from mover_plugin.megatron.training_loop import DataIteratorBuilds, virtual_stage


def provider(train_val_test_num_samples, vp_stage=None):
    return None


def test_the_virtual_stage_is_the_one_megatron_lm_binds_to_the_provider():
    assert virtual_stage(functools.partial(provider, vp_stage=1)) == 1
    assert virtual_stage(functools.partial(provider, vp_stage=0)) == 0
    assert virtual_stage(provider) is None
    assert virtual_stage(functools.partial(provider)) is None


def test_data_iterators_are_built_again_as_pretrain_built_them():
    calls: list[str] = []

    def chunk(name: str):
        def build():
            calls.append(name)
            return f"train-{name}", f"valid-{name}", None
        return build

    assert DataIteratorBuilds().build() == (None, None, None)
    single = DataIteratorBuilds()
    single.add(chunk("a"))
    assert single.build() == ("train-a", "valid-a", None)
    chunks = DataIteratorBuilds()
    chunks.add(chunk("0"))
    chunks.add(chunk("1"))
    # One list per kind, one iterator per model chunk, built in the chunks' order.
    assert chunks.build() == (["train-0", "train-1"], ["valid-0", "valid-1"], [None, None])
    assert calls == ["a", "0", "1"]


class Work:
    def wait(self):
        raise RuntimeError("the old generation's communicator is gone")


def bucket_group(reduction, gather=None):
    """The attributes of Megatron-Core 0.19's ``_ParamAndGradBucketGroup`` that an iteration
    changes."""
    return types.SimpleNamespace(grad_reduce_handle=reduction, grad_reduce_finished=True,
                                 per_param_grad_ready_counts={"weight": 1},
                                 param_gather_handle=gather, param_gather_dispatched=True)


def test_an_interrupted_iterations_reductions_and_gathers_are_dropped():
    dense = [bucket_group(Work()), bucket_group(None, gather=Work())]
    expert = [bucket_group(Work())]
    chunks = [types.SimpleNamespace(bucket_groups=dense, expert_parallel_bucket_groups=expert),
              types.SimpleNamespace(bucket_groups=[bucket_group(Work(), gather=Work())]),
              object()]  # not a DDP module: nothing to drop
    assert drop_syncs_in_flight(chunks) == 5
    for group in [*dense, *expert, *chunks[1].bucket_groups]:
        assert group.grad_reduce_handle is None and group.grad_reduce_finished is False
        assert group.per_param_grad_ready_counts == {}
        # Every bucket is gathered again by the redone iteration, at every rank alike.
        assert group.param_gather_handle is None and group.param_gather_dispatched is False
    assert drop_syncs_in_flight(chunks) == 0


def test_the_bucket_group_attributes_dropped_are_megatron_cores():
    """The attributes above are those Megatron-Core's bucket group sets when it is built."""
    import inspect

    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    source = inspect.getsource(_ParamAndGradBucketGroup.__init__)
    for name in ("grad_reduce_handle", "per_param_grad_ready_counts", "param_gather_handle",
                 "param_gather_dispatched"):
        assert f"self.{name} = " in source, name
    assert "self.grad_reduce_finished" in inspect.getsource(_ParamAndGradBucketGroup)
