"""Integer lanes: several small non-negative integers packed into one int32 word, so that a
plain Sum (or Horovod's integer Average) all-reduce of the words sums each lane exactly.

A :class:`LaneLayout` puts ``lanes`` lanes of ``width`` bits above ``guard`` guard bits. Every
rank takes the same ``offset`` off each word, so any sum of up to ``n`` ranks' words stays
inside int32 (the sign bit is used, nothing wraps); the receiver adds ``c * offset`` back for
``c`` contributing ranks. Under Average, Horovod truncates ``W / n`` toward zero; with
``2**guard > n`` the exact sum is recovered by :func:`exact_words`. Small per-rank counts
(a rank that contributes, a rank whose gradient was not finite, a statistic's code) travel one
to a word above the same guard bits (:func:`control_words`, :func:`read_control`): the
integer non-finite flag, since an integer payload cannot carry a NaN. Positive per-block
scales travel as log codes summed in lanes (:func:`pack_scales`, :func:`agreed_scales`), so
the ranks agree on their geometric mean. Used by THC
(:mod:`hvd_gradcomp.thc`, steps 5-6, which also gives the derivation) and signSGD
(:mod:`hvd_gradcomp.signsgd`); ``docs/writing-a-scheme.md`` walks through using them.
"""
from functools import lru_cache
from typing import NamedTuple

__all__ = ["MAX_WORLD_SIZE", "LaneLayout", "centred_offset", "lane_layout", "wire_bits", "exact_words", "as_reduced",
           "pack", "unpack", "control_words", "read_control", "says_sum", "stats_layout", "pack_scales",
           "agreed_scales", "others_words"]

MAX_WORLD_SIZE = 1024


class LaneLayout(NamedTuple):
    """How values sit in an int32 word (THC's step 5, :mod:`hvd_gradcomp.thc`): ``lanes`` lanes of ``width`` bits above
    ``guard`` guard bits; levels ``0..top`` per rank (``top = 0`` for the statistics), and
    ``offset`` (a multiple of ``2**guard``) taken off each word by every contributing rank.
    ``others``: the lanes hold the other ranks' sum only, not all ``n`` ranks'
    (:func:`lane_layout`'s ``subtract_own``): the receiver takes its own words off the reduced
    ones, modulo ``2**32``, and adds its own levels back (:func:`others_words`)."""

    lanes: int
    width: int
    guard: int
    top: int = 0
    offset: int = 0
    others: bool = False


_INT32_MAX = (1 << 31) - 1


