#!/usr/bin/env bash
# The main demo: a small GPT pretrained with Megatron-Core on 4 CPU processes (TP1 x PP2 x DP2)
# under mover-launch with one standby. Rank 3 is killed with SIGKILL when it begins step 6; the
# standby takes its place inside the running job and the survivors keep their processes.
# The demo first runs the same 10 steps without a failure, then with it, prints each step of
# the second run, what happened (phases and downtime), and whether both runs end with the same
# PARAMS_DIGEST. Every run writes to a new folder under runs/; nothing earlier is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir="runs/demo-$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$run_dir"
model=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
       --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --micro-batch-size 2 --global-batch-size 8 --train-iters 10 --lr 1e-3 --seed 1234)

echo "demo: 1/2 the failure-free run (output in $run_dir/reference.log)"
mover-launch --standalone --nproc-per-node 4 examples/pretrain_gpt.py "${model[@]}" \
    > "$run_dir/reference.log" 2>&1
reference=$(grep '^PARAMS_DIGEST' "$run_dir/reference.log")
echo "demo: $reference"

echo "demo: 2/2 the same run with rank 3 killed at step 6 and one standby"
mover-launch --standalone --nproc-per-node 4 \
    --policy resilient --standbys 1 --inject-failure 3:6 \
    --summary "$run_dir/summary.json" --event-log "$run_dir/events.jsonl" \
    examples/pretrain_gpt.py --resilient "${model[@]}" 2>&1 | tee "$run_dir/resilient.log" \
    | grep -E '^(step|PARAMS_DIGEST|DP_REPLICAS)|mover-launch|mover-agent'
resilient=$(grep '^PARAMS_DIGEST' "$run_dir/resilient.log")
if [ "$resilient" = "$reference" ]; then
    echo "demo: PARAMS_DIGEST equal to the failure-free run: the result is bit-identical"
else
    echo "demo: PARAMS_DIGEST differs from the failure-free run" >&2
    exit 1
fi
echo "demo: summary in $run_dir/summary.json, event log in $run_dir/events.jsonl"
