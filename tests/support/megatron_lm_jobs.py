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
INTERLEAVED_PP4 = ["--pipeline-model-parallel-size", "4", "--num-layers", "8",
                   "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "16",
                   "--use-distributed-optimizer", "--overlap-grad-reduce"]
"""TP1 x PP4 x DP2 (8 processes) with two virtual stages per rank (Megatron-LM's interleaved
1F1B schedule), the distributed optimizer and gradient reductions overlapped with the
backward pass."""
GPT3_RECIPE = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
               "--micro-batch-size", "1", "--global-batch-size", "8",
               "--rampup-batch-size", "4", "4", "8", "--weight-decay", "0.1",
               "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
               "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--min-lr", "6.0e-6",
               "--lr-warmup-fraction", ".001", "--lr-decay-iters", "8", "--train-iters", "8",
               "--initial-loss-scale", "1048576", "--loss-scale-window", "2",
               "--hysteresis", "1"]
"""Megatron-LM's GPT-3 175B recipe (``examples/gpt3/train_gpt3_175b_distributed.sh`` at
core_v0.19.0) scaled down to TP2 x PP2 x DP2 (8 processes): its training flags (fp16 with
the dynamic loss scaler, the batch-size ramp-up, Adam's betas, weight decay, clipping, the
cosine schedule), its micro-batch size and its tensor and pipeline parallelism
(``--rampup-batch-size`` is accepted and, as under torchrun, ignored: Megatron-Core 0.19
deprecated it for ``--step-batch-size-schedule``). The loss
scaler starts lower and adapts faster than by default, so that the few steps both skip
updates (fp16 overflows) and apply them. Left out: ``--attention-backend`` (GPU-only), its
sizes, data and checkpoint flags, and its evaluations."""
MIXTRAL_RECIPE = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2",
                  "--num-experts", "4", "--moe-router-topk", "2",
                  "--moe-router-load-balancing-type", "aux_loss", "--moe-aux-loss-coeff", "1e-2",
                  "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
                  "--overlap-grad-reduce", "--use-distributed-optimizer", "--sequence-parallel",
                  "--use-mcore-models", "--disable-bias-linear", "--ffn-hidden-size", "128",
                  "--init-method-std", "0.01", "--attention-dropout", "0.0",
                  "--hidden-dropout", "0.0", "--normalization", "RMSNorm",
                  "--position-embedding-type", "rope", "--swiglu",
                  "--untie-embeddings-and-output-weights", "--group-query-attention",
                  "--num-query-groups", "2", "--no-position-embedding",
                  "--rotary-base", "1000000", "--no-rope-fusion", "--micro-batch-size", "1",
                  "--lr", "1e-4", "--min-lr", "1.0e-5", "--lr-decay-style", "cosine",
                  "--lr-warmup-iters", "1", "--lr-decay-iters", "6", "--weight-decay", "0.1",
                  "--clip-grad", "1.0", "--bf16"]
