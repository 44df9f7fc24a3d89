"""Pure tests of the peer copy's host buffers (mover_plugin.host_memory) on a machine without
CUDA: an ordinary host tensor of exactly the size asked, nothing page-locked, nothing to
release. (On a GPU, ``python -m mover_plugin.gpu_check``'s ``peer_copy_memory`` check.)"""

import torch

from mover_plugin.host_memory import PageLockedBuffer


def test_a_buffer_without_cuda_is_a_host_tensor_of_exactly_its_size():
    assert not torch.cuda.is_available()
    buffer = PageLockedBuffer(3 * 1000 + 1, torch.float32)
    assert (buffer.tensor.numel(), buffer.tensor.dtype, buffer.tensor.device.type) == (
        3001, torch.float32, "cpu")
    assert buffer.nbytes == 3001 * 4 and not buffer.page_locked
    buffer.tensor.fill_(2.0)
    buffer.release()  # nothing to unlock; the tensor stays usable
    assert float(buffer.tensor.sum()) == 6002.0
    assert PageLockedBuffer(0, torch.bfloat16).nbytes == 0
