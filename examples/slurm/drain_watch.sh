#!/usr/bin/env bash
# Migrates the ranks of the job's nodes that Slurm is about to take away, while the job runs:
#
#   bash examples/slurm/drain_watch.sh &     # in the batch script, before srun
#
# Every MOVER_WATCH_PERIOD_S seconds (default 30) it asks `sinfo` for the state of the job's
# nodes (SLURM_JOB_NODELIST) and runs examples/migrate_host.sh for each node that is drained or
# draining (`drain`, `drng`: scontrol update state=DRAIN, a node health check), in a
# maintenance reservation (`maint`, or a state ending in `$`), or waiting for a reboot (`@`:
# scontrol reboot ASAP). Once a node holds no rank, taking it down interrupts nothing: its
# mover-launch ends, and the job, submitted with --no-kill, trains on. A node is tried again at
# each look until it holds no rank (a migration is refused while another one runs, or before
# a standby is ready). The first node runs the controller and cannot be moved
# (migrate_host.sh says so).
# MOVER_JOB_SECRET opens the job, as for mover-launch. See docs/operators.md.
set -u

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
period="${MOVER_WATCH_PERIOD_S:-30}"
nodes="${SLURM_JOB_NODELIST:?drain_watch.sh runs inside a Slurm job (SLURM_JOB_NODELIST)}"
declare -A moved=()

log() {
    printf '[drain_watch] %s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

# The job's nodes whose state says they are being taken away (sinfo prints "NODE STATE",
# a node once per partition it is in).
leaving_nodes() {
    sinfo --noheader --Node --nodes="$nodes" --format="%N %t" 2>/dev/null \
        | awk '$2 ~ /^(drain|drng|maint)/ || $2 ~ /[$@]$/ { print $1 }' | sort -u
}

log "watching nodes $nodes every $period s"
while true; do
    for node in $(leaving_nodes); do
        [[ -n "${moved[$node]:-}" ]] && continue
        log "node $node is being taken out of service: moving its ranks away"
        said="$(bash "$here/../migrate_host.sh" "$node" 2>&1 | tee -a /dev/stderr)"
        if grep -q -e "holds no rank" -e "runs the job's controller" <<<"$said"; then
            moved[$node]=1
        fi
    done
    sleep "$period"
done
