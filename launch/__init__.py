"""``mover-launch``: the job launcher of mover_plugin (installed as ``mover_plugin.launch``).

A job has one *controller* (on the first host; it owns the job's control-plane TCPStore and
outlives every rank) and one *agent* per host (it starts and watches the worker processes and
delivers injected failures). The controller applies a *policy* when a worker dies; the first
policy, ``restart``, is the baseline users have today: stop all workers, start all again, and
let the training script resume from its latest checkpoint.

The ``resilient`` policy replaces a lost rank with a standby inside the running job, and the
``mover`` command (``jobctl``) moves ranks to standbys on an operator's request.

Modules: ``hostfile`` (host list parsing), ``slurm`` (the hosts from Slurm's variables),
``kubernetes`` (the hosts from a JobSet pod's), ``departure`` (a host's ``mover-launch`` stopped
with SIGTERM leaves the job as planned), ``deepspeed_line`` (the ``deepspeed`` launcher's
flags), ``config`` (flags and their checks), ``summary`` (interruption timing and the JSON
summary), ``eventlog``, ``agent`` (and ``inbox``: the commands it waits for), ``liveness`` (the
agents' heartbeats), ``store_gate`` and ``gate_server`` (the job's one port, in a process of its
own), ``controller`` and its units (``context``: the state they share; ``attempts``, ``timing``,
``recovery``, ``migration``, ``operator_requests``; ``step_times``: the step ends the agents
batch and the controller logs; ``refill``: the standby pool brought back to its target),
``slow_ranks`` (the slow-rank policy's detector), ``preflight`` (checking the script's own flags
before any worker starts), ``cli`` (the ``mover-launch`` console script), ``jobs`` (the jobs
running on this host) and ``jobctl`` (``mover status``, ``mover migrate`` and their Python API;
``mover report``, drawn by ``report``; ``mover templates``, printed by ``plans``; ``mover
simulate``, by ``simulation``). What passes between the launcher and the processes it starts is
in :mod:`mover_plugin.contract`, sent over :mod:`mover_plugin.mailbox`.
"""
