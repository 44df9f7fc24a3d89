"""The Megatron-Core adapter of mover_plugin.

``arguments`` (Megatron-LM-style flags and their checks; imports no framework),
``checkpoint`` (save and exact resume), ``resilience`` (what a training script calls, and the
runtime's adapter protocol for Megatron-Core), ``standby`` (the general standby's warm-up in
a sandbox) and ``standby_memory`` (which of its warmed roles a standby keeps). Modules that need Megatron-Core import it themselves; importing this package does
not.
"""
