"""Flags of Megatron-LM's own training loop that mover_plugin's tests and benchmarks share: what
a run on CPU processes adds to the job's (no fused CUDA kernels, gloo, no DataLoader workers),
and Megatron-LM's Llama 3 recipe scaled down to this machine."""

from __future__ import annotations

CPU_FLAGS = ("--transformer-impl", "local", "--distributed-backend", "gloo",
             "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
             "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
             "--no-persist-layer-norm", "--num-workers", "0")
LLAMA3_RECIPE = ["--tensor-model-parallel-size", "2", "--ffn-hidden-size", "128",
                 "--group-query-attention", "--num-query-groups", "2", "--kv-channels", "16",
                 "--position-embedding-type", "rope", "--rotary-base", "1000000",
                 "--rotary-percent", "1.0", "--no-rope-fusion", "--attention-dropout", "0.0",
                 "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
                 "--untie-embeddings-and-output-weights", "--disable-bias-linear",
                 "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
                 "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
                 "--calculate-per-token-loss", "--manual-gc", "--decoupled-lr", "5e-4",
                 "--decoupled-min-lr", "4.5e-5", "--use-distributed-optimizer",
                 "--overlap-grad-reduce", "--overlap-param-gather",
                 "--no-create-attention-mask-in-dataloader", "--exit-duration-in-mins", "235"]
"""Megatron-LM's Llama 3 recipe (``examples/llama/train_llama3_8b_h100_fp8.sh`` at
core_v0.19.0) scaled down: its model, optimizer, precision and data-parallel flags, with
TP2 x PP1 x DP2 for its data-parallel-only layout, so that a lost rank also has a
tensor-parallel peer. Left out, GPU-only: FP8, ``--apply-layernorm-1p`` (Transformer Engine's
LayerNorm), ``--sequence-parallel`` (Transformer Engine's LayerNorm at TP > 1; Megatron-LM turns
it off at TP1), ``--attention-backend``, ``--cross-entropy-loss-fusion``, profiling; and its
sizes, schedule and checkpoint flags."""
