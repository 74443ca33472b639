"""Fused CPU forms of signSGD's kernels (:mod:`hvd_gradcomp.signsgd_kernels`): encode, receive
and decode.

Each is one compiled C loop (``csrc/signsgd.c``, built by :mod:`torch_backend.kernels.cbuild`)
over the kernel's per-coordinate work, where the reference runs one PyTorch operation per step
of the math (about 14 passes over the gradient and 120 operations a call): encode reads ``g``
and the kept ``p'`` once, forms the residual ``e`` of ``p'`` and its block's ``S'`` and ``p =
g + e``, and writes ``p``, its block sums and the sign words in the same pass (tiles of 16,384
words, each lane's coordinates contiguous), then the scales' codes and control words; decode
writes each coordinate once from its word (into the engine's bucket, with its ``1 / n`` folded
in, when it offers one: :func:`hvd_gradcomp.composite.decompress_into`). The encode's ``p`` of
2**20 to 2**23 coordinates goes out by non-temporal stores, whole cache lines not read first
(``csrc/signsgd.c``'s ``NT_MIN`` and ``NT_MAX``). The agreed scales' ``exp2`` stays PyTorch's
(as in :mod:`~torch_backend.kernels.cpu_thc`), so every rank computes the same scales whichever
form it runs.

Plans: every signSGD plan (any block, world size, op, with or without error feedback), on CPU
float32/int32 tensors; anything else (another device, dtype, or ``torch.compile`` tracing) runs
the reference.

What equals the reference (tests/core/test_signsgd.py checks each):

- ``_encode_kernel``: ``corrected`` (``p = g + e``, zero-padded), the sign words and the control
  words bit for bit. The block sums ``sum |p|`` add up in another order than PyTorch's (16
  partial sums, coordinate ``k`` into partial ``k % 16``, ``csrc/signsgd.c``), and the log code
  uses C's ``log2f``: a scale's code may differ by one from the reference's where ``4 log2 s`` lies
  within float32 rounding of a half-integer, and the finite flag where the sum of the sums lies
  within rounding of float32's largest value. (The code is this rank's proposal: the ranks agree on
  the mean of the codes they sent, so a job whose ranks mix this form and the reference still agrees
  on every scale.)
- ``_receive_kernel``: integer sums, the reference's float32 mean, then PyTorch's ``exp2``: bit
  for bit.
- ``_decode_kernel``: the same float32 operations in the same order (compiled without
  contraction): bit for bit.

Same result on every rank and CPU: the C source fixes every float operation's order and is
compiled without ``-ffast-math`` or contraction.

Raises ``ImportError`` on import when the library cannot be built (:mod:`~torch_backend.kernels.cbuild`).
"""
import ctypes

import torch

from hvd_gradcomp.signsgd_kernels import CONTROL, _Plan, _decode_kernel, _encode_kernel, _receive_kernel
from torch_backend.kernels.forms import register, writable
from torch_backend.kernels import cbuild
from torch_backend.reference_ops import REFERENCE_OPS

__all__ = ["accepts", "encode", "receive", "decode"]

_lib = cbuild.load("signsgd")
_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_lib.hgc_signsgd_encode.argtypes = [_P, _I, _P, _P, _I, _I, _P, _F, _F, _P, _P, _I, _I, _I, _I, _I]
_lib.hgc_signsgd_encode.restype = ctypes.c_int32
_lib.hgc_signsgd_receive.argtypes = [_P, _I, _I, _I, _I, _I, _I, _I, _P, _P, _P]
_lib.hgc_signsgd_receive.restype = None
_lib.hgc_signsgd_decode.argtypes = [_P, _I, _I, _I, _P, _I, _I, _I, _I, _I, _P, _P, _P, _F, ctypes.c_int, _F, _P]
_lib.hgc_signsgd_decode.restype = None


def accepts(plan) -> bool:
    """True for every signSGD plan (its lanes fit an int32 word by construction)."""
    return isinstance(plan, _Plan) and plan.block >= 1



def _cpu(*tensors) -> bool:
    """Every tensor on the CPU and no ``torch.compile`` tracing (else the reference runs)."""
    return not torch.compiler.is_compiling() and all(t.is_cpu for t in tensors)


def _summed_code(plan) -> int:
    """1 (Sum), 0 (Average) or -1 (unknown: the count word's verdict), as the C loops take it."""
    return -1 if plan.op is None else int(plan.op == "sum")


