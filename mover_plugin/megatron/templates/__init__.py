"""Training on pipeline templates with Megatron-Core: where each part of it lives.

When a rank is lost and no standby is ready, the survivors train on fewer ranks, on the
pipeline templates the planner chose (:mod:`mover_plugin.templates`: the stage splits;
:mod:`mover_plugin.shrink`: the decision and the way back; :mod:`mover_plugin.placement`: a
plan on ranks). This package is the Megatron-Core side of it:

- :mod:`~mover_plugin.megatron.templates.participant` — the one unit of both Megatron adapters
  that holds a rank's template state (the stage recipe, the shrunk training): it publishes the
  job's spec and profile, moves a survivor onto the plan's templates and back, and reaches the
  training loop through a small strategy (``CoreLoop`` for a Megatron-Core script's loop,
  ``MegatronLMLoop`` for Megatron-LM's);
- :mod:`~mover_plugin.megatron.templates.stage` — one pipeline stage built with explicit
  groups (its layers of the job's model), the per-layer gradient reduction weighted by how many
  micro-batches each holder ran, and the layers and optimizer state moved between ranks when the
  placement changes (``relayout``);
- :mod:`~mover_plugin.megatron.templates.profile` — the per-layer costs the planner plans from,
  measured on a whole model beforehand or by each stage of a running job at its start;
- :mod:`~mover_plugin.megatron.templates.shrunk` — a survivor's training after a shrink, and
  the state moved back into the script's objects when the job grows back;
- :mod:`~mover_plugin.megatron.templates.megatron_lm` — the same on Megatron-LM's own training
  loop: what a survivor trains with, built from what the script gave ``pretrain``, the
  stage's view of the layout the script's code reads, and ``MegatronLMLoop``.

The adapters take part through :attr:`FrameworkAdapter.templates
<mover_plugin.runtime.adapter.FrameworkAdapter.templates>` (the runtime's shrink and growth):
a :class:`~mover_plugin.megatron.templates.participant.MegatronTemplates` each.
The trial the tests of templates run on the example's model is
:mod:`mover_plugin.testing.template_run`.
"""
