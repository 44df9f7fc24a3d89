#!/usr/bin/env bash
# The main demo: a small GPT pretrained with Megatron-Core on 4 CPU processes (TP1 x PP2 x DP2)
# under mover-launch, with rank 3 killed by SIGKILL when it begins step 6. Prints each step,
# what happened to the interruption and its downtime, and PARAMS_DIGEST.
# Every run writes to a new folder under runs/; nothing from an earlier run is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir="runs/demo-$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$run_dir"
echo "demo: writing checkpoints and the summary to $run_dir"
mover-launch --standalone --nproc-per-node 4 \
    --policy restart --inject-failure 3:6 --summary "$run_dir/summary.json" \
    examples/pretrain_gpt.py \
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 \
    --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --seed 1234 \
    --save "$run_dir/ckpt" --load "$run_dir/ckpt" --save-interval 1
echo "demo: summary in $run_dir/summary.json"
