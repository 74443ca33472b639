"""Fused CPU forms of TopKC's kernels (:mod:`hvd_gradcomp.topkc`): ``_correct_kernel`` (steps 1
and 5), ``_top_kernel`` (step 2's selection), ``_pack_kernel`` (steps 3-6 on the selected
chunks) and ``_scatter_kernel`` (the decode).

Compiled C loops (``csrc/topkc.c``, built by :mod:`torch_backend.kernels.cbuild`):

- ``correct``: forms ``c = g + beta e`` chunk by chunk, zero-padded, and scores each chunk's
  guess ``beta c + g`` while it is in cache: one pass that reads ``g`` and ``e`` and writes
  ``c``, where the reference makes two sums, two padded copies and a norm pass. Outputs as the
  reference's ``(chunks float32 [m, chunk], scores float32 [m])``: ``chunks`` is a view of the
  gradient where the reference's is (no error feedback, no padding) and equal to the
  reference's bit for bit; the scores are within float32 rounding (their sums of squares run in
  another order), so a selection can differ from the reference's only between chunks whose
  scores tie within rounding.
- ``pack``: one pass over the selected chunks (gather, pre-scale, saturating cast into the
  payload, the decoded ``sent``, the residual update in place in ``chunks``, the rescoring of
  the sent chunks), then one over the ``m`` scores (normalise, cast) and the vote, written
  into the payload directly (the reference's concatenation), with ``poison``'s ``+ 0`` on the
  way (a pass over the payload only when the step is not finite). ``payload``, ``sent`` and
  ``left`` equal the reference's bit for bit (the same float32 operations, the same
  round-to-nearest-even casts); the payload's score part is within float32 rounding before
  its cast wherever error feedback rescored the sent chunks (a norm), bit for bit otherwise.
- ``top``: the selection (the first ``k`` of the stable descending argsort of the agreed
  scores) by a radix sort of order keys, O(m): the reference's indices exactly.
- ``scatter``: the decoded output written in one pass, zeros and the received chunks times the
  scale (the reference fills zeros, then copies the scaled chunks in); bit for bit.

Plans covered (:func:`accepts`): every one; float32 tensors on the CPU with a ``float16`` or
``float32`` payload (anything else runs the reference, as under ``torch.compile``). ``pack``
and ``scatter`` raise ``IndexError`` for a chunk index outside ``[0, m)`` or repeated (the
reference raises for the former too). Raises ``ImportError`` on import when the library
cannot be built.
"""
import ctypes

import torch

from hvd_gradcomp.topkc import _correct_kernel, _pack_kernel, _scatter_kernel, _top_kernel
from torch_backend.kernels.forms import register
from torch_backend.kernels import cbuild
from torch_backend.reference_ops import REFERENCE_OPS

__all__ = ["accepts", "correct", "pack", "scatter", "top", "STREAM_MIN"]

_lib = cbuild.load("topkc")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_lib.hgc_topkc_correct.argtypes = [_P, _P, _I, _I, _I, _I, _I, _F, _I, _P, _P, _P, _I]
_lib.hgc_topkc_correct.restype = None
_lib.hgc_topkc_pack.argtypes = [_P, _I, _P, _I, _I, _P, _I, _P, _I, _I, _I, _F, _I, _F, _F, _I, _F, _P, _P, _P, _P,
                                _P]
_lib.hgc_topkc_pack.restype = _I
_lib.hgc_topkc_scatter.argtypes = [_P, _I, _P, _I, _I, _I, _P, _F, _P, _P, _P, _I]
_lib.hgc_topkc_scatter.restype = _I

_lib.hgc_topkc_top.argtypes = [_P, _I, _I, _P, _P, _P]
_lib.hgc_topkc_top.restype = None

# Outputs of at least this many float32 (32 MiB) leave ``correct`` and ``scatter`` by
# non-temporal stores (no read for ownership): at 2^24 coordinates a TopKC call took 32 against
# 41 ms; at 2^20, where the outputs stay in cache for the next step, they cost more (2.6
# against 1.8 ms), and 2^22 was even (one thread, docs/bench.md "CPU fused kernels").
STREAM_MIN = 1 << 23

_PAYLOAD = {torch.float16: 1, torch.float32: 0}


def accepts(plan) -> bool:
    """Every plan of the four kernels."""
    return True


def _cpu32(*tensors) -> bool:
    return not torch.compiler.is_compiling() and all(
        t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors)


def _ptr(t):
    return t.data_ptr() if t.numel() else None


def _reference(fn, plan, *tensors):
    return fn(REFERENCE_OPS, plan, *tensors)