"""Megatron-LM's Mixtral 8x7B recipe (``examples/mixtral/train_mixtral_8x7b_distributed.sh``
at core_v0.19.0) scaled down to TP1 x PP2 x DP2 (4 processes) with 4 experts over an
expert-model-parallel size of 2: as in the recipe's own layout (PP4 x EP8 on 32 GPUs), the
experts are split over the whole data-parallel group, so no other rank holds a rank's experts
(an expert-data-parallel size of 1) and they travel in the distributed optimizer's shard: its
model flags (RMSNorm, SwiGLU, rotary embeddings, grouped
queries, untied embeddings, no dropout), its MoE flags (top-2 routing with the load-balancing
loss, the alltoall token dispatcher), its optimizer, schedule and precision flags (bf16, the
distributed optimizer with both overlaps), and ``--sequence-parallel`` (which Megatron-LM turns
off at TP1). Left out, GPU-only: ``--moe-grouped-gemm``; and its sizes, data, checkpoint and
evaluation flags."""
GPT_OSS_RECIPE = ["--expert-model-parallel-size", "2", "--num-experts", "4",
                  "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
                  "--moe-aux-loss-coeff", "1e-3", "--moe-z-loss-coeff", "1e-3",
                  "--moe-router-dtype", "fp32", "--moe-token-dispatcher-type", "alltoall",
                  "--moe-ffn-hidden-size", "128", "--overlap-param-gather",
                  "--overlap-grad-reduce", "--use-distributed-optimizer", "--sequence-parallel",
                  "--context-parallel-size", "1", "--use-mcore-models", "--disable-bias-linear",
                  "--untie-embeddings-and-output-weights", "--no-rope-fusion",
                  "--normalization", "RMSNorm", "--ffn-hidden-size", "128",
                  "--group-query-attention", "--num-query-groups", "2", "--rotary-percent", "1.0",
                  "--rope-type", "rope", "--position-embedding-type", "rope",
                  "--rotary-base", "10000", "--quick-geglu", "--glu-linear-offset", "1.0",
                  "--softmax-type", "learnable", "--window-attn-skip-freq", "2",
                  "--activation-func-clamp-value", "7.0", "--window-size", "15,0",
                  "--no-create-attention-mask-in-dataloader", "--micro-batch-size", "1",
                  "--lr", "1.0e-5", "--min-lr", "1.0e-6", "--lr-decay-style", "cosine",
                  "--lr-warmup-fraction", "0.05", "--weight-decay", "0.1", "--clip-grad", "1.0",
                  "--bf16"]
"""Megatron-LM's gpt-oss recipe (``examples/gptoss/02_train.sh`` at core_v0.19.0) scaled down
to TP1 x DP4 (4 processes) with 4 experts over EP2: its attention (learnable softmax offsets,
sliding windows of 16 tokens on every other layer, grouped queries, RoPE), its quick-GeGLU
experts with clamped activations, top-2 routing with the load-balancing and z losses in an
fp32 router, the alltoall dispatcher, bf16 and the distributed optimizer with both overlaps.
The recipe itself runs one pipeline stage per GPU with EP1 (no data-parallel twin at all, so
``--resilient`` refuses it as it stands); here its stages become data-parallel replicas so that
every rank has a twin. Left out: ``--enable-gpt-oss`` and ``--export-force-local-attention``
(ModelOpt's flags, which Megatron-LM's parser has only with ``nvidia-modelopt`` installed),
GPU-only ``--moe-grouped-gemm``, ``--moe-permute-fusion`` and Transformer Engine; its sizes,
data and checkpoint flags."""
ENV = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
"""Set by Megatron-LM's own launch scripts; its checks ask for it with tensor parallelism."""


def mover_launch(*flags: str, launcher_flags=(), cwd: Path, timeout_s: float = 300,
                 nproc: int = 4):
    return run_command([*LAUNCH, "--standalone", "--nproc-per-node", str(nproc), *launcher_flags,
                        SCRIPT, *FLAGS, *flags], timeout_s=timeout_s, cwd=str(cwd), env=ENV)


def torchrun(*flags: str, cwd: Path, timeout_s: float = 300, nproc: int = 4):
    return run_command([*TORCHRUN, "--standalone", "--nproc-per-node", str(nproc), "-m",
                        "mover_plugin.launch.run", SCRIPT, *FLAGS, *flags],
                       timeout_s=timeout_s, cwd=str(cwd), env=ENV)


STEP_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: (\S+) \|")


def lm_losses(output: str) -> dict[int, float]:
    """The loss of every iteration Megatron-LM logged, by iteration (from 1)."""
    return {int(step): float(loss) for step, loss in STEP_LINE.findall(output)}


def router_losses(output: str, name: str = "load_balancing_loss") -> dict[int, float]:
    """One of the MoE routers' losses Megatron-LM logged (``load_balancing_loss``,
    ``z_loss``), by iteration (from 1)."""
    line = re.compile(rf"iteration\s+(\d+)/\s*\d+ \|.*?\| {name}: (\S+) \|")
    return {int(step): float(loss) for step, loss in line.findall(output)}
