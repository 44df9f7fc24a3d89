"""The Megatron-Core adapter of mover_plugin.

``arguments`` (Megatron-LM-style flags and their checks; imports no framework),
``checkpoint`` (save and exact resume), ``resilience`` (what a training script calls, and the
runtime's adapter protocol for Megatron-Core) and ``standby`` (the general standby's warm-up in
a sandbox). Modules that need Megatron-Core import it themselves; importing this package does
not.
"""
