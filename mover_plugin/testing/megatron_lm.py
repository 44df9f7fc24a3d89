"""The flags a run of Megatron-LM's own training loop on CPU processes adds to the job's
(mover_plugin's tests and benchmarks run it so): no fused CUDA kernels, gloo, no DataLoader
workers."""

from __future__ import annotations

CPU_FLAGS = ("--transformer-impl", "local", "--distributed-backend", "gloo",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-persist-layer-norm", "--num-workers", "0")
