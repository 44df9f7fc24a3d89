"""The keys of the control-plane store, shared by the controller and the worker runtime.

* ``gen/current`` — the current generation number;
* ``gen{g}/...`` — generation ``g``'s namespace: its process groups rendezvous under it;
* ``gen{g}/plan`` — how generation ``g`` was formed (JSON: replacements with their twins);
* ``gen{g}/alarm`` — set when generation ``g`` is over: survivors leave the step they are in;
* ``standby/{id}/promote`` — the rank and generation a standby takes over (JSON);
* ``job/layout`` — the parallel layout (JSON ``tp``, ``pp``, ``dp``) published by rank 0;
* the ``commands`` and ``events`` mailboxes (``mover_plugin.launch.mailbox``).
"""

CURRENT_GENERATION_KEY = "gen/current"
LAYOUT_KEY = "job/layout"


def generation_prefix(generation: int) -> str:
    return f"gen{generation}"


def plan_key(generation: int) -> str:
    return f"gen{generation}/plan"


def alarm_key(generation: int) -> str:
    return f"gen{generation}/alarm"


def promotion_key(standby: str) -> str:
    return f"standby/{standby}/promote"
