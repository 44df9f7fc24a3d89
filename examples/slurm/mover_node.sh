#!/usr/bin/env bash
# One node's mover-launch under srun, migrated rather than lost when the node is told to go:
#
#   srun --ntasks-per-node=1 examples/slurm/mover_node.sh mover-launch [flags] script.py ...
#
# It runs the command (mover-launch and its flags) and waits for it. When the wrapper itself
# gets SIGTERM, it first moves this node's ranks to standbys on other nodes
# (examples/migrate_host.sh, at most MOVER_MIGRATE_TIMEOUT_S seconds), then stops mover-launch
# with SIGTERM (mover-launch tells the controller that the node leaves, so the job trains on
# with no recovery), and exits with mover-launch's status.
#
# Slurm itself signals every process of a job step at once (srun --signal, scancel --signal, a
# preemption, a time limit), mover-launch and the workers too: such a signal must reach the
# wrapper alone to become a migration, e.g. from the node's own maintenance tooling, or
#   srun --jobid="$SLURM_JOB_ID" --overlap -N1 -w NODE pkill -TERM -f examples/slurm/mover_node.sh
# A drained node or one in a maintenance reservation needs no signal: drain_watch.sh migrates
# it. See docs/operators.md.
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

log() {
    printf '[mover_node] %s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

if [[ $# -eq 0 ]]; then
    echo "usage: mover_node.sh mover-launch [flags] script.py [script flags]" >&2
    exit 2
fi

"$@" &
launch=$!

leave() {
    trap '' TERM
    log "SIGTERM: moving this node's ranks away before its mover-launch (pid $launch) stops"
    bash "$here/../migrate_host.sh"
    log "stopping mover-launch"
    kill -TERM "$launch" 2>/dev/null
}
trap leave TERM

# `wait` returns early when a trapped signal arrives: wait again until mover-launch has ended.
while true; do
    wait "$launch"
    status=$?
    kill -0 "$launch" 2>/dev/null || break
done
exit "$status"
