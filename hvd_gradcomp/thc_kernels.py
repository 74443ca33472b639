"""THC's per-step kernels (:mod:`hvd_gradcomp.thc`, whose module docstring gives the steps they
implement): rotation, quantisation with stochastic rounding, packing into integer lanes
(:mod:`hvd_gradcomp.lanes`), decoding and the state update, each a pure function of a
:class:`_Plan` (the tensor's static layout) and tensors, so that they can be traced or compiled
as units (``HVD_GRADCOMP_COMPILE``).
"""
import math
from typing import NamedTuple

from . import hadamard, rng
from .lanes import (TINY_SCALE, LaneLayout, agreed_scales, as_reduced, control_words, exact_words, pack as _pack,
                    others_words, pack_scales, read_control, says_sum, unpack as _unpack)

__all__ = []  # private to hvd_gradcomp.thc

# Floor of the range in the grid step: keeps L / (2 R) finite for an all-zero block.
_TINY_RANGE = 1e-30
# The per-block ranges travel as log codes of lanes.pack_scales (step 2): 10 bits cover
# all of float32's normal range (an 8-bit code stopped at 2**23.75, which gradients under loss
# scaling pass).
# Control words (step 5): contributing, not finite, fingerprint s, s**2.
_CONTROL = 4
# float32 1.0: its sign and exponent bits above 23 random mantissa bits read as 1 + U (step 3).
_ONE_BITS = 0x3F800000


class _Plan(NamedTuple):
    """What the kernels need beyond tensors: Python scalars shared by every tensor of a scheme
    instance at one world size and op (sizes come from the tensors' shapes), so a compiling
    backend builds one kernel for all of them (``Primitives.fuse``). The one size in it is the
    rotation block ``B``: 1024 for every tensor of at least 1024 coordinates with the default
    partial rotation, but ``next_pow2(d)`` with ``rotation="full"``, which therefore compiles
    once per distinct padded size."""

    block: int  # B
    levels: LaneLayout  # with L = levels.top
    stats: object  # LaneLayout of the statistics, None with range="current"
    threshold: float  # T (0.0 without saturation: ranges from the block peaks)
    flush: object  # bound of step 1 (a float), or None
    error_feedback: bool
    world_size: int  # n
    op: object  # "sum", "average" or None (unknown: inferred from the count word)
    factor: float = 1.0  # the decode's output times this, rounded after it (Codec.decode's 1 / divide)


# ---- kernels: tensors in, tensors out, no collective (see Primitives.fuse) ----
def _pad(ops, v, padded: int, dtype: str, like):
    n = ops.shape(v)[0]
    return ops.concat([v, ops.zeros((padded - n,), dtype, like)], 0) if padded > n else v


def _grid(top: int) -> float:
    """Grid step over range, ``delta / R = 2 (1 + 2**-20) / L`` (step 3; ``L = top``)."""
    return 2.0 * (1.0 + 2.0 ** -20) / top


def _top_level(top: int) -> float:
    """Grid position of ``+R``, ``2 R / delta = L / (1 + 2**-20)`` (step 3)."""
    return top / (1.0 + 2.0 ** -20)


def _summed(plan: _Plan, inferred):
    """True if Horovod applied Sum: from the op when known (a Python bool), else inferred from
    the count word (a bool 0-d tensor, :func:`_receive_kernel`)."""
    return plan.op == "sum" if plan.op is not None else inferred


def _receive_kernel(ops, plan: _Plan, payload):
    """Step 6 for the control words: (count int64, bad int64, mismatch bool, inferred bool), 0-d.

    ``inferred``: the count word says Sum (full participation assumed: it is ``n << g`` under
    Sum, ``1 << g`` under Average); used only when the op is unknown (:func:`_summed`)."""
    n, g = plan.world_size, plan.levels.guard
    tail = ops.cast(payload[ops.shape(payload)[0] - _CONTROL:], "int64")
    inferred = says_sum(tail[0], g)
    control = read_control(ops, tail, _summed(plan, inferred), n, g)
    count, bad, s1, s2 = control[0], control[1], control[2], control[3]
    return count, bad, s2 * count != s1 * s1, inferred


