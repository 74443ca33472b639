"""Fused CPU forms of THC's kernels (:mod:`hvd_gradcomp.thc_kernels`): rotate, quantise, noise,
receive, decode and finish.

Each is one compiled C loop (``csrc/thc.c``, built by :mod:`torch_backend.kernels.cbuild`) over
the kernel's per-coordinate work, a pass or two over memory, where the reference runs one
PyTorch operation per step of the math (about ten passes, and two dense Walsh-Hadamard
products). The few values per block or per payload (the packed statistics of
:func:`~hvd_gradcomp.lanes.pack_scales`, the control words, the finite flag, the agreed ranges'
codes and the step counters) are small loops of the same C calls, not a dozen PyTorch
operations each: a compress and decompress of one tensor is 34 + 33 ATen operations (allocations
and views mostly) where the reference makes about 200 + 130, so a step's codec cost follows the
bytes more than the tensor count (measured in docs/bench.md). The agreed ranges' ``exp2`` stays
PyTorch's, so every rank computes the same ranges whichever form it runs.

Plans: every plan whose rotation block ``B`` is a power of two from 2 to 2**16 (THC's default
1024 included) and whose lanes fit an int32 word; other plans (``rotation="full"`` beyond
2**16 coordinates) and tensors that are not float32/int32 on the CPU run the reference.

What equals the reference, and what is within rounding of it (tests/core/test_cpu_kernels.py
checks each):

- ``_quantize_kernel``: the same arithmetic operation for operation in float32 (constants
  rounded to float32 as PyTorch rounds a Python scalar in a float32 op; no fused
  multiply-adds): given the same ``y``, the payload (levels, statistics, control words), the
  residual and the saturation count are the reference's bit for bit.
- ``_rotate_kernel``: ``x diag`` as the reference, then a radix-4 butterfly for ``H_B`` where the
  reference multiplies by 32 x 32 Sylvester factors: the same matrix, another rounding, so
  ``y`` differs from the reference's by float32 rounding (``|dy| <= 1e-5 max |y_block|`` is
  tested; typically a few ulps). The flush bound, ``held`` and ``wanted`` follow from ``y``
  with the reference's operations, except that block norms sum their squares in 16 partial
  sums (PyTorch sums in its own order): ``wanted`` within float32 rounding. Downstream, a
  level differs from the reference's only where ``u`` lies within rounding of a level boundary
  (at most ``5e-4`` of the levels in the tests; about ``1e-6`` in practice), and a
  statistic's log code where ``4 log2(wanted)`` lies within rounding of a half-integer.
- ``_noise_kernel``: the counter-based hash of step 3's random bits in one integer loop (the
  reference: about 50 small operations): bit for bit.
- ``_decode_kernel``: the exact sums, lanes and per-block scaling are the reference's bit for
  bit; the inverse transform is the butterfly: the output within float32 rounding.
- ``_receive_kernel`` and ``_finish_kernel``: integer arithmetic and the reference's float32
  mean, then PyTorch's ``exp2``: bit for bit.
- ``_rotate_kernel``'s statistics: C's ``log2f`` where the reference has PyTorch's ``log2``, so a
  code may differ where ``4 log2(wanted)`` lies within rounding of a half-integer (above).

Same result on every rank: the C source fixes the order of every float operation and is
compiled without ``-ffast-math`` or contraction, so the results do not depend on the vector
width or CPU kind (only on IEEE float32 arithmetic; a process that sets flush-to-zero for
denormals changes them, as it changes PyTorch's). A job whose ranks mix this fused form and the
reference (some with ``HVD_GRADCOMP_KERNELS=0`` or without a compiler, others not) quantises
with grids that are the same but levels that may differ at rounding boundaries: still a valid
encoding on each rank, as each rank's levels are its own; the sums stay exact.

Raises ``ImportError`` on import when the library cannot be built (:mod:`~torch_backend.kernels.cbuild`).
"""
import ctypes
import math

import torch

from hvd_gradcomp.thc_kernels import (_CONTROL, _TINY_RANGE, _decode_kernel, _encode_kernel, _finish_kernel, _grid,
                                      _noise_kernel, _quantize_kernel, _receive_kernel, _rotate_kernel, _top_level)
from torch_backend.kernels.forms import register, writable
from torch_backend.kernels import cbuild
from torch_backend.reference_ops import REFERENCE_OPS

