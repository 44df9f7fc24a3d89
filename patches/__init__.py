"""Opt-in, reversible, version-checked patches to the frameworks the plugin drives.

The registry (:mod:`mover_plugin.patches.registry`) holds named patches. Each patch targets one
distribution (for example ``megatron-core``) and states the version range it was written and
tested for, and a condition saying when it is wanted. The patches are:

- **opt-in**: importing this package or any module in it applies nothing and imports no
  framework; call :func:`apply_patches` with a group or patch names;
- **reversible**: :func:`apply_patches` returns an :class:`AppliedPatches`, whose ``revert()``
  (or the end of its ``with`` block) puts every original object back, identical (``is``);
- **version-checked, all-or-nothing**: an installed version outside a patch's tested range raises
  :class:`~mover_plugin.errors.UnsupportedVersionError`, and a missing distribution raises
  :class:`~mover_plugin.errors.PatchError`, before anything is modified;
- **conditional**: a patch whose condition is false is skipped and listed in
  ``AppliedPatches.skipped``. The ``megatron-cpu`` group (:mod:`mover_plugin.patches.megatron_cpu`)
  applies only while ``torch.cuda.is_available()`` is False. The ``local-collectives`` patch
  (:mod:`mover_plugin.patches.local_collectives`) keeps a joining standby's model build from
  talking to the running ranks. The ``deepspeed-cpu`` group
  (:mod:`mover_plugin.patches.deepspeed_cpu`) lets DeepSpeed 0.19 train on CPU processes and
  re-enter a training step that lost a peer; the ``deepspeed-hooks`` group
  (:mod:`mover_plugin.patches.deepspeed_hooks`) the hook points through which mover_plugin
  enters an unmodified DeepSpeed script. For Megatron-LM's own training loop
  (``megatron.training``), the ``megatron-lm-cpu`` group
  (:mod:`mover_plugin.patches.megatron_lm_cpu`) adds the CPU stand-ins that loop needs, and the
  ``megatron-lm-hooks`` group (:mod:`mover_plugin.patches.megatron_lm_hooks`) the hook points
  through which mover_plugin enters it, and the ``megatron-lm-backend`` group
  (:mod:`mover_plugin.patches.megatron_lm_backend`) its helpers that ask the backend's name
  (``--exit-signal-handler``) the answer for the ``mover`` backend. The ``mover-comm`` group
  (:mod:`mover_plugin.patches.mover_comm`), applied by ``register_backend()``, lets torch's own
  ``batch_isend_irecv`` batch on the ``mover`` backend's groups.

Applying a patch that is already applied raises :class:`~mover_plugin.errors.PatchError`.

Example::

    from mover_plugin.patches import apply_patches

    with apply_patches("megatron-cpu") as applied:
        print(applied.names)  # ('rng', 'curdev', 'factory', 'sync', 'stream', 'clip', 'typestr')
        ...                   # build and train a Megatron-Core model on CPU with gloo
"""

from mover_plugin.patches import (
    deepspeed_cpu,
    deepspeed_hooks,
    local_collectives,
    megatron_cpu,
    megatron_lm_backend,
    megatron_lm_cpu,
    megatron_lm_hooks,
    mover_comm,
)
from mover_plugin.patches.registry import (
    DEFAULT_REGISTRY,
    AppliedPatches,
    AttributeSwap,
    Patch,
    PatchRegistry,
    Undo,
    active_patches,
    apply_inactive_patches,
    apply_patches,
    available_patches,
    patch_groups,
    register_patch,
)

__all__ = [
    "DEFAULT_REGISTRY",
    "AppliedPatches",
    "AttributeSwap",
    "Patch",
    "PatchRegistry",
    "Undo",
    "active_patches",
    "apply_inactive_patches",
    "apply_patches",
    "available_patches",
    "deepspeed_cpu",
    "deepspeed_hooks",
    "local_collectives",
    "megatron_cpu",
    "megatron_lm_backend",
    "megatron_lm_cpu",
    "megatron_lm_hooks",
    "mover_comm",
    "patch_groups",
    "register_patch",
]
