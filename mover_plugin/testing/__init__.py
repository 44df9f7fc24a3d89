"""Helpers for multi-process tests of distributed code (used by mover_plugin's own tests).

``run_ranks`` runs a function on N processes joined in a gloo group over a TCPStore on a port
the OS chose; ``run_command`` runs a command line (e.g. ``mover-launch``) in its own process
group, and in ``finally`` kills every process it started, those in groups of their own too
(found by an id in their environment). Both use layered timeouts (the group's < the harness's
< the test runner's) and bind each child to die with its parent.
``processes_with_env`` finds a job's processes by a tag in their environment.
"""

from mover_plugin.testing.harness import (
    CommandResult,
    RankFailure,
    processes_with_env,
    run_command,
    run_ranks,
)

__all__ = ["CommandResult", "RankFailure", "processes_with_env", "run_command", "run_ranks"]
