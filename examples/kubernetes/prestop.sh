#!/usr/bin/env bash
# The preStop hook of a mover-launch pod (examples/kubernetes/jobset.yaml). Kubernetes runs it
# when it stops the pod on purpose (a node drain, an eviction, a deletion), before it sends
# SIGTERM to the pod's mover-launch. It moves this pod's ranks to standbys on other hosts with
# `mover migrate --host <this pod's host>` (examples/migrate_host.sh: the host's name and the
# controller's address and port from the pod's environment, MOVER_JOB_SECRET from the job's
# Secret), within MOVER_MIGRATE_TIMEOUT_S seconds, which the pod's
# terminationGracePeriodSeconds covers. Then mover-launch, on SIGTERM, tells the controller
# that the host leaves: a planned migration, not a crash. On the first worker pod, which runs
# the controller, it only logs that its ranks cannot move.
#
# A hook's output is not in the pod's log, so it writes there through the main process's
# stderr (MOVER_HOOK_LOG names another file). Always exits 0, so that the pod goes on to
# SIGTERM whatever happened.
set -u

exec 2>>"${MOVER_HOOK_LOG:-/proc/1/fd/2}"  # kept as it was where that cannot be opened
echo "[prestop] pod ${HOSTNAME:-?} is stopping: moving its ranks away first" >&2
bash "$(dirname "${BASH_SOURCE[0]}")/../migrate_host.sh"
exit 0