__all__ = ["accepts", "rotate", "quantize", "encode", "decode", "noise", "receive", "finish", "MAX_BLOCK"]

MAX_BLOCK = 1 << 16

_lib = cbuild.load("thc")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_lib.hgc_thc_rotate.argtypes = [_P, _I, _P, _I, _I, _P, _P, _P, _P, _F, _F]
_lib.hgc_thc_rotate.restype = None
_lib.hgc_thc_quantize.argtypes = [_P, _P, _P, _I, _I, _P, _P, _P, _P, _I, _I, _I, _I] + [_F] * 7
_lib.hgc_thc_quantize.restype = _I
_lib.hgc_thc_decode.argtypes = [_P, _P, _I, _I, _I, _P, _I, _I, _I, _I, _I, _I, _P, _P, _P, _P, _F, _F, _F,
                                ctypes.c_int, _F, _P, _P]
_lib.hgc_thc_decode.restype = ctypes.c_int32
_lib.hgc_thc_noise.argtypes = [_P, _I, _I, _P, _P]
_lib.hgc_thc_noise.restype = None
_lib.hgc_thc_scales.argtypes = [_P, _I, _P, _I, _I, _I, _P]
_lib.hgc_thc_scales.restype = ctypes.c_int32
_lib.hgc_thc_tail.argtypes = [_P, _P, _I, _P, _P, _I]
_lib.hgc_thc_tail.restype = None
_lib.hgc_thc_receive.argtypes = [_P, _I, _I, _I, _P, _P]
_lib.hgc_thc_receive.restype = None
_lib.hgc_thc_finish.argtypes = [_P] + [_I] * 6 + [_P] * 10
_lib.hgc_thc_finish.restype = None
_lib.hgc_thc_encode.argtypes = [_P, _I, _P, _I, _I, _P, _P, _P, _F, _F, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P,
                                _I, _I, _I, _I] + [_F] * 7 + [_P]
_lib.hgc_thc_encode.restype = _I


def accepts(plan) -> bool:
    """True for THC plans whose block is a power of two in [2, :data:`MAX_BLOCK`] and whose
    lanes fit an int32 word."""
    b, lay = plan.block, plan.levels
    return (2 <= b <= MAX_BLOCK and b & (b - 1) == 0 and 1 <= lay.width <= 32
            and lay.guard + lay.lanes * lay.width <= 32)


def _ok(*tensors) -> bool:
    """The tensors the loops read are CPU float32/int32/int64/bool (else the reference runs)."""
    if torch.compiler.is_compiling():
        return False
    for t in tensors:
        if not t.is_cpu:
            return False
    return True


# The float32 [0] outputs (no error feedback, no flush bound) of encode: one shared tensor, never
# written (an empty tensor has no elements to write), instead of an allocation a call.
_NOTHING = torch.empty(0, dtype=torch.float32)


def _flag_ok(finite) -> bool:
    """The optional finite flag is absent (None) or a CPU bool tensor (else the reference runs)."""
    return finite is None or (finite.is_cpu and finite.dtype == torch.bool)


def _ptr(t):
    return t.data_ptr() if t.numel() else None



def _summed_code(plan) -> int:
    """1 (Sum), 0 (Average) or -1 (unknown: the count word's verdict), as the C loops take it."""
    return -1 if plan.op is None else int(plan.op == "sum")


