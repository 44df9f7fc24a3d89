"""Host buffers that are page-locked at exactly their size, for copies out of GPU memory.

torch's pinned memory (``pin_memory=True``) comes from its caching host allocator, which rounds
every block up to the next power of two before it asks CUDA for it: a buffer that lives as long
as a job (the peer copy of an optimizer shard, :mod:`mover_plugin.runtime.peer_copy`) can hold
up to twice its size in page-locked memory. A :class:`PageLockedBuffer` is an ordinary host
tensor of exactly its size, page-locked in place with ``cudaHostRegister`` (what the caching
allocator does not see), so a copy from the GPU into it runs asynchronously, as into pinned
memory, and the memory it holds is its :attr:`~PageLockedBuffer.nbytes`. It is released
(``cudaHostUnregister``) by :meth:`~PageLockedBuffer.release`, or when the buffer object is
collected; a view of its tensor kept beyond that stays valid, no longer page-locked. Without
CUDA it is an ordinary host tensor.
"""

from __future__ import annotations

import contextlib
import logging

import torch

logger = logging.getLogger(__name__)

HOST_REGISTER_PORTABLE = 0x01
"""``cudaHostRegisterPortable``: page-locked for every CUDA context, not only the current
one's."""


class PageLockedBuffer:
    """``numel`` elements of ``dtype`` in host memory, page-locked where CUDA is."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.tensor = torch.empty(numel, dtype=dtype)
        self._registered = False
        if numel > 0 and torch.cuda.is_available():
            self._register()

    @property
    def nbytes(self) -> int:
        """The buffer's bytes: on a machine with CUDA, those it holds page-locked."""
        return self.tensor.numel() * self.tensor.element_size()

    @property
    def page_locked(self) -> bool:
        return self._registered

    def _register(self) -> None:
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostRegister(self.tensor.data_ptr(), self.nbytes,
                                        HOST_REGISTER_PORTABLE)
        if error != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostRegister of {self.nbytes} bytes of host memory "
                               f"failed: {cudart.cudaGetErrorString(error)}")
        self._registered = True

    def release(self) -> None:
        """Unlocks the buffer's pages (the tensor stays usable, as pageable memory)."""
        if not self._registered:
            return
        self._registered = False
        cudart = torch.cuda.cudart()
        error = cudart.cudaHostUnregister(self.tensor.data_ptr())
        if error != cudart.cudaError.success:
            logger.warning("cudaHostUnregister of a %d-byte host buffer failed: %s",
                           self.nbytes, cudart.cudaGetErrorString(error))

    def __del__(self) -> None:
        # Before the tensor's memory can be freed: this object still holds the tensor. (At
        # interpreter exit CUDA may be gone already; the process's pages go with it.)
        with contextlib.suppress(Exception):
            self.release()
