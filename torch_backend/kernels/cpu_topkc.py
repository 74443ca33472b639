"""Fused CPU form of TopKC's ``_correct_kernel`` (:mod:`hvd_gradcomp.topkc`, steps 1 and 5).

One compiled C loop (``csrc/topkc.c``, built by :mod:`torch_backend.kernels.cbuild`) forms
``c = g + beta e`` and the guess ``beta c + g`` chunk by chunk, zero-padded, and scores each
chunk while it is in cache: one pass that reads ``g`` and ``e`` and writes ``c`` and the guess,
where the reference makes two sums, two padded copies and a norm pass.

Outputs as the reference's ``(chunks float32 [m, chunk], guess float32 [m, chunk], scores
float32 [m])``, the same structure: ``chunks`` is a view of the gradient where the reference's
is (no error feedback, no padding), ``guess`` is ``chunks`` itself when ``blocking``. ``chunks``
and ``guess`` equal the reference's bit for bit (the same float32 operations); the scores are
within float32 rounding (their sums of squares run in another order), so a selection can differ
from the reference's only between chunks whose scores tie within rounding.

Every plan is accepted; tensors that are not float32 on the CPU run the reference. Raises
``ImportError`` on import when the library cannot be built.
"""
import ctypes

import torch

from hvd_gradcomp.topkc import _correct_kernel
from torch_backend import kernels
from torch_backend.kernels import cbuild

__all__ = ["accepts", "correct"]

_lib = cbuild.load("topkc")
_P, _I = ctypes.c_void_p, ctypes.c_int64
_lib.hgc_topkc_correct.argtypes = [_P, _P, _I, _I, _I, _I, _I, ctypes.c_float, _I, _P, _P, _P]
_lib.hgc_topkc_correct.restype = None


def accepts(plan) -> bool:
    """Every ``(chunk, error_feedback, blocking, beta)`` plan."""
    return True


def correct(plan, flat, residual):
    """Fused ``_correct_kernel``: ``(chunks, guess, scores)`` (module docstring)."""
    chunk, error_feedback, blocking, decay = plan
    if (torch.compiler.is_compiling() or flat.device.type != "cpu" or flat.dtype != torch.float32
            or (error_feedback and (residual.device.type != "cpu" or residual.dtype != torch.float32))):
        from torch_backend.ops import REFERENCE_OPS
        return _correct_kernel(REFERENCE_OPS, plan, flat, residual)
    d = flat.shape[0]
    m = -(-d // chunk)
    flat = flat.contiguous()
    residual = residual.contiguous() if error_feedback else None
    view = not error_feedback and m * chunk == d  # the reference's c is the gradient itself
    chunks = flat.view(m, chunk) if view else torch.empty((m, chunk), dtype=torch.float32)
    guess = chunks if blocking else torch.empty((m, chunk), dtype=torch.float32)
    scores = torch.empty(m, dtype=torch.float32)
    _lib.hgc_topkc_correct(flat.data_ptr() if d else None,
                           residual.data_ptr() if residual is not None and d else None, d, m, chunk,
                           int(bool(error_feedback)), int(decay != 1.0), float(decay), int(bool(blocking)),
                           None if view else (chunks.data_ptr() if m else None),
                           guess.data_ptr() if (not blocking and m) else None,
                           scores.data_ptr() if m else None)
    return chunks, guess, scores


kernels.register(_correct_kernel, "cpu", accepts, correct, "cpu_topkc.correct")
