"""signSGD's per-step kernels (:mod:`hvd_gradcomp.signsgd`, whose module docstring gives the
steps they implement): encode (steps 1-3, starting from step 6's residual of the last step),
receive (step 4's control words and step 5's scales) and decode (steps 4-5), each a pure
function of a :class:`_Plan` and tensors over the primitives, called through ``ops.fuse`` so
that a backend may run a fused form instead (``torch_backend/kernels``: one C loop on the CPU,
``cpu_signsgd.py``; Triton programs on CUDA, ``triton_signsgd.py``). These compositions are the
reference: the fused forms are tested against them.
"""
from typing import NamedTuple

from .lanes import (TINY_SCALE, LaneLayout, agreed_scales, as_reduced, control_words, exact_words, pack,
                    pack_scales, read_control, says_sum, unpack)

__all__ = []  # private to hvd_gradcomp.signsgd

CONTROL = 2  # control words: contributes, not finite


class _Plan(NamedTuple):
    """What the kernels need beyond tensors (sizes come from the tensors' shapes: ``d`` from
    ``x``, ``P = nb B`` from the ``corrected`` values, ``nb`` from the scales)."""

    block: int  # B, coordinates a scale (min(block option, d))
    signs: LaneLayout  # 1-bit lanes, uncentred
    stats: LaneLayout  # lanes of the (code, has data) pairs
    error_feedback: bool
    world_size: int  # n
    op: object  # "sum", "average" or None (unknown: the count word decides)
    factor: float = 1.0  # the decode's output times this, rounded after it (Codec.decode's 1 / divide)


def summed(plan: _Plan, inferred):
    """True if Horovod applied Sum: a Python bool from the op when known, else ``inferred``
    (bool 0-d, the count word's verdict from :func:`_receive_kernel`)."""
    return plan.op == "sum" if plan.op is not None else inferred


