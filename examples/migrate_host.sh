#!/usr/bin/env bash
# Moves a host's ranks to standbys on other hosts before the host goes: `mover migrate --host`
# against the job that the scheduler's environment names. One script for every planned exit:
# the Kubernetes preStop hook (examples/kubernetes/prestop.sh), the Slurm node wrapper and the
# Slurm drain watcher (examples/slurm/). See docs/operators.md.
#
#   examples/migrate_host.sh [HOST]
#
# HOST is the host's name in the job (default: this host). This host's name, the first host's
# (which runs the controller) and the controller's address and port come from
# `python3 -m mover_plugin.launch.hosts`, which reads Slurm's variables or a JobSet pod's, as
# mover-launch does. MOVER_JOB_SECRET opens the job. The whole takes at most
# MOVER_MIGRATE_TIMEOUT_S seconds (default 40). One log line per step, on stderr. Always exits
# 0: whatever happened, the host may go on stopping.
set -u

bound="${MOVER_MIGRATE_TIMEOUT_S:-40}"
python="${MOVER_PYTHON:-python3}"

log() {
    printf '[migrate_host] %s %s\n' "$(date -u +%H:%M:%S)" "$*" >&2
}

if ! where="$(timeout 15 "$python" -m mover_plugin.launch.hosts)"; then
    log "no job found from this environment (see above): the host goes without a migration"
    exit 0
fi
read -r _ this_host addr port first_host <<<"$where"
host="${1:-$this_host}"
if [[ "$host" == "$first_host" ]]; then
    log "$host runs the job's controller: its ranks cannot move away with it; when it goes," \
        "the job ends (started again, it resumes from its last checkpoint)"
    exit 0
fi

log "moving the ranks of $host to standbys on other hosts (job at $addr:$port, at most" \
    "$bound s)"
started=$SECONDS
timeout --kill-after=2 "$bound" mover --master-addr "$addr" --master-port "$port" \
    migrate --host "$host" --timeout "$bound" >&2
status=$?
case $status in
    0) log "done after $((SECONDS - started)) s: $host holds no rank of the job" ;;
    124 | 137) log "not done within $bound s: $host goes with its migration under way" ;;
    *) log "mover migrate --host $host ended with status $status (above): $host goes as it is" ;;
esac
exit 0
