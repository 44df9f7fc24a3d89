"""The Megatron-Core adapter of mover_plugin.

``arguments`` (Megatron-LM-style flags and their checks; imports no framework) and
``checkpoint`` (save and exact resume). Modules that need Megatron-Core import it themselves;
importing this package does not.
"""