def _encode_kernel(ops, plan: _Plan, x, kept, scale, finite):
    """Steps 1-3: ``(payload int32 [words + stats words + 2], corrected float32 [P])``.

    Args:
        x: float32 [d], the gradient.
        kept: float32 [d], the last committed step's ``p`` (unread without error feedback).
        scale: float32 [nb], that step's agreed ``S`` (unread without error feedback).
        finite: bool 0-d, or None (the scheme's own check alone: ``sum |p|`` finite).

    The error feedback ``e = (p' + S') - [p' >= 0] (S' 2)`` of the kept ``p'``, ``S'``
    (:func:`pending`), then ``p = x + e``; ``corrected`` is ``p`` zero-padded to ``P = nb B``
    (what the state keeps, step 6).
    """
    d, B = ops.shape(x)[0], plan.block
    nb = -(-d // B)
    p = x + pending(ops, plan, kept, scale) if plan.error_feedback else x
    if nb * B > d:
        p = ops.concat([p, ops.zeros((nb * B - d,), "float32", p)], 0)
    # Steps 1-2: per-block scales, and whether p is finite from their sum.
    sums = ops.sum(ops.abs(ops.reshape(p, (nb, B))), 1)
    ok = ops.isfinite(ops.sum(sums, None))
    ok = ok if finite is None else ops.logical_and(finite, ok)
    last = d - (nb - 1) * B  # coordinates of the last block
    s = sums * ops.where(ops.arange(nb, "int64", p) == nb - 1, 1.0 / last, 1.0 / B)
    stats = pack_scales(ops, s, ops.logical_and(ok, s > TINY_SCALE), plan.stats)
    # Step 3: one bit a coordinate in the lanes, then the control words.
    nonneg = ops.cast(p >= 0.0, "int32")
    flag = ops.cast(ok, "int64")
    payload = ops.concat([pack(ops, nonneg, plan.signs), stats,
                          control_words(ops, (flag * 0 + 1, 1 - flag), plan.signs.guard)], 0)
    return payload, p


def _receive_kernel(ops, plan: _Plan, payload, corrected):
    """Step 4's control words and step 5's agreed scales: ``(count int64 0-d, bad int64 0-d,
    scale float32 [nb], inferred bool 0-d)``; ``nb = P / B`` from ``corrected`` (float32 [P],
    only its shape read). ``inferred``: the count word says Sum (full participation assumed;
    used only when the op is unknown)."""
    n, g = plan.world_size, plan.signs.guard
    nb = ops.shape(corrected)[0] // plan.block
    words = -(-nb * plan.block // plan.signs.lanes)
    stats_words = -(-2 * nb // plan.stats.lanes)
    tail = ops.cast(payload[words + stats_words:], "int64")
    inferred = says_sum(tail[0], g)
    is_sum = summed(plan, inferred)
    control = read_control(ops, tail, is_sum, n, g)
    scale = agreed_scales(ops, payload[words:words + stats_words], is_sum, n, plan.stats, nb)
    return control[0], control[1], scale, inferred


def _decode_kernel(ops, plan: _Plan, payload, count, bad, scale, inferred, into=None):
    """Steps 4-5: float32 [P], ``S (2 V - c)`` per block (times ``1/n`` under Average), NaN
    everywhere when some rank was not finite (``bad > 0``), then times ``plan.factor`` (its own
    rounding, as a separate product) unless it is 1. ``scale``: float32 [nb], the agreed ``S``;
    ``count``, ``bad``: int64 0-d; ``inferred``: bool 0-d (:func:`_receive_kernel`). ``into``:
    None, or a float32 [d] tensor (``d <= P``, the gradient's coordinates) that a fused form may
    write the first ``d`` values into and return instead of a new [P] (an engine's bucket, so no
    copy follows); this composition returns a new tensor."""
    n, lay, B = plan.world_size, plan.signs, plan.block
    nb = ops.shape(scale)[0]
    padded = nb * B
    words = -(-padded // lay.lanes)
    is_sum = summed(plan, inferred)
    exact = exact_words(ops, ops.cast(payload[:words], "int64"), is_sum, n, lay.guard)
    # Uncentred lanes: the exact sums are below 2**31, so the lanes unpack in int32.
    lanes = unpack(ops, ops.cast(exact, "int32"), lay)
    positive = ops.cast(lanes[:padded] if lay.lanes * words > padded else lanes, "float32")
    factor = as_reduced(ops, ops.reshape(scale, (nb, 1)), is_sum, n) + ops.where(bad > 0, float("nan"), 0.0)
    # S (2 V - c) per block (times 1/n under Average), in two passes over the counts V.
    out = ops.reshape(ops.reshape(positive, (nb, B)) * (factor * 2.0) - factor * ops.cast(count, "float32"),
                      (padded,))
    return out * plan.factor if plan.factor != 1.0 else out


def _residual_kernel(ops, plan: _Plan, corrected, scale):
    """Step 6's residual ``e' = p - S sign(p)`` (``sign(0) = +1``), float32 [P], as
    ``(p + S) - 2 S b`` with ``b = [p >= 0]`` (float passes; a where on the bits is slower).
    ``corrected``: float32 [P], ``p``; ``scale``: float32 [nb], the agreed ``S``."""
    nb, B = ops.shape(scale)[0], plan.block
    s = ops.reshape(scale, (nb, 1))
    p = ops.reshape(corrected, (nb, B))
    bits = ops.cast(p >= 0.0, "float32")
    return ops.reshape((p + s) - bits * (s * 2.0), (nb * B,))


def pending(ops, plan: _Plan, kept, scale):
    """The error feedback a state ``(kept, scale)`` holds, float32 [d]: :func:`_residual_kernel`
    of ``kept`` (float32 [d], zero-padded to ``nb B``) and ``scale`` (float32 [nb]), its first
    ``d`` values. A composition (no fused form of its own: the encode's forms run it inline)."""
    d, nb = ops.shape(kept)[0], ops.shape(scale)[0]
    padded = nb * plan.block
    if padded > d:
        kept = ops.concat([kept, ops.zeros((padded - d,), "float32", kept)], 0)
    left = _residual_kernel(ops, plan, kept, scale)
    return left[:d] if padded > d else left
