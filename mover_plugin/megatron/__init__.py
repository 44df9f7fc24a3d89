"""The Megatron-Core adapter of mover_plugin.

``arguments`` (Megatron-LM-style flags and their checks; imports no framework), ``checkpoint``
(save and exact resume), ``resilience`` (what a training script calls, and the runtime's
adapter protocol for Megatron-Core), ``standby`` (the general standby's warm-up in a sandbox),
``standby_memory`` (which of its warmed roles a standby keeps), Megatron-LM's own training loop
(``training_loop``, ``lm_resilience``, ``lm_standby``, ``lm_counters``) and ``templates``
(training on pipeline templates: its package docstring is the map). Modules that need
Megatron-Core import it themselves; importing this package does not.
"""
