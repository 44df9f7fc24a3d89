"""``mover-comm``: torch's own functions treat the ``mover`` backend's groups as c10d's groups.

- ``batch-p2p``: ``torch.distributed.batch_isend_irecv`` batches its operations (on NCCL: one
  coalesced ``ncclGroupStart``/``End``) only for a group whose type is exactly c10d's
  ``ProcessGroup``. A ``mover`` group is a subclass, so torch issues its sends and receives one
  by one; on NCCL two pipeline neighbours that both send first (Megatron's ``batch_p2p_comm``)
  then wait for each other once a tensor exceeds NCCL's buffers. With the patch, a group that
  batches on its own (it has a ``batch_p2p`` method, as
  :class:`mover_plugin.comm.process_group.MoverProcessGroup` has) gets the whole list; any
  other group goes to torch's own function. Callers that looked the function up through
  ``torch.distributed`` at call time (Megatron-Core's pipeline) get the patched one.

:func:`mover_plugin.comm.register_backend` applies this group: a process that builds ``mover``
groups gets it.
"""

from __future__ import annotations

from typing import Any

from mover_plugin.patches.registry import AttributeSwap, Patch, Undo, register_patch

GROUP = "mover-comm"
TESTED_VERSIONS = ">=2.13.0,<2.15"


def _apply_batch_p2p() -> Undo:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    original = c10d.batch_isend_irecv

    def batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
        batch = getattr(p2p_op_list[0].group if p2p_op_list else None, "batch_p2p", None)
        if batch is None:
            return original(p2p_op_list)
        c10d._check_p2p_op_list(p2p_op_list)  # noqa: SLF001 - the checks torch's function makes
        return batch(p2p_op_list)

    batch_isend_irecv.__wrapped__ = original  # type: ignore[attr-defined]
    swap = AttributeSwap()
    swap.set_attr(dist, "batch_isend_irecv", batch_isend_irecv)
    swap.set_attr(c10d, "batch_isend_irecv", batch_isend_irecv)
    return swap.restore


register_patch(Patch(
    name="batch-p2p", distribution="torch", tested_versions=TESTED_VERSIONS,
    description="batch_isend_irecv hands a mover group's whole batch to the group",
    apply=_apply_batch_p2p, groups=(GROUP,)))