def _own_range(ops, plan: _Plan, vb):
    """The range a rank wants for blocks ``vb`` [nb, B]: ``T`` times their RMS, or their peak."""
    if plan.threshold:
        return ops.norm(vb, 1) * (plan.threshold / math.sqrt(plan.block))
    return ops.max(ops.abs(vb), 1)


def _rotate_kernel(ops, plan: _Plan, x, residual, diag, hmat, finite):
    """Steps 1-2: y = H D pad(x) + e (float32 [P], e bounded by ``flush``), what error
    feedback holds back (float32 [P], or [0] without a bound), the wanted ranges (float32
    [nb]), the packed statistics (int32 words; empty with range="current") and ``finite``
    (bool 0-d; None: true) narrowed to a finite ``y`` with finite block statistics."""
    padded, B = ops.shape(diag)[0], plan.block
    nb = padded // B
    y = hadamard.rht(ops, _pad(ops, x, padded, "float32", x), diag, hadamard.nested_factors(B, hmat))
    held = ops.zeros((0,), "float32", x)
    if plan.error_feedback and plan.flush is not None:
        # Step 1's bound: at most flush x (the range this gradient alone wants) per coordinate
        # (none in a block without gradient); the rest is held back for later steps.
        bound = _own_range(ops, plan, ops.reshape(y, (nb, B))) * plan.flush
        bound = ops.reshape(ops.where(bound > 0.0, bound, float("inf")), (nb, 1))
        eb = ops.reshape(residual, (nb, B))
        flushed = ops.minimum(ops.maximum(eb, -bound), bound)
        held = ops.reshape(eb - flushed, (padded,))
        y = y + ops.reshape(flushed, (padded,))
    elif plan.error_feedback:
        y = y + residual
    yb = ops.reshape(y, (nb, B))
    wanted = _own_range(ops, plan, yb)
    # Non-finite y shows in its block's norm or peak: nb values checked, no pass over y (and
    # so does a non-finite x: finite None leaves the whole check to them).
    checked = ops.all(ops.isfinite(wanted), None)
    finite = checked if finite is None else ops.logical_and(finite, checked)
    if plan.stats is None:
        return y, held, wanted, ops.zeros((0,), "int32", x), finite
    usable = ops.logical_and(wanted > TINY_SCALE, finite)
    return y, held, wanted, pack_scales(ops, wanted, usable, plan.stats), finite


def _noise_bits(ops, key, blocks: int, block: int, like):
    """Step 3's random bits, from ``blocks + B`` hashed counters of ``key`` (this rank and
    step; hashed apart from the quantise kernel, so that a compiler never re-hashes them per
    coordinate): int32 ``rows`` [blocks], float32 1.0's bits with 23 random mantissa bits, and
    int32 ``cols`` [B], 23 random bits. ``bitcast(rows[b] ^ cols[j])`` is ``1 + U`` with ``U``
    uniform on the ``2**-23`` lattice in [0, 1), pairwise independent over coordinates."""
    bits = ops.cast(ops.right_shift(rng.bits32(ops, key, blocks + block, like), 9), "int32")
    return ops.bitwise_or(bits[:blocks], _ONE_BITS), bits[blocks:]


def _noise_kernel(ops, plan: _Plan, key, ranges):
    """:func:`_noise_bits` as a kernel (``Primitives.fuse``): ``(rows int32 [nb], cols int32
    [B])`` for ``key`` (int64 0-d, in [0, 2**32): this rank's round key XOR the step), ``nb``
    the length of ``ranges`` (float32 [nb]; only its shape is read), ``B = plan.block``. About
    50 small integer operations op by op; one loop where a fused form exists."""
    return _noise_bits(ops, key, ops.shape(ranges)[0], plan.block, ranges)


