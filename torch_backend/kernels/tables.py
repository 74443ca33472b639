"""Constant tables that the core's kernels build from integer operations, cached per device.

:func:`hvd_gradcomp.hadamard.sylvester` builds THC's Sylvester factor (float32 [32, 32] for the
default 1024-coordinate blocks) from about fifteen small integer operations; THC asks for it in
every ``compress`` (``ops.fuse(hadamard.sylvester, size)``). Its fused form here returns one
tensor per (size, device), built by the reference once: the same values (it *is* the
reference's output), no operation after the first call. The kernels only read it (matrix
products, slices); nothing writes into it. While ``torch.compile`` traces, the reference runs
(the traced graph builds its own constant).

Registered for the CPU and CUDA (and, under ``HVD_GRADCOMP_KERNELS=triton``, every device type,
as the Triton providers are).
"""
import torch

from hvd_gradcomp import hadamard
from torch_backend.kernels.forms import register
from torch_backend.reference_ops import REFERENCE_OPS

__all__ = ["sylvester"]

_CACHE = {}



def sylvester(size: int, like):
    """float32 [size, size] on ``like``'s device: :func:`hvd_gradcomp.hadamard.sylvester`'s
    matrix, built once per (size, device) and shared; read it, never write into it."""
    if torch.compiler.is_compiling():
        return hadamard.sylvester(REFERENCE_OPS, size, like)
    key = (size, like.device)
    matrix = _CACHE.get(key)
    if matrix is None:
        matrix = _CACHE[key] = hadamard.sylvester(REFERENCE_OPS, size, like)
    return matrix


for _device in ("cpu", "cuda"):
    register(hadamard.sylvester, _device, lambda size: True, sylvester, "tables.sylvester")
