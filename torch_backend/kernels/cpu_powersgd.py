"""Fused CPU forms of PowerSGD's projection basis (:func:`hvd_gradcomp.orthogonalize.basis_rows`)
and of its agreement check on receipt (:func:`agree`, ``powersgd._agree_kernel``). The basis:
one compiled C loop (``csrc/powersgd.c``, built by :mod:`torch_backend.kernels.cbuild`) for the
two Gram-Schmidt passes over a factor's ``r`` rows, where the reference runs about 15 PyTorch
operations a row (65 at rank 4), each a dispatch on the CPU and a launch on a GPU.

Results: within float32 rounding of the reference's (the C loop sums its dot products and
norms in double, in index order; PyTorch sums float32 in its own order), with the same guards
(a zero row takes the fill's, a dependent row comes out exactly zero, a NaN/inf row stays
non-finite). Every rank running this form gets the same bits, which PowerSGD's basis
fingerprints need; a job whose ranks mix this form and the reference (``HVD_GRADCOMP_KERNELS``
set differently) would see its fingerprints disagree now and then and realign (an output of 0
for that tensor and step, never a wrong value). Plans: every ``rel_tol``; factors of float32
CPU tensors with ``r <= 64`` (else the reference).

Raises ``ImportError`` on import when the library cannot be built (:mod:`~torch_backend.kernels.cbuild`).
"""
import ctypes

import torch

from hvd_gradcomp.orthogonalize import basis_rows, basis_rows_batched
from hvd_gradcomp.powersgd import CONTROL, _agree_kernel, agree_tolerance
from torch_backend.kernels.forms import register
from torch_backend.kernels import cbuild
from torch_backend.reference_ops import REFERENCE_OPS

__all__ = ["basis", "basis_batched", "agree", "MAX_RANK"]

MAX_RANK = 64

_lib = cbuild.load("powersgd")
_lib.hgc_basis.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float,
                           ctypes.c_void_p]
_lib.hgc_basis.restype = ctypes.c_int64
_lib.hgc_powersgd_agree.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p,
                                    ctypes.c_void_p]
_lib.hgc_powersgd_agree.restype = None



def basis(rel_tol, pt, fillt):
    """Fused ``basis_rows``: float32 [r, n], the orthonormal basis' columns as rows (module
    docstring)."""
    if (torch.compiler.is_compiling() or not (pt.is_cpu and fillt.is_cpu) or pt.dtype != torch.float32
            or fillt.dtype != torch.float32 or pt.dim() != 2 or pt.shape != fillt.shape):
        return basis_rows(REFERENCE_OPS, rel_tol, pt, fillt)
    r, n = pt.shape
    pt, fillt = pt.contiguous(), fillt.contiguous()
    out = torch.empty((r, n), dtype=torch.float32)
    if r and n and _lib.hgc_basis(pt.data_ptr(), fillt.data_ptr(), n, r, float(rel_tol), out.data_ptr()) < 0:
        return basis_rows(REFERENCE_OPS, rel_tol, pt, fillt)  # more than MAX_RANK rows: the C loop refused
    return out


def basis_batched(rel_tol, pt, fillt):
    """Fused ``basis_rows_batched`` (PowerSGD batched): float32 [B, r, n], the C loop of
    :func:`basis` run on each matrix of the batch in turn (one call: no PyTorch operation per
    matrix), so each row equals the per-matrix fused form's bit for bit."""
    if (torch.compiler.is_compiling() or not (pt.is_cpu and fillt.is_cpu) or pt.dtype != torch.float32
            or fillt.dtype != torch.float32 or pt.dim() != 3 or pt.shape != fillt.shape):
        return basis_rows_batched(REFERENCE_OPS, rel_tol, pt, fillt)
    b, r, n = pt.shape
    pt, fillt = pt.contiguous(), fillt.contiguous()
    out = torch.empty((b, r, n), dtype=torch.float32)
    step = 4 * r * n  # bytes per matrix
    for j in range(b if r and n else 0):
        if _lib.hgc_basis(pt.data_ptr() + j * step, fillt.data_ptr() + j * step, n, r, float(rel_tol),
                          out.data_ptr() + j * step) < 0:
            return basis_rows_batched(REFERENCE_OPS, rel_tol, pt, fillt)  # more than MAX_RANK rows
    return out


def agree(world_size, payload):
    """Fused ``_agree_kernel`` (step 8 of the alternating variant): ``(keep float32 0-d, ok bool
    0-d)``, the reference's values, but ``ok`` from a double sum (the same verdict except where
    the finite values' float32 sum would round across float32's largest value)."""
    if (torch.compiler.is_compiling() or not payload.is_cpu or payload.dtype != torch.float32
            or payload.dim() != 1 or payload.shape[0] < CONTROL):
        return _agree_kernel(REFERENCE_OPS, world_size, payload)
    payload = payload.contiguous()
    keep = torch.empty((), dtype=torch.float32)
    ok = torch.empty((), dtype=torch.bool)
    tol = agree_tolerance(world_size)
    _lib.hgc_powersgd_agree(payload.data_ptr(), payload.shape[0], 1.0 - tol, keep.data_ptr(), ok.data_ptr())
    return keep, ok


register(basis_rows, "cpu", lambda plan: True, basis, "cpu_powersgd.basis")
register(basis_rows_batched, "cpu", lambda plan: True, basis_batched, "cpu_powersgd.basis_batched")
register(_agree_kernel, "cpu", lambda plan: True, agree, "cpu_powersgd.agree")