def _quantize_kernel(ops, plan: _Plan, y, held, ranges, rows, cols, fingerprint, finite, stats_words):
    """Steps 3-5: (payload int32, residual float32 [P] or [0], saturated int64 0-d)."""
    B, top_level = plan.block, _top_level(plan.levels.top)
    nb = ops.shape(ranges)[0]
    yb = ops.reshape(y, (nb, B))
    top = ops.reshape(ranges, (nb, 1))
    live = top > 0.0
    delta = top * _grid(plan.levels.top)
    # Grid position minus one, (y + R) / delta - 1, clipped to [-1, top_level - 1]; -1 in a
    # block without a range, whatever y (it sends level 0 and waits in error feedback).
    inv = ops.where(live, 1.0 / ops.maximum(delta, _TINY_RANGE), 0.0)
    u = yb * inv + ops.where(live, 0.5 * top_level - 1.0, -1.0)
    clipped = ops.clip(u, -1.0, top_level - 1.0)
    # |y| > R, counted in grid positions with a margin (2**-20 of R) above float32's rounding
    # of u, so that a coordinate at exactly +-R (R = the block's peak) does not count.
    margin = top_level * 2.0 ** -21
    saturated = ops.count(u < -1.0 - margin, None) + ops.count(u > top_level - 1.0 + margin, None)
    # Level floor(position + U) = floor(clipped + (1 + U)): unbiased stochastic rounding.
    noise = ops.bitcast(ops.bitwise_xor(ops.reshape(rows, (nb, 1)), ops.reshape(cols, (1, B))), "float32")
    q = ops.floor(clipped + noise)
    # y - (q delta - R); nothing kept without error feedback
    residual = (ops.reshape(yb - q * delta + top, (nb * B,)) if plan.error_feedback
                else ops.zeros((0,), "float32", y))
    if plan.error_feedback and plan.flush is not None:
        residual = residual + held
    # A non-finite y gives undefined levels here; the "not finite" word below makes every
    # rank's output NaN and keeps every state, so they are never read.
    levels = _pack(ops, ops.reshape(ops.cast(q, "int32"), (nb * B,)), plan.levels)
    s = fingerprint
    bad = ops.cast(ops.where(finite, 0.0, 1.0), "int64")
    control = control_words(ops, (s * 0 + 1, bad, s, s * s), plan.levels.guard)
    payload = ops.concat([levels, stats_words, control], 0)
    return payload, residual, saturated


def _encode_kernel(ops, plan: _Plan, x, residual, diag, hmat, ranges, key, fingerprint, finite):
    """Steps 1-5 with the ranges already agreed (``range="previous"``): :func:`_rotate_kernel`,
    :func:`_noise_kernel` and :func:`_quantize_kernel` in turn, one kernel, so that a backend
    runs a compress as one fused call (the CPU's: one C loop nest, ``cpu_thc.encode``).
    Returns ``(payload int32, residual float32 [P] or [0], y float32 [P] with error feedback
    (what a realigned step keeps) else [0], held float32 [P] or [0], saturated int64 0-d)``."""
    y, held, _, stats_words, finite = _rotate_kernel(ops, plan, x, residual, diag, hmat, finite)
    rows, cols = _noise_kernel(ops, plan, key, ranges)
    payload, residual, saturated = _quantize_kernel(ops, plan, y, held, ranges, rows, cols, fingerprint, finite,
                                                    stats_words)
    if not plan.error_feedback:
        y = ops.zeros((0,), "float32", y)
    return payload, residual, y, held, saturated


