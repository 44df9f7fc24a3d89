"""The in-process resilience runtime of a worker (framework-agnostic part).

``resilience`` (the runtime: promotion, the step, the commit gate, the switch after a crash),
``group_switch`` (a generation's groups built, rebuilt only where needed, installed and
rewired), ``state_transfer`` (a rank's state sent to a joiner and loaded), ``adapter`` (the
protocol a framework adapter implements for it), ``ledger`` (completed iterations, the running
one's commit record and the commit rule), ``migration`` (a process's part in a planned
migration), ``template_switch`` (a survivor's shrink onto pipeline templates and its growth
back), ``faults`` (faults injected into migrations for tests), ``exits`` (a lost peer told from
a bug; leaving without teardown), ``settings`` (the resilience settings, their flags and
checks: one source of truth for the Megatron flags and the DeepSpeed config block), ``control``
(the worker's client of the controller: generations, plans, events), ``notices`` (the
controller's notices, read from the agent's pipe), ``heartbeat``, ``handover`` (one rank's
state sent to the process that takes it), ``random_streams`` (a process's random-number streams,
captured, restored and carried as bytes), ``rewire`` (cached group references rewritten) and
``preflight`` (the script side of the launcher's flag check).
"""