def centred_offset(top: int, width: int, lanes: int, guard: int, n: int):
    """The offset ``K`` that keeps any sum of ``c <= n`` words in int32 (step 5), or None."""
    peak = top * sum(1 << (guard + j * width) for j in range(lanes))  # one rank's largest word
    if peak > _INT32_MAX:
        return None
    half = (peak // 2) >> guard << guard
    for k in (half, half + (1 << guard)):
        if n * k <= _INT32_MAX + 1 and n * (peak - k) <= _INT32_MAX:
            return k
    return None


@lru_cache(maxsize=None)  # host work the schemes' layout() would redo for every tensor and step
def lane_layout(bits: int, world_size: int, lane_bits=None, op="average", scheme="thc",
                centred: bool = True, subtract_own: bool = False) -> LaneLayout:
    """The int32 layout of the levels summed over ``world_size`` ranks (:mod:`hvd_gradcomp.thc`, step 5).

    Args:
        bits: the per-rank levels are at most ``2**bits - 1``.
        lane_bits: None: every rank's levels are ``0..2**bits - 1`` in lanes as wide as their
            sum needs. An int ``b``: at least ``32 // b`` lanes a word (``b`` bits a coordinate)
            where a lane can hold the sum of ``n`` ranks' levels ``0..1``, fewer where it
            cannot; the levels are the most that such a lane holds summed over ``n`` ranks,
            capped at ``2**bits - 1``.
        op: ``"sum"``: no guard bits (Horovod's Sum is exact); otherwise (``"average"`` or None,
            unknown) ``bit_length(n)`` guard bits, for step 6.
        scheme: the name in error messages.
        centred: True: an offset lets the sums use int32's sign bit (most lanes). False: no
            offset, every sum of ``n`` words stays in ``[0, 2**31)``, so the exact sums fit
            int32 and :func:`unpack` can run on int32 (half the bytes of int64; at most one
            lane fewer a word).
        subtract_own: the lanes need hold only the sum of the ``n - 1`` other ranks' levels
            (``others`` set, no offset): each receiver knows its own words and takes them off
            the reduced words modulo ``2**32`` (:func:`others_words`), where the sum of all
            ``n`` may wrap without harm. At 2 ranks a lane is as wide as one rank's levels
            (4-bit levels in 4-bit lanes, not 5); under Average the guard bits stay those of
            ``n``.

    Raises:
        ValueError: ``world_size`` above ``MAX_WORLD_SIZE``, or no lane fits in an int32 word.
    """
    n = world_size
    if n > MAX_WORLD_SIZE:
        raise ValueError(f"{scheme}: world size must be at most {MAX_WORLD_SIZE}, got {n}")
    guard = 0 if op == "sum" else n.bit_length()
    room, cap = 32 - guard, (1 << bits) - 1
    summands = max(1, n - 1) if subtract_own else n  # the ranks whose levels a lane sums
    for target in range(32 // lane_bits if lane_bits else 1, 0, -1):
        most = min(cap, ((1 << (room // target)) - 1) // summands) if lane_bits else cap
        # The most levels, or one fewer where an odd sum fills the word (no centring fits).
        for top in (most, most - 1) if lane_bits else (cap,):
            width = (summands * top).bit_length()
            for lanes in range(room // width, target - 1, -1) if top >= 1 else ():
                if subtract_own:  # sums wrap modulo 2**32 harmlessly: no offset
                    return LaneLayout(lanes, width, guard, top, 0, True)
                if centred:
                    offset = centred_offset(top, width, lanes, guard, n)
                else:
                    peak = top * sum(1 << (guard + j * width) for j in range(lanes))
                    offset = 0 if n * peak <= _INT32_MAX else None
                if offset is not None:
                    return LaneLayout(lanes, width, guard, top, offset)
    raise ValueError(f"{scheme}: bits={bits} with {n} ranks needs {guard} guard bits and lanes of "
                     f"{(n * cap).bit_length()} bits, more than an int32 word holds; use fewer bits "
                     f"or set lane_bits")


def wire_bits(bits: int, world_size: int, lane_bits=None, op="average") -> float:
    """Payload bits per (padded) coordinate: ``32 / lanes`` (statistics, control words and
    padding not counted)."""
    return 32.0 / lane_layout(bits, world_size, lane_bits, op).lanes


def others_words(ops, exact, own):
    """The other ranks' summed words of a :func:`lane_layout` with ``subtract_own``: int64 [m]
    in ``[0, 2**32)``, ``(exact - own) mod 2**32``.

    Args:
        exact: int64 [m], the exact reduced words (:func:`exact_words`: the int32 sums, which
            may have wrapped, as they came).
        own: int32 [m], this rank's words as it sent them (kept by the scheme's ctx; all zero
            for a rank that did not contribute).

    Every rank's words lie in ``[0, 2**32)`` as unsigned, and the others' sum of each lane
    stays below ``2**width``, so the others' words summed as integers are below ``2**32``:
    reduction modulo ``2**32`` of the wrapped sum minus this rank's words gives them exactly.
    """
    return ops.bitwise_and(exact - ops.cast(own, "int64"), 0xFFFFFFFF)


def exact_words(ops, words, summed, world_size: int, guard: int):
    """Step 6: the exact sums of the packed words, whichever op Horovod applied.

    Args:
        words: int64 [m], the all-reduced int32 words (sums, or Horovod's truncated averages).
        summed: bool 0-d tensor or Python bool, True if Horovod applied Sum.
        world_size: n.
        guard: guard bits g of the layout (``2**g > n``; exact sums are multiples of ``2**g``).

    Returns:
        int64 [m]: ``words`` under Sum; under Average the multiple of ``2**g`` next to
        ``n * words`` away from zero (the smallest ``>=`` it for a word ``>= 0``, the largest
        ``<=`` it for a negative one; see :mod:`hvd_gradcomp.thc`, step 6, for why that is exact).
    """
    if summed is True or guard == 0:
        return words
    bias = 1 << 40  # a multiple of 2**g that makes every operand of the shifts non-negative
    scaled = words * world_size + bias
    up = ops.left_shift(ops.right_shift(scaled + ((1 << guard) - 1), guard), guard)
    down = ops.left_shift(ops.right_shift(scaled, guard), guard)
    recovered = ops.where(words < 0, down, up) - bias
    if summed is False:
        return recovered
    return ops.where(summed, words, recovered)


def as_reduced(ops, x, summed, world_size: int):
    """``x`` (the decoded sum's factor) for the op Horovod applied: ``x`` under Sum, ``x / n``
    under Average (``summed`` as in :func:`exact_words`: a Python bool costs no op)."""
    if isinstance(summed, bool):
        return x if summed else x * (1.0 / world_size)
    return x * ops.where(summed, 1.0, 1.0 / world_size)


def _lane_shifts(ops, count: int, lay: LaneLayout, like):
    """``[count, 1]`` of ``like``'s dtype: the shift of lanes ``0..count-1`` of ``lay`` (guard
    plus ``j`` widths), built on ``like``'s device (arange: no host-to-device copy per call)."""
    return ops.reshape(ops.arange(count, ops.dtype(like), like) * lay.width + lay.guard, (count, 1))


def pack(ops, values, lay: LaneLayout):
    """int32 [w = ceil(m / lanes)]: int32 ``values`` [m] (each below ``2**width``) in lanes of
    ``lay`` above its guard bits, planar: value ``j * w + i`` in lane ``j`` of word ``i``
    (contiguous reads per lane). The full lanes in one shift (a [lanes, 1] shift per row of the
    [lanes, w] view, no padded copy) and one sum over the lanes (their bits do not overlap, so
    the sum is their OR); a short last lane adds into the first words only. A fixed number of
    operations whatever the lane count (one shift and one add per lane before)."""
    m = ops.shape(values)[0]
    w = -(-m // lay.lanes)
    full = m // w if w else 1  # lanes filled to w values (1 <= full <= lanes)
    body = values[:full * w] if full * w < m else values
    if full == 1:
        words = ops.left_shift(body, lay.guard)
    else:
        shifts = _lane_shifts(ops, full, lay, values)
        # (a sum of int32 is int64 in PyTorch: the lanes' bits do not overlap, so the cast back
        # to int32 keeps them, bit 31 included, e.g. subtract_own's words)
        words = ops.cast(ops.sum(ops.left_shift(ops.reshape(body, (full, w)), shifts), 0), "int32")
    if lay.offset:
        words = words - lay.offset
    if full * w < m:
        part = ops.left_shift(values[full * w:], lay.guard + full * lay.width)
        k = ops.shape(part)[0]
        words = ops.concat([words[:k] + part, words[k:]], 0)
    return words


def unpack(ops, words, lay: LaneLayout):
    """[lanes * w], the dtype of ``words``: the lane sums of exact non-negative ``words`` [w]
    (the offsets added back), in :func:`pack`'s order."""
    n = ops.shape(words)[0]
    shifts = _lane_shifts(ops, lay.lanes, lay, words)
    lanes = ops.bitwise_and(ops.right_shift(ops.reshape(words, (1, n)), shifts), (1 << lay.width) - 1)
    return ops.reshape(lanes, (n * lay.lanes,))


def control_words(ops, values, guard: int):
    """int32 [k]: the int64 0-d ``values`` (this rank's small non-negative counts, each at most
    ``2**(31 - guard) // n``: 1 for "contributes", 1 for "not finite", a code), one a word,
    above ``guard`` zero bits, so their all-reduced sums come back exactly
    (:func:`read_control`)."""
    words = ops.concat([ops.reshape(v, (1,)) for v in values], 0)
    return ops.cast(ops.left_shift(words, guard), "int32")


def says_sum(count_word, guard: int):
    """bool 0-d: the all-reduced "contributes" word (int64 0-d, every rank's 1 above ``guard``
    bits) says Horovod applied Sum (``n << g``, above ``1 << g``) rather than Average (``1 << g``);
    full participation assumed. For calls whose op the scheme is not told (``info.op`` None)."""
    return count_word > (1 << guard)


def read_control(ops, words, summed, world_size: int, guard: int):
    """int64 [k]: the exact sums over the ranks of :func:`control_words`' values, from the
    all-reduced ``words`` (int32 or int64 [k]; ``summed`` as in :func:`exact_words`)."""
    exact = exact_words(ops, ops.cast(words, "int64"), summed, world_size, guard)
    return ops.right_shift(exact, guard)


# A scale's log code: round(4 log2 s) + 512 in [1, 1023], 10 bits: quarter octaves over all of
# float32's normal range; code 0 (with flag 0): no data. n <= 1024 ranks' sums stay below 2**20.
CODE_SCALE, CODE_OFFSET, CODE_MAX = 4.0, 512.0, 1023
TINY_SCALE = 1e-30  # a scale at or below this has no data (2**-127.75 is the smallest code)


def stats_layout(world_size: int, guard: int) -> LaneLayout:
    """The lanes of the (code, has data) pairs summed over ``world_size`` ranks, uncentred,
    above ``guard`` guard bits (those of the payload's other words)."""
    width = (CODE_MAX * world_size).bit_length()
    return LaneLayout((31 - guard) // width, width, guard)


def pack_scales(ops, scales, usable, lay: LaneLayout):
    """int32 [ceil(2 nb / lanes)]: this rank's float32 ``scales`` [nb] as (log code, has
    data) pairs in the lanes of ``lay`` (:func:`stats_layout`); a pair is (0, 0) where the
    bool ``usable`` [nb] is false (no data, a scale not above :data:`TINY_SCALE`, or a
    non-finite gradient)."""
    nb = ops.shape(scales)[0]
    code = ops.round(ops.log2(ops.where(usable, scales, 1.0)) * CODE_SCALE) + CODE_OFFSET
    code = ops.clip(code, 1.0, float(CODE_MAX))
    pairs = ops.concat([ops.reshape(ops.where(usable, code, 0.0), (nb, 1)),
                        ops.reshape(ops.cast(usable, "float32"), (nb, 1))], 1)
    return pack(ops, ops.cast(ops.reshape(pairs, (2 * nb,)), "int32"), lay)


def agreed_scales(ops, words, summed, world_size: int, lay: LaneLayout, blocks: int):
    """float32 [blocks]: from the all-reduced words of :func:`pack_scales` (int32 or int64;
    ``summed`` as in :func:`exact_words`), per block ``2**((mean code - 512) / 4)`` over the
    ranks with data (a geometric mean of their scales), 0 where none had data; the same on
    every rank."""
    exact = exact_words(ops, ops.cast(words, "int64"), summed, world_size, lay.guard)
    stats = ops.cast(ops.reshape(unpack(ops, exact, lay)[:2 * blocks], (blocks, 2)), "float32")
    code_sum, have = stats[:, 0], stats[:, 1]
    # The offset comes off the integer sum first (exact), so the mean is rounded once.
    mean = (code_sum - have * CODE_OFFSET) / ops.maximum(have, 1.0)
    return ops.where(have > 0.5, ops.exp2(mean * (1.0 / CODE_SCALE)), 0.0)