def correct(plan, flat, residual):
    """Fused ``_correct_kernel``: ``(chunks, scores)`` (module docstring)."""
    chunk, error_feedback, blocking, decay = plan
    if not _cpu32(flat, *((residual,) if error_feedback else ())):
        return _reference(_correct_kernel, plan, flat, residual)
    d = flat.shape[0]
    m = -(-d // chunk)
    flat = flat.contiguous()
    residual = residual.contiguous() if error_feedback else None
    view = not error_feedback and m * chunk == d  # the reference's c is the gradient itself
    chunks = flat.view(m, chunk) if view else torch.empty((m, chunk), dtype=torch.float32)
    scratch = torch.empty(2 * chunk, dtype=torch.float32)
    scores = torch.empty(m, dtype=torch.float32)
    _lib.hgc_topkc_correct(flat.data_ptr() if d else None,
                           residual.data_ptr() if residual is not None and d else None, d, m, chunk,
                           int(bool(error_feedback)), int(decay != 1.0), float(decay), int(bool(blocking)),
                           None if view else (chunks.data_ptr() if m else None),
                           scratch.data_ptr(), _ptr(scores), int(m * chunk >= STREAM_MIN))
    return chunks, scores


def pack(plan, flat, chunks, scores, idx, *finite):
    """Fused ``_pack_kernel``: ``(payload, sent, left)`` (module docstring).

    Raises:
        IndexError: ``idx`` holds a chunk index outside ``[0, m)`` or a repeated one.
    """
    chunk, error_feedback, blocking, decay, dtype, prescale, unscale, limit = plan
    wire = {"float16": torch.float16, "float32": torch.float32}.get(dtype)
    if (wire is None or idx.dtype != torch.int64 or idx.device.type != "cpu" or not _cpu32(flat, chunks, scores)
            or any(f.device.type != "cpu" for f in finite)):
        return _reference(_pack_kernel, plan, flat, chunks, scores, idx, *finite)
    flag = finite[0].to(torch.bool).contiguous() if finite else None
    d, (m, _), k = flat.shape[0], chunks.shape, idx.shape[0]
    flat, idx, scores = flat.contiguous(), idx.contiguous(), scores.contiguous()
    chunks = chunks.contiguous()  # (the correct kernel's are; with error feedback, a new tensor)
    payload = torch.empty(k * chunk + (0 if blocking else m + 16), dtype=wire)
    sent = torch.empty((k, chunk) if error_feedback else (0,), dtype=torch.float32)
    scratch = torch.empty(2 * chunk, dtype=torch.float32)
    seen = torch.empty(m, dtype=torch.uint8)
    rc = _lib.hgc_topkc_pack(_ptr(flat), d, _ptr(chunks), m, chunk, _ptr(idx), k, _ptr(scores),
                             int(bool(error_feedback)), int(bool(blocking)), int(decay != 1.0), float(decay),
                             _PAYLOAD[wire], float(prescale), float(unscale), int(wire == torch.float16),
                             float(limit), _ptr(payload), _ptr(sent), scratch.data_ptr(), _ptr(seen),
                             None if flag is None else flag.data_ptr())
    if rc:
        raise IndexError(f"topkc: selected chunk indices must be distinct and in [0, {m}), got {idx.tolist()}")
    left = chunks.view(m * chunk) if error_feedback else torch.empty(0, dtype=torch.float32)
    return payload, sent, left


def scatter(plan, payload, idx, *split):
    """Fused ``_scatter_kernel``: float32 [d] (module docstring).

    Raises:
        IndexError: ``idx`` holds a chunk index outside ``[0, m)`` or a repeated one.
    """
    chunk, d, unscale, _ = plan
    if (torch.compiler.is_compiling() or payload.dtype not in _PAYLOAD or payload.device.type != "cpu"
            or idx.dtype != torch.int64 or idx.device.type != "cpu"
            or any(s.device.type != "cpu" for s in split)):
        return _reference(_scatter_kernel, plan, payload, idx, *split)
    k, m = idx.shape[0], -(-d // chunk)
    payload, idx = payload.contiguous(), idx.contiguous()
    # the reference's scale: unscale as a float32, or 0 after a split vote (read by the C loop)
    flag = split[0].to(torch.bool).contiguous() if split else None
    out = torch.empty(d, dtype=torch.float32)
    row_of = torch.empty(m, dtype=torch.int64)
    row_buf = torch.empty(2 * chunk, dtype=torch.float32)
    rc = _lib.hgc_topkc_scatter(_ptr(payload), _PAYLOAD[payload.dtype], _ptr(idx), k, chunk, d,
                                None if flag is None else flag.data_ptr(), float(unscale), _ptr(out),
                                _ptr(row_of), row_buf.data_ptr(), int(d >= STREAM_MIN))
    if rc:
        raise IndexError(f"topkc: received chunk indices must be distinct and in [0, {m}), got {idx.tolist()}")
    return out


def top(plan, values):
    """Fused ``_top_kernel``: int64 [k], the first ``k = plan`` of the stable descending
    argsort of ``values`` (float32 [m]), by a radix sort of order keys (module docstring):
    the reference's indices exactly, NaN and signed zeros included."""
    if not _cpu32(values) or values.dim() != 1 or not 0 <= plan <= values.shape[0]:
        return _reference(_top_kernel, plan, values)
    m = values.shape[0]
    values = values.contiguous()
    out = torch.empty(plan, dtype=torch.int64)
    keys = torch.empty(2 * m, dtype=torch.int32)
    idx = torch.empty(2 * m, dtype=torch.int64)
    if m:
        _lib.hgc_topkc_top(values.data_ptr(), m, plan, _ptr(out), keys.data_ptr(), idx.data_ptr())
    return out


register(_correct_kernel, "cpu", accepts, correct, "cpu_topkc.correct")
register(_pack_kernel, "cpu", accepts, pack, "cpu_topkc.pack")
register(_scatter_kernel, "cpu", accepts, scatter, "cpu_topkc.scatter")
register(_top_kernel, "cpu", accepts, top, "cpu_topkc.top")
