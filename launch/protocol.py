"""The keys of the control-plane store, shared by the controller and the worker runtime.

* ``gen/current`` — the current generation number;
* ``gen{g}/...`` — generation ``g``'s namespace: its process groups rendezvous under it;
* ``gen{g}/plan`` — how generation ``g`` was formed (JSON: replacements with their twins);
* ``gen{g}/next`` — the generation that follows ``g`` (a planned generation that was
  abandoned, e.g. a migration whose joiner died, is skipped, its namespace never reused). For a
  migration it is set only at the migration's point of no return, once every rank of ``g`` has
  ended the switch iteration: until then a rank lost in ``g`` is recovered in a generation
  planned from ``g``;
* ``gen{g}/switch`` — for a migration's generation ``g``: ``go`` once every rank of the old
  generation ended the switch iteration (the leavers exit, the others switch), or ``cancel``
  (the processes of the old generation go on in it; a crash that cancelled it is recovered
  from there);
* ``gen{g}/handover/{rank}/`` — the two-process group over which the process that hands
  ``rank`` over (the leaver, or a data-parallel twin after a crash) sends its state to the
  process that takes it;
* ``standby/{id}/promote`` — the rank and generation a standby takes over (JSON);
* ``attempt{a}/standbys_ready`` — set once every standby of attempt ``a`` is ready (a resilient
  job's workers wait for it, bounded, before their first step);
* ``job/layout`` — the parallel layout (JSON ``tp``, ``pp``, ``dp``) published by rank 0;
* the ``commands`` and ``events`` mailboxes (``mover_plugin.launch.mailbox``) — the commands
  include the notices to a generation's processes, which the agents relay to their workers
  (``mover_plugin.runtime.notices``) — and the
  ``requests`` mailbox of operator requests (``mover status``, ``mover migrate``), answered
  under ``request/{id}/reply`` (accepted or rejected) and ``request/{id}/done`` (finished).
"""

CURRENT_GENERATION_KEY = "gen/current"
LAYOUT_KEY = "job/layout"


def generation_prefix(generation: int) -> str:
    return f"gen{generation}"


def plan_key(generation: int) -> str:
    return f"gen{generation}/plan"


def standbys_ready_key(attempt: int) -> str:
    return f"attempt{attempt}/standbys_ready"


def successor_key(generation: int) -> str:
    return f"gen{generation}/next"


def switch_decision_key(generation: int) -> str:
    return f"gen{generation}/switch"


SWITCH_GO = "go"
SWITCH_CANCEL = "cancel"


def promotion_key(standby: str) -> str:
    return f"standby/{standby}/promote"


def handover_prefix(generation: int, rank: int) -> str:
    return f"gen{generation}/handover/{rank}/"


REQUESTS_MAILBOX = "requests"


def request_reply_key(request_id: str) -> str:
    return f"request/{request_id}/reply"


def request_done_key(request_id: str) -> str:
    return f"request/{request_id}/done"