def _decode_kernel(ops, plan: _Plan, payload, ranges, diag, hmat, count, bad, mismatch, inferred, own=None,
                   into=None):
    """Steps 6-7: float32 [P], the rotated-back sum (or average) of the contributors, times
    ``plan.factor`` (its own rounding, as a separate product) unless it is 1. ``own``: with lanes
    for the other ranks only (``subtract_own``), this rank's level words as sent (int32 [m]); the
    lanes summed are then the others' (:func:`~hvd_gradcomp.lanes.others_words`) plus this
    rank's own. ``into``: None, or a float32 [d] tensor (``d <= P``) that a fused form may write
    the first ``d`` values into and return (an engine's bucket); this composition returns a new
    tensor."""
    n, B, lay = plan.world_size, plan.block, plan.levels
    nb, padded = ops.shape(ranges)[0], ops.shape(diag)[0]
    summed = _summed(plan, inferred)
    words = -(-padded // lay.lanes)
    # int64 for the words: n times a truncated average leaves int32, and so does a sum with the
    # offsets added back (up to 2**32 - 1 without guard bits); the lanes unpack in int32.
    exact = exact_words(ops, ops.cast(payload[:words], "int64"), summed, n, lay.guard)
    if lay.offset:
        exact = exact + count * lay.offset
    if lay.others:
        exact = others_words(ops, exact, own)
    if lay.width < 32:
        # The exact sums lie in [0, 2**32): their int32 two's-complement patterns unpack to the
        # same lanes (each lane's shift and mask read bits 0..31 only, and a mask below 2**31
        # drops the sign's copies), on half the bytes of int64 over the whole [P] output.
        exact = ops.cast(ops.where(exact >= 2 ** 31, exact - 2 ** 32, exact), "int32")
    lanes = _unpack(ops, exact, lay)
    if lay.others:
        lanes = lanes + _unpack(ops, own, lay)
    total = ops.reshape(ops.cast(lanes[:padded] if lay.lanes * words > padded else lanes, "float32"), (nb, B))
    # One scale and one offset per block: the decoded sum S delta - c R, times 1/n under
    # Average, times 0 after a fingerprint mismatch, plus NaN when a rank failed.
    scale = as_reduced(ops, ops.where(mismatch, 0.0, 1.0), summed, n)
    # (S - c R / delta) delta = S delta - c R, with R / delta = top_level / 2 the same for every
    # block: the offset is taken off the integer sums first, not off the scaled values (n R
    # against a small difference: float32 cancellation at large n).
    top = ops.reshape(ranges, (nb, 1))
    a = top * (_grid(plan.levels.top) * scale)
    offset = ops.cast(count, "float32") * (0.5 * _top_level(plan.levels.top)) + ops.where(bad > 0, float("nan"), 0.0)
    values = ops.reshape((total - offset) * a, (padded,))
    out = hadamard.irht(ops, values, diag, hadamard.nested_factors(B, hmat))
    return out * plan.factor if plan.factor != 1.0 else out


def _finish_kernel(ops, plan: _Plan, payload, ranges, step, realigned, saturated, new_saturated,
                   bad, mismatch, inferred):
    """Step 8 for the small fields: (ranges, step, realigned, saturated, ok) after the step,
    all unchanged when some rank's gradient was not finite (``ok`` false); the residual is
    chosen by ``finish`` from ``ok`` and ``mismatch`` (bool 0-d)."""
    ok = bad == 0
    new_ranges = ranges
    if plan.stats is not None:
        nb, lay = ops.shape(ranges)[0], plan.stats
        stop = ops.shape(payload)[0] - _CONTROL
        words = payload[stop - (-(-2 * nb // lay.lanes)):stop]
        new_ranges = agreed_scales(ops, words, _summed(plan, inferred), plan.world_size, lay, nb)
    return (ops.where(ok, new_ranges, ranges),
            ops.where(ok, ops.where(mismatch, step * 0, step + 1), step),
            ops.where(ok, realigned + ops.cast(mismatch, "int64"), realigned),
            ops.where(ok, new_saturated, saturated), ok)
