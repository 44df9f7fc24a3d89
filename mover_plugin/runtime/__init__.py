"""The in-process resilience runtime of a worker (framework-agnostic part).

``settings`` (the resilience settings, their flags and checks: one source of truth for the
Megatron flags and the DeepSpeed config block), ``control`` (the worker's client of the
controller: generations, plans, alarms, events) and ``heartbeat``.
"""