def rotate(plan, x, residual, diag, hmat, finite):
    """Fused ``_rotate_kernel`` (steps 1-2): the reference's outputs ``(y, held, wanted,
    stats_words, finite)``, with ``y`` and ``wanted`` within float32 rounding (module
    docstring); ``finite`` None: the block ranges alone decide."""
    if not (_ok(x, residual, diag) and x.dtype == torch.float32 and diag.dtype == torch.float32
            and residual.dtype == torch.float32 and _flag_ok(finite)):
        return _rotate_kernel(REFERENCE_OPS, plan, x, residual, diag, hmat, finite)
    padded, block = diag.shape[0], plan.block
    x, diag = x.contiguous(), diag.contiguous()
    flush = plan.error_feedback and plan.flush is not None
    y = torch.empty(padded, dtype=torch.float32)
    held = torch.empty(padded if flush else 0, dtype=torch.float32)
    wanted = torch.empty(padded // block, dtype=torch.float32)
    residual = residual.contiguous() if plan.error_feedback else None
    own = plan.threshold / math.sqrt(block) if plan.threshold else 0.0
    _lib.hgc_thc_rotate(_ptr(x), x.shape[0], _ptr(diag), padded, block,
                        None if residual is None else _ptr(residual), _ptr(y),
                        _ptr(held) if flush else None, _ptr(wanted), own,
                        float(plan.flush) if flush else 1.0)
    nb, lay = padded // block, plan.stats
    stats = torch.empty(0 if lay is None else -(-2 * nb // lay.lanes), dtype=torch.int32)
    ok = _lib.hgc_thc_scales(_ptr(wanted), nb, None if finite is None else finite.contiguous().data_ptr(), *(
        (lay.lanes, lay.width, lay.guard, _ptr(stats)) if lay is not None else (1, 1, 0, None)))
    # without statistics (range="current") the loop only checks that wanted is finite
    return y, held, wanted, stats, torch.tensor(bool(ok))


def quantize(plan, y, held, ranges, rows, cols, fingerprint, finite, stats_words):
    """Fused ``_quantize_kernel`` (steps 3-5): ``(payload int32, residual float32 [P] or [0],
    saturated int64 0-d)``, the reference's bit for bit given the same ``y`` (module
    docstring)."""
    if not (_ok(y, held, ranges, rows, cols, fingerprint, finite, stats_words) and y.dtype == torch.float32
            and ranges.dtype == torch.float32 and rows.dtype == torch.int32 and cols.dtype == torch.int32
            and fingerprint.dtype == torch.int64 and finite.dtype == torch.bool and stats_words.dtype == torch.int32):
        return _quantize_kernel(REFERENCE_OPS, plan, y, held, ranges, rows, cols, fingerprint, finite, stats_words)
    lay, block = plan.levels, plan.block
    padded = y.shape[0]
    words = -(-padded // lay.lanes)
    nstats = stats_words.shape[0]
    y, ranges, rows, cols = y.contiguous(), ranges.contiguous(), rows.contiguous(), cols.contiguous()
    flush = plan.error_feedback and plan.flush is not None
    held = held.contiguous() if flush else None
    payload = torch.empty(words + nstats + _CONTROL, dtype=torch.int32)
    residual = torch.empty(padded if plan.error_feedback else 0, dtype=torch.float32)
    top_level = _top_level(lay.top)
    margin = top_level * 2.0 ** -21
    saturated = _lib.hgc_thc_quantize(
        _ptr(y), None if held is None else _ptr(held), _ptr(ranges), padded, block, _ptr(rows), _ptr(cols),
        _ptr(residual) if plan.error_feedback else None, _ptr(payload), lay.lanes, lay.width, lay.guard,
        lay.offset, _grid(lay.top), _TINY_RANGE, 0.5 * top_level - 1.0, -1.0, top_level - 1.0,
        -1.0 - margin, top_level - 1.0 + margin)
    stats_words, fingerprint, finite = stats_words.contiguous(), fingerprint.contiguous(), finite.contiguous()
    _lib.hgc_thc_tail(payload.data_ptr() + 4 * words, _ptr(stats_words), nstats, fingerprint.data_ptr(),
                      finite.data_ptr(), lay.guard)
    return payload, residual, torch.tensor(saturated, dtype=torch.int64)


def encode(plan, x, residual, diag, hmat, ranges, key, fingerprint, finite):
    """Fused ``_encode_kernel`` (steps 1-5 with agreed ranges): :func:`rotate`,
    :func:`noise` and :func:`quantize`'s loops in one C call (``hgc_thc_encode``), so
    ``(payload, residual, y, held, saturated)`` as those three give them (module docstring):
    ``y`` within float32 rounding of the reference's (and, as there, [0] without error
    feedback), the rest the reference's given that ``y``. ``finite`` None: the block ranges
    alone decide (``_rotate_kernel``)."""
    if not (_ok(x, residual, diag, ranges, key, fingerprint) and x.dtype == torch.float32
            and residual.dtype == torch.float32 and diag.dtype == torch.float32 and ranges.dtype == torch.float32
            and key.dtype == torch.int64 and fingerprint.dtype == torch.int64 and _flag_ok(finite)):
        return _encode_kernel(REFERENCE_OPS, plan, x, residual, diag, hmat, ranges, key, fingerprint, finite)
    padded, block, lay, slay = diag.shape[0], plan.block, plan.levels, plan.stats
    x, diag, ranges = x.contiguous(), diag.contiguous(), ranges.contiguous()
    key, fingerprint = key.contiguous(), fingerprint.contiguous()
    flush = plan.error_feedback and plan.flush is not None
    words = -(-padded // lay.lanes)
    nstats = 0 if slay is None else -(-2 * (padded // block) // slay.lanes)
    ef = plan.error_feedback
    # without error feedback y stays in the C call's scratch; [0] outputs share one tensor
    y = torch.empty(padded, dtype=torch.float32) if ef else _NOTHING
    held = torch.empty(padded, dtype=torch.float32) if flush else _NOTHING
    residual_in = residual.contiguous() if ef else None
    residual = torch.empty(padded, dtype=torch.float32) if ef else _NOTHING
    payload = torch.empty(words + nstats + _CONTROL, dtype=torch.int32)
    top_level = _top_level(lay.top)
    margin = top_level * 2.0 ** -21
    saturated = torch.empty((), dtype=torch.int64)
    if finite is not None:
        finite = finite.contiguous()
    status = _lib.hgc_thc_encode(
        _ptr(x), x.shape[0], _ptr(diag), padded, block, None if residual_in is None else _ptr(residual_in),
        _ptr(y) if ef else None, _ptr(held) if flush else None, plan.threshold / math.sqrt(block) if plan.threshold else 0.0,
        float(plan.flush) if flush else 1.0, None if finite is None else finite.data_ptr(),
        *((slay.lanes, slay.width, slay.guard) if slay is not None else (1, 1, 0)), nstats, key.data_ptr(),
        fingerprint.data_ptr(), _ptr(ranges), _ptr(residual) if ef else None, _ptr(payload),
        lay.lanes, lay.width, lay.guard, lay.offset, _grid(lay.top), _TINY_RANGE, 0.5 * top_level - 1.0, -1.0,
        top_level - 1.0, -1.0 - margin, top_level - 1.0 + margin, saturated.data_ptr())
    if status < 0:  # no memory for the C call's scratch: the composition, this call
        return _encode_kernel(REFERENCE_OPS, plan, x, residual_in if ef else residual, diag, hmat, ranges, key,
                              fingerprint, finite)
    return payload, residual, y, held, saturated


def decode(plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own=None, into=None):
    """Fused ``_decode_kernel`` (steps 6-7, times ``plan.factor``): float32 [P] within float32
    rounding of the reference's (module docstring); ``own``: this rank's level words
    (``subtract_own``). Written into ``into`` (its [d] coordinates, returned) when it is a
    contiguous float32 CPU tensor of at most P values."""
    lay = plan.levels
    if not (_ok(payload, ranges, diag, count, bad, mismatch, inferred) and payload.dtype == torch.int32
            and ranges.dtype == torch.float32 and diag.dtype == torch.float32 and count.dtype == torch.int64
            and bad.dtype == torch.int64 and mismatch.dtype == torch.bool and inferred.dtype == torch.bool
            and (own is None) == (not lay.others)
            and (own is None or (_ok(own) and own.dtype == torch.int32
                                 and own.numel() == -(-diag.shape[0] // lay.lanes)))):
        return _decode_kernel(REFERENCE_OPS, plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own,
                              into)
    block = plan.block
    padded = diag.shape[0]
    payload, ranges, diag = payload.contiguous(), ranges.contiguous(), diag.contiguous()
    own = own.contiguous() if own is not None else None
    count, bad = count.contiguous(), bad.contiguous()
    mismatch, inferred = mismatch.contiguous(), inferred.contiguous()
    out = into if writable(into, padded, payload.device) else torch.empty(padded, dtype=torch.float32)
    summed = _summed_code(plan)
    status = _lib.hgc_thc_decode(_ptr(payload), _ptr(ranges), padded, out.shape[0], block, _ptr(diag), lay.lanes,
                                 lay.width, lay.guard, lay.offset, plan.world_size, summed, count.data_ptr(),
                                 bad.data_ptr(), mismatch.data_ptr(), inferred.data_ptr(), _grid(lay.top),
                                 0.5 * _top_level(lay.top), 1.0 / plan.world_size, int(plan.factor != 1.0),
                                 plan.factor, _ptr(own) if own is not None else None, _ptr(out))
    if status < 0:  # no memory for the block that crosses d: the composition, this call
        return _decode_kernel(REFERENCE_OPS, plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own,
                              into)
    return out


def noise(plan, key, ranges):
    """Fused ``_noise_kernel`` (step 3's random bits): ``(rows int32 [nb], cols int32 [B])``,
    the reference's bit for bit (integer hashing, one loop)."""
    if not _ok(key, ranges) or key.dtype != torch.int64:
        return _noise_kernel(REFERENCE_OPS, plan, key, ranges)
    blocks, block = ranges.shape[0], plan.block
    key = key.contiguous()
    rows = torch.empty(blocks, dtype=torch.int32)
    cols = torch.empty(block, dtype=torch.int32)
    _lib.hgc_thc_noise(key.data_ptr(), blocks, block, _ptr(rows), _ptr(cols))
    return rows, cols


def receive(plan, payload):
    """Fused ``_receive_kernel`` (step 6's control words): ``(count, bad)`` int64 0-d and
    ``(mismatch, inferred)`` bool 0-d, views of two small tensors; the reference's values
    exactly (integer arithmetic)."""
    if not (_ok(payload) and payload.dtype == torch.int32):
        return _receive_kernel(REFERENCE_OPS, plan, payload)
    tail = payload[payload.shape[0] - _CONTROL:].contiguous()
    counts = torch.empty(2, dtype=torch.int64)
    flags = torch.empty(2, dtype=torch.bool)
    _lib.hgc_thc_receive(tail.data_ptr(), plan.world_size, plan.levels.guard, _summed_code(plan),
                         counts.data_ptr(), flags.data_ptr())
    return (*counts.unbind(), *flags.unbind())


def finish(plan, payload, ranges, step, realigned, saturated, new_saturated, bad, mismatch, inferred):
    """Fused ``_finish_kernel`` (step 8's small fields): one loop for the agreed ranges' log2
    and the counters, then ``exp2`` and the choice by ``ok`` as the reference's PyTorch
    operations, so the ranges are the reference's bit for bit (integer sums, the same float32
    mean, the same ``exp2``): every rank agrees on them whichever form it runs."""
    small = (step, realigned, saturated, new_saturated, bad)
    if not (plan.stats is not None and _ok(payload, ranges, *small, mismatch, inferred)
            and payload.dtype == torch.int32 and ranges.dtype == torch.float32
            and all(t.dtype == torch.int64 for t in small)
            and mismatch.dtype == torch.bool and inferred.dtype == torch.bool):
        return _finish_kernel(REFERENCE_OPS, plan, payload, ranges, step, realigned, saturated, new_saturated, bad,
                              mismatch, inferred)
    nb, lay = ranges.shape[0], plan.stats
    stop = payload.shape[0] - _CONTROL
    words = payload[stop - (-(-2 * nb // lay.lanes)):stop].contiguous()
    small = [t.contiguous() for t in small]
    mismatch, inferred = mismatch.contiguous(), inferred.contiguous()
    e = torch.empty(nb, dtype=torch.float32)
    fields = torch.empty(3, dtype=torch.int64)
    ok = torch.empty((), dtype=torch.bool)
    _lib.hgc_thc_finish(_ptr(words), nb, lay.lanes, lay.width, lay.guard, plan.world_size, _summed_code(plan),
                        inferred.data_ptr(), _ptr(e), *(t.data_ptr() for t in small), mismatch.data_ptr(),
                        fields.data_ptr(), ok.data_ptr())
    return (torch.where(ok, torch.exp2(e), ranges), *fields.unbind(), ok)


register(_rotate_kernel, "cpu", accepts, rotate, "cpu_thc.rotate")
register(_quantize_kernel, "cpu", accepts, quantize, "cpu_thc.quantize")
register(_encode_kernel, "cpu", accepts, encode, "cpu_thc.encode")
register(_decode_kernel, "cpu", accepts, decode, "cpu_thc.decode")
register(_noise_kernel, "cpu", accepts, noise, "cpu_thc.noise")
register(_receive_kernel, "cpu", accepts, receive, "cpu_thc.receive")
register(_finish_kernel, "cpu", accepts, finish, "cpu_thc.finish")