def _words(plan, padded: int):
    """(sign words W, statistics words Ws) of a tensor of ``padded`` coordinates."""
    nb = padded // plan.block
    return -(-padded // plan.signs.lanes), -(-2 * nb // plan.stats.lanes)


def encode(plan, x, kept, scale, finite):
    """Fused ``_encode_kernel`` (steps 1-3, from the kept ``p'`` and ``S'``): ``(payload int32,
    corrected float32 [P])`` as the reference's (module docstring: bit for bit but for a code or
    the finite flag at a rounding boundary of the block sums); ``finite`` None: the sum alone
    decides."""
    ef = plan.error_feedback
    if not (_cpu(x) and x.dtype == torch.float32
            and (not ef or (_cpu(kept, scale) and kept.dtype == torch.float32 and scale.dtype == torch.float32))
            and (finite is None or (finite.is_cpu and finite.dtype == torch.bool))):
        return _encode_kernel(REFERENCE_OPS, plan, x, kept, scale, finite)
    d, B = x.shape[0], plan.block
    nb = -(-d // B)
    padded = nb * B
    words, stats = _words(plan, padded)
    x = x.contiguous()
    kept, scale = (kept.contiguous(), scale.contiguous()) if ef else (None, None)
    finite = finite.contiguous() if finite is not None else None
    corrected = torch.empty(padded, dtype=torch.float32)
    payload = torch.empty(words + stats + CONTROL, dtype=torch.int32)
    last = d - (nb - 1) * B
    status = _lib.hgc_signsgd_encode(x.data_ptr(), d, None if kept is None else kept.data_ptr(),
                                     None if scale is None else scale.data_ptr(), padded, B,
                                     None if finite is None else finite.data_ptr(), 1.0 / B, 1.0 / last,
                                     corrected.data_ptr(), payload.data_ptr(), plan.signs.lanes, plan.signs.width,
                                     plan.signs.guard, plan.stats.lanes, plan.stats.width)
    if status < 0:  # no memory for the block sums: the composition, this call
        return _encode_kernel(REFERENCE_OPS, plan, x, x if kept is None else kept, x if scale is None else scale,
                              finite)
    return payload, corrected


def receive(plan, payload, corrected):
    """Fused ``_receive_kernel``: ``(count, bad)`` int64 0-d, the agreed scales float32 [nb]
    (PyTorch's ``exp2`` of the C loop's float32 means: the reference's bit for bit) and
    ``inferred`` bool 0-d."""
    if not (_cpu(payload) and payload.dtype == torch.int32):
        return _receive_kernel(REFERENCE_OPS, plan, payload, corrected)
    padded = corrected.shape[0]
    nb = padded // plan.block
    words, _ = _words(plan, padded)
    payload = payload.contiguous()
    counts = torch.empty(2, dtype=torch.int64)
    inferred = torch.empty((), dtype=torch.bool)
    e = torch.empty(nb, dtype=torch.float32)
    _lib.hgc_signsgd_receive(payload.data_ptr(), words, nb, plan.world_size, plan.signs.guard, plan.stats.lanes,
                             plan.stats.width, _summed_code(plan), counts.data_ptr(), inferred.data_ptr(),
                             e.data_ptr())
    count, bad = counts.unbind()
    return count, bad, torch.exp2(e), inferred


def decode(plan, payload, count, bad, scale, inferred, into=None):
    """Fused ``_decode_kernel`` (steps 4-5, times ``plan.factor``): the reference's values bit for
    bit, written into ``into`` (its [d] coordinates, returned) when it is a contiguous float32 CPU
    tensor of at most P values, else a new float32 [P]."""
    if not (_cpu(payload, count, bad, scale, inferred) and payload.dtype == torch.int32
            and count.dtype == torch.int64 and bad.dtype == torch.int64 and scale.dtype == torch.float32
            and inferred.dtype == torch.bool):
        return _decode_kernel(REFERENCE_OPS, plan, payload, count, bad, scale, inferred, into)
    padded = scale.shape[0] * plan.block
    payload, scale = payload.contiguous(), scale.contiguous()
    count, bad, inferred = count.contiguous(), bad.contiguous(), inferred.contiguous()
    out = into if writable(into, padded, payload.device) else torch.empty(padded, dtype=torch.float32)
    lay = plan.signs
    _lib.hgc_signsgd_decode(payload.data_ptr(), padded, out.shape[0], plan.block, scale.data_ptr(), lay.lanes,
                            lay.width, lay.guard, plan.world_size, _summed_code(plan), count.data_ptr(),
                            bad.data_ptr(), inferred.data_ptr(), 1.0 / plan.world_size, int(plan.factor != 1.0),
                            plan.factor, out.data_ptr())
    return out


register(_encode_kernel, "cpu", accepts, encode, "cpu_signsgd.encode")
register(_receive_kernel, "cpu", accepts, receive, "cpu_signsgd.receive")
register(_decode_kernel, "cpu", accepts, decode, "cpu_signsgd.decode")
