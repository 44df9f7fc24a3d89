"""DeepSpeed adapter: the ``"resilience"`` config block and the runtime of a DeepSpeed
pipeline (``PipelineModule``, ZeRO 0/1) training process."""
