#!/usr/bin/env bash
# The main demo: a small GPT pretrained with Megatron-Core on 4 CPU processes (TP1 x PP2 x DP2)
# under mover-launch with two standbys. Rank 1 is migrated to a standby when it begins step 3
# (as 'mover migrate --rank 1' would ask), and rank 3 is killed with SIGKILL when it begins
# step 12; each time a standby takes the rank's place inside the running job and the other
# ranks keep their processes. The demo first runs the same 20 steps without interruption, then
# with both, prints each step of the second run, what happened (phases and downtime), and
# whether both runs end with the same PARAMS_DIGEST. Every run writes to a new folder under
# runs/; nothing earlier is touched.
set -euo pipefail
cd "$(dirname "$0")/.."
run_dir="runs/demo-$(date +%Y%m%d-%H%M%S)-$$"
mkdir -p "$run_dir"
model=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2
       --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64
       --micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 1e-3 --seed 1234)

echo "demo: 1/2 the run without interruption (output in $run_dir/reference.log)"
mover-launch --standalone --nproc-per-node 4 examples/pretrain_gpt.py "${model[@]}" \
    > "$run_dir/reference.log" 2>&1
reference=$(grep '^PARAMS_DIGEST' "$run_dir/reference.log")
echo "demo: $reference"

echo "demo: 2/2 the same run with two standbys, rank 1 migrated at step 3, rank 3 killed at step 12"
mover-launch --standalone --nproc-per-node 4 \
    --policy resilient --standbys 2 --inject-migration 1:3 --inject-failure 3:12 \
    --summary "$run_dir/summary.json" --event-log "$run_dir/events.jsonl" \
    examples/pretrain_gpt.py --resilient "${model[@]}" 2>&1 | tee "$run_dir/resilient.log" \
    | grep -E '^(step|PARAMS_DIGEST|DP_REPLICAS)|mover-launch|mover-agent'
resilient=$(grep '^PARAMS_DIGEST' "$run_dir/resilient.log")
if [ "$resilient" = "$reference" ]; then
    echo "demo: PARAMS_DIGEST equal to the run without interruption: the result is bit-identical"
else
    echo "demo: PARAMS_DIGEST differs from the run without interruption" >&2
    exit 1
fi
echo "demo: summary in $run_dir/summary.json, event log in $run_dir/events.jsonl"
mover report "$run_dir" | sed 's/^/demo: /'
