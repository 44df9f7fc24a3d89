"""What the runtime reads and resets of a ZeRO stage-3 engine (mover_plugin.deepspeed.
engine_state), on a real one-process DeepSpeed engine on gloo: the shard is the fp32 partition
and its Adam state, the parameters' partitions follow it (``refresh_parameter_partitions``,
what a joiner does with a received shard), a rank's module state is its buffers (and frozen
parameters' partitions) only, and ``release_parameters`` brings every parameter back to its
partition (an all-gather left unfinished included) and forgets the prefetch trace, without
changing what the next steps compute, nor does the reset of an iteration interrupted with gradients not yet
reduced. Run in a separate interpreter: DeepSpeed's communication
backend is global state of the process."""

import subprocess
import sys

from support.paths import SCRIPTS

SCENARIO = r'''
import os, sys
from datetime import timedelta
import torch, torch.distributed as dist
sys.path.insert(0, SCRIPTS)
from tiny_lm import HIDDEN, VOCAB, Block, next_token_loss, dataset

store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=0, world_size=1)
os.environ.setdefault("LOCAL_RANK", "0")
from mover_plugin.patches import apply_patches
apply_patches("deepspeed-cpu")
import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from mover_plugin.deepspeed.engine_state import (
    module_tensors, partitions_parameters, refresh_parameter_partitions, release_parameters,
    reset_interrupted_step, shard_tensors)

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
          "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100}}

def engine():
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Embedding(VOCAB, HIDDEN), Block(),
                                torch.nn.Linear(HIDDEN, VOCAB))
    built, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                     config=CONFIG)
    return built

tokens, labels = dataset().tensors
def train(built, step):
    batch = slice(2 * step, 2 * step + 2)
    built.backward(next_token_loss(built(tokens[batch]), labels[batch]))
    built.step()

def statuses(built):
    return {p.ds_status for p in built.module.parameters()}

released, kept = engine(), engine()
assert partitions_parameters(released)
for step in range(2):
    train(released, step)
    train(kept, step)
# After a step the persistent parameters are gathered, the others partitioned.
assert statuses(released) == {ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE}
parameter = next(p for p in released.module.parameters() if not p.ds_persist)
parameter.ds_status = ZeroParamStatus.INFLIGHT  # as a lost peer's all-gather leaves it
release_parameters(released)
assert statuses(released) == {ZeroParamStatus.NOT_AVAILABLE}
assert released.optimizer.parameter_offload.get_param_coordinator().is_invalid_trace()
print("released")
for step in range(2, 5):
    train(released, step)
    train(kept, step)
    release_parameters(released)
train(released, 5)
train(kept, 5)
# A backward interrupted before it reduced its last bucket leaves gradients on the parameters
# it holds whole (here the persistent ones, gathered since the step).
whole = [p for p in released.module.parameters() if p.ds_status == ZeroParamStatus.AVAILABLE]
for parameter in whole:
    parameter.grad = torch.ones_like(parameter)
reset_interrupted_step(released)
print("grads after reset", len(whole) > 0, {p.grad for p in released.module.parameters()})
train(released, 6)
train(kept, 6)
with deepspeed.zero.GatheredParameters(list(released.module.parameters())), \
        deepspeed.zero.GatheredParameters(list(kept.module.parameters())):
    same = all(torch.equal(a, b) for a, b in zip(released.module.parameters(),
                                                  kept.module.parameters()))
print("same after steps", same)
shard = shard_tensors(released)
print("shard", len(shard), len(released.optimizer.fp32_partitioned_groups_flat))
print("module tensors", len(module_tensors(released)))
shard[0].fill_(0.5)  # the fp32 partition, as a joiner receives it
refresh_parameter_partitions(released)
print("partition written", all(bool((p.ds_tensor == 0.5).all())
                               for p in released.module.parameters()))
'''


def test_a_zero_3_engines_partitions_follow_its_shard_and_a_release_changes_no_result():
    scripts = str(SCRIPTS)
    result = subprocess.run([sys.executable, "-c", f"SCRIPTS = {scripts!r}\n{SCENARIO}"],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines()
             if line.split(" ")[0] in ("released", "grads", "same", "shard", "module",
                                       "partition")]
    assert lines == ["released", "grads after reset True {None}", "same after steps True", "shard 4 1",
                     "module tensors 0",
                     "partition written True"], result.stdout[-3000:]
