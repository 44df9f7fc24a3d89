"""Megatron-LM's own training loop under mover-launch and torchrun, for the tests: the entry
script ``examples/megatron_lm/pretrain_gpt.py`` (in the form of Megatron-LM's, calling nothing
of mover_plugin), a tiny GPT's flags, and the CPU flags a run adds (no fused CUDA kernels, no
DataLoader workers)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from support.gpt_jobs import LAUNCH
from mover_plugin.testing import run_command
from mover_plugin.testing.megatron_lm import CPU_FLAGS
from support.paths import EXAMPLES

SCRIPT = str(EXAMPLES / "megatron_lm" / "pretrain_gpt.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "6", "--lr", "1e-3", "--min-lr", "1e-4",
         "--lr-decay-style", "cosine", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
         "--mock-data", "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000",
         "--log-interval", "1", "--seed", "1234", *CPU_FLAGS, "--resilient-params-digest"]
PP2 = ["--pipeline-model-parallel-size", "2"]
LLAMA_TP2 = ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "128",
             "--group-query-attention", "--num-query-groups", "2", "--normalization", "RMSNorm",
             "--swiglu", "--position-embedding-type", "rope", "--no-rope-fusion",
             "--untie-embeddings-and-output-weights", "--disable-bias-linear",
             "--use-distributed-optimizer"]
"""A Llama-style model (RMSNorm, SwiGLU, RoPE, grouped-query attention, no biases, untied
embeddings) at TP2 x PP1 x DP2 with the distributed optimizer."""
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
"""Set by Megatron-LM's own launch scripts; its checks ask for it with tensor parallelism."""


def mover_launch(*flags: str, launcher_flags=(), cwd: Path, timeout_s: float = 300):
    return run_command([*LAUNCH, "--standalone", "--nproc-per-node", "4", *launcher_flags,
                        SCRIPT, *FLAGS, *flags], timeout_s=timeout_s, cwd=str(cwd), env=ENV)


def torchrun(*flags: str, cwd: Path, timeout_s: float = 300):
    return run_command([*TORCHRUN, "--standalone", "--nproc-per-node", "4", "-m",
                        "mover_plugin.launch.run", SCRIPT, *FLAGS, *flags],
                       timeout_s=timeout_s, cwd=str(cwd), env=ENV)


STEP_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")


def lm_losses(output: str) -> dict[int, float]:
    """The loss of every iteration Megatron-LM logged, by iteration (from 1)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(output)}
