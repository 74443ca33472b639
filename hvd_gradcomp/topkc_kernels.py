"""TopKC's per-step kernels (:mod:`hvd_gradcomp.topkc`, whose module docstring gives the steps
they implement): error feedback and scores, the selection, packing the selected chunks into the
payload, and scattering the received chunks, each a pure function of a plan and tensors, called
through ``ops.fuse`` so that a backend may run a fused form of it (:mod:`torch_backend.kernels`)
or compile it; plus the small helpers they share with the scheme.
"""
from .base import poison, saturating_cast

__all__ = []  # private to hvd_gradcomp.topkc

# Smallest score norm used as a divisor: an all-zero tensor's max score is 0 (0/0 is NaN).
_TINY = 1e-30
# Vote slots (step 6): a split vote goes unseen only if two selections hash to one slot.
_SLOTS = 16


def _correct_kernel(ops, plan, flat, residual):
    """Steps 1 and 5 in one pass: ``c = g + beta e`` zero-padded and viewed as chunks (float32
    [m, chunk]) and per-chunk scores (float32 [m]): the squared norms of the guess ``beta c +
    g`` (step 5's ``g + beta e'`` for every chunk not sent this step; ``c`` itself when
    ``blocking``), non-finite as 0 when ``blocking``. The guess itself is not kept: the
    selected chunks' guesses are formed again by :func:`_pack_kernel`. ``plan`` = (chunk,
    error_feedback, blocking, beta), beta the ``residual_decay`` (1.0: no multiplication at
    all); without error feedback ``residual`` is unused."""
    chunk, error_feedback, blocking, decay = plan
    d = ops.shape(flat)[0]
    m = -(-d // chunk)
    if error_feedback:
        c = flat + (residual * decay if decay != 1.0 else residual)
    else:
        c = flat
    guess = c if blocking else (c * decay if decay != 1.0 else c) + flat
    if m * chunk > d:
        tail = ops.zeros((m * chunk - d,), "float32", flat)
        c, guess = ops.concat([c, tail], 0), ops.concat([guess, tail], 0)
    norms = ops.norm(ops.reshape(guess, (m, chunk)), 1)
    scores = norms * norms
    if blocking:
        scores = ops.where(ops.isfinite(scores), scores, 0.0)
    return ops.reshape(c, (m, chunk)), scores


def _pack_kernel(ops, plan, flat, chunks, scores, idx, *finite):
    """Steps 3-6 on the selected chunks: the payload, what was sent and the residual.

    ``plan`` = (chunk, error_feedback, blocking, beta, payload_dtype, prescale, unscale,
    limit): the :func:`_correct_kernel` plan's four, then :class:`~hvd_gradcomp.base.TensorInfo`'s
    ``prescale``, ``unscale`` and ``fp16_limit``. Inputs: ``flat`` float32 [d] (the gradient
    ``g``), ``chunks`` float32 [m, chunk] (``c`` from :func:`_correct_kernel`; updated in place
    with error feedback, so a temporary the caller no longer needs), ``scores`` float32 [m]
    (its scores; updated in place) and ``idx`` int64 [k] (the selected chunks, distinct);
    ``finite`` (bool [], optional): the gradient's check, applied to the payload by
    :func:`~hvd_gradcomp.base.poison` (NaN everywhere when false).

    Returns ``(payload, sent, left)``:
        - ``payload`` (``payload_dtype``): the selected chunks in ``idx`` order, times
          ``prescale``, saturated at ``limit`` (float16) and cast (step 3), [k chunk]; unless
          ``blocking``, followed by the scores (step 5: the selected chunks rescored as ``beta
          (c - sent) + g`` when there is error feedback, then over their maximum, :func:`_unit_scores`)
          and the vote (step 6, :func:`_vote_slots`): [k chunk + m + 16]; then ``poison``'s
          ``+ 0`` (``finite`` true: a -0 becomes +0) or NaN everywhere (``finite`` false);
        - ``sent`` float32 [k, chunk]: the payload's values decoded (``unscale`` times), [0]
          without error feedback;
        - ``left`` float32 [m chunk]: ``c`` less ``sent`` on the selected chunks (step 4), [0]
          without error feedback.
    """
    chunk, error_feedback, blocking, decay, dtype, prescale, unscale, limit = plan
    finite = finite[0] if finite else None
    k = ops.shape(idx)[0]
    picked = ops.gather(chunks, idx)
    wire = saturating_cast(ops, picked * prescale, dtype, limit=limit)
    payload = ops.reshape(wire, (k * chunk,))
    sent = left = ops.zeros((0,), "float32", flat)
    if error_feedback:
        # Step 4: subtract what was sent (as decoded) from the selected chunks only.
        sent = ops.cast(wire, "float32") * unscale
        left = ops.reshape(ops.index_add(chunks, idx, sent * -1.0), (ops.shape(chunks)[0] * chunk,))
    if blocking:
        return poison(ops, payload, finite), sent, left
    if error_feedback:
        # Step 5's fix-up: the kernel scored beta c + g, which is beta e' + g for every chunk
        # not sent; a sent chunk's e' is c - sent, so its guess is beta c + g - beta sent (an
        # O(k chunk) fix-up; without error feedback nothing is owed and g + g scores every
        # chunk alike, 4 ||g||^2).
        d, m = ops.shape(flat)[0], ops.shape(scores)[0]
        padded = ops.concat([flat, ops.zeros((m * chunk - d,), "float32", flat)], 0) if m * chunk > d else flat
        guess = (picked * decay if decay != 1.0 else picked) + ops.gather(ops.reshape(padded, (m, chunk)), idx)
        scores = _rescored(ops, scores, idx, guess - (sent * decay if decay != 1.0 else sent))
    payload = ops.concat([payload, ops.cast(_unit_scores(ops, scores), dtype), _vote_slots(ops, idx, dtype)], 0)
    return poison(ops, payload, finite), sent, left


def _scatter_kernel(ops, plan, payload, idx, *split):
    """Decode: float32 [d], the payload's ``k`` chunks (its first ``k chunk`` values, ``k`` the
    length of ``idx``, int64 [k], distinct chunk indices below ``ceil(d / chunk)``) cast to
    float32, times ``unscale`` (times 0 after a split vote, ``split`` bool [] when given: times
    0, not a plain 0, so that a NaN from a failed rank still reaches the output) and written
    at their chunks; zeros elsewhere; the padding dropped. ``plan`` = (chunk, d, unscale,
    payload_dtype)."""
    chunk, d, unscale, _ = plan
    k = ops.shape(idx)[0]
    m = -(-d // chunk)
    rows = ops.reshape(ops.cast(payload[:k * chunk], "float32"), (k, chunk))
    scale = ops.where(split[0], 0.0, unscale) if split else unscale
    return ops.reshape(ops.scatter(idx, rows * scale, (m, chunk)), (m * chunk,))[:d]


def _vote_slots(ops, idx, dtype, step=None):
    """``dtype`` [SLOTS]: 1 in the slot of a fingerprint of the selected chunks ``idx`` (int64
    [k]), 0 elsewhere.

    Fingerprint ``s = sum_j ((idx_j + 1) w_j mod 2**32)`` with odd weights
    ``w_j = (j * 0x9E3779B1 mod 2**31) | 1`` per position ``j`` (position-dependent: the
    payload packs chunks in selection order, so the same set in another order is another
    selection); with ``step`` (int64 [], EF21) ``((step + 1) mod 2**24) 0x85EBCA6B`` is added;
    slot = the top 4 of the low 32 bits of ``s * 0x9E37``. About 15 tensor ops; every
    intermediate stays below 2**63 (products of values below 2**31 and 2**32).
    """
    k = ops.shape(idx)[0]
    # 0x1E3779B1 = 0x9E3779B1 mod 2**31, so the same low 31 bits; a constant below 2**31, which
    # torch.compile's Triton code for CUDA takes as an index's factor (0x9E3779B1 it refused:
    # "out of range for type int32", on an H200 with PyTorch 2.11)
    weights = ops.bitwise_or(ops.bitwise_and(ops.arange(k, "int64", idx) * 0x1E3779B1, 0x7FFFFFFF), 1)
    terms = ops.bitwise_and((ops.cast(idx, "int64") + 1) * weights, 0xFFFFFFFF)
    total = ops.sum(terms, None)
    if step is not None:  # EF21: the step counter too (a rank that missed steps disagrees)
        total = total + ops.bitwise_and(step + 1, 0xFFFFFF) * 0x85EBCA6B
    mixed = ops.bitwise_and(ops.bitwise_and(total, 0xFFFFFFFF) * 0x9E37, 0xFFFFFFFF)
    slot = ops.right_shift(mixed, 32 - 4)  # _SLOTS = 16 slots: 4 bits
    return ops.cast(ops.arange(_SLOTS, "int64", idx) == slot, dtype)


def _top_kernel(ops, plan, values):
    """int64 [k]: the indices of the ``k = plan`` largest of ``values`` (float32 [m], k <= m),
    largest first, ties by lower index: the first ``k`` of the stable descending argsort (NaN
    above every number, as the argsort puts it)."""
    return ops.argsort(values)[:plan]


def _rescored(ops, scores, idx, rows):
    """``scores`` (float32 [m]) with the selected chunks ``idx`` (int64 [k]) scored as
    ``rows`` (float32 [k, chunk]), their squared norms: an O(k chunk) fix-up."""
    fixed = ops.norm(rows, 1)
    return ops.index_add(scores, idx, fixed * fixed - ops.gather(scores, idx))


def _unit_scores(ops, scores):
    """The scores a rank sends (float32 [m]): non-finite ones as 0, over their largest (at
    least ``_TINY``)."""
    scores = ops.where(ops.isfinite(scores), scores, 0.0)
    return scores / ops.maximum(ops.max(scores, None), _TINY)
