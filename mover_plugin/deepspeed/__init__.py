"""DeepSpeed adapter: the ``"resilience"`` config block, the runtime of a DeepSpeed training
process (a ``PipelineModule``, or a data-parallel engine at ZeRO 0 to 3), and the drop-in that
drives it from an unmodified script or a Transformers ``Trainer`` script."""
