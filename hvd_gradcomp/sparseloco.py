"""SparseLoCo on one all-reduce: decayed error feedback, agreed top chunks, few-bit integer lanes.

SparseLoCo (Sarfi, Therien, Lidin, Belilovsky, "Communication Efficient LLM Pre-training with
SparseLoCo", arXiv 2508.15706) syncs the pseudo-gradient of H inner AdamW steps through an
error-feedback accumulator with decay that replaces DiLoCo's outer momentum
(``e <- b e + delta``; send the compressed ``e``; keep the rest), sends each peer's chunk-wise
top-k of ``e`` with 2-bit values, and applies the mean with outer learning rate 1. Each peer
picks its own indices there, so the peers all-gather. Here the ranks agree on *which chunks*
go (TopKC's single-collective selection, :mod:`hvd_gradcomp.topkc`: the chunk statistics of
one step travel in its payload and rank the next step's chunks), and on *each chunk's grid*
(a scale derived from the same agreed statistics), so the values are small integers whose sum
over the ranks an ordinary Sum/Average all-reduce computes exactly in THC's integer lanes
(:mod:`hvd_gradcomp.lanes`): bytes per rank that do not grow with the number of ranks.

Notation: ``d`` coordinates, world size ``n``, chunks of ``C`` coordinates (``chunk``),
``m = ceil(d / C)`` chunks, ``k = max(1, ceil(ratio m))`` sent a step, ``b`` = ``decay``,
``L`` levels above 0 (``2**bits - 1``), guard bits ``g`` (0 under a known Sum, else
``bit_length(n)``: :func:`~hvd_gradcomp.lanes.exact_words`).

State (:class:`SparseLoCoState`): the accumulator ``e`` (float32 [d], this rank's), the agreed
chunk codes (float32 [m]: per chunk the mean over the ranks of a log code of the predicted
chunk RMS, 0 where no rank had data), a step counter and a count of realignments (int64 []).

Steps of ``compress`` (no collective):
    1. ``c = b e + x`` (float32, zero-padded to ``m C``, viewed as ``m`` chunks): the decayed
       accumulator plus this step's input (a pseudo-gradient under UpdateSync, a gradient
       otherwise). With ``interleave`` (the default) chunk ``j`` holds coordinates ``j, j + m,
       ..., j + (C - 1) m`` (the padded vector viewed as [C, m] and transposed: one copy), so
       a chunk spreads over the tensor's rows; otherwise chunk ``j`` is the run
       ``j C .. j C + C - 1``.
    2. Selection: the ``k`` chunks of highest agreed code, ties by lower index (the stable
       descending argsort); every rank holds the same codes, so every rank selects the same
       chunks with no collective. Before the first step all codes are 0: the first ``k``
       chunks.
    3. Each selected chunk's range ``R = T 2**((code - 256) / 4)``, ``T`` the two-sided normal
       quantile of ``saturation_rate`` (default :func:`~hvd_gradcomp.saturation.grid_saturation_rate`
       of ``L`` levels and ``n`` ranks); ``R = 0`` where the code is 0. The grid step is
       ``delta = 2 R (1 + 2**-20) / L`` (THC's: no level above ``L``); the level of a value
       ``v`` is ``q = floor(clip((v + R) / delta, 0, 2 R / delta) + 1/2)``, nearest rounding
       (error feedback keeps the rounding error, so no noise is needed), in ``0..L``; ``q``
       decodes to ``(q - L'/2) delta`` with ``L' = 2 R / delta``, i.e. ``q delta - R``
       (levels ``-R, -R/3, R/3, R`` at 2 bits). A chunk of range 0 sends level 0, which decodes
       to exactly 0 (the first step sends nothing and keeps everything).
    4. Accumulator candidate ``e' = c`` less this rank's decoded values on the selected chunks:
       what was not sent (the unselected chunks, clipping, rounding) is kept.
    5. Next step's statistics, per chunk: the RMS of the guess ``b e' + x`` of next step's
       ``c`` (TopKC's guess: a chunk just sent starts again from its input alone, an unsent one
       keeps what it owes) as a 9-bit log code ``clamp(round(4 log2 rms) + 256, 1, 511)``
       (quarter octaves from ``2**-63.75`` to ``2**63.75``) and a flag "has data" (code and flag
       0 where the RMS is 0 or this rank is not finite). The codes rank the chunks (step 2) and
       set their ranges (step 3) at the next step, on every rank alike.
    6. Pack into int32 words (:mod:`hvd_gradcomp.lanes`): the ``k C`` levels planar in lanes
       of :func:`~hvd_gradcomp.lanes.lane_layout` (``subtract_own``: lanes sized for the other
       ``n - 1`` ranks' sum, at 2 ranks ``bits``-bit lanes: 2-bit levels 16 a word), the codes
       in lanes of ``bit_length(511 n)`` bits and the flags in lanes of ``bit_length(n)`` bits
       (uncentred, so sums of ``n`` words never wrap), and four control words: 1 (contributes),
       1 if not finite, and ``s, s**2`` for a fingerprint ``s`` (``h`` bits) of the step
       counter, the selection and the selected chunks' codes (ranks whose states differ
       disagree except once in ``2**h``).

Horovod (or ``torch.distributed``) all-reduces the words with Sum or Average.

Steps of ``receive`` / ``decompress`` / ``finish``:
    7. Exact sums of every word (Average's truncated words recovered exactly,
       :func:`~hvd_gradcomp.lanes.exact_words`); ``c`` contributing ranks; the fingerprints
       disagree iff ``c sum(s**2) != (sum s)**2``; the agreed codes are ``sum code / sum flag``
       (0 where no rank had data), the same on every rank.
    8. ``decompress``: per selected chunk ``(S - c L'/2) delta`` with ``S`` the summed levels
       (exactly the sum of every contributor's decoded values in real arithmetic; computed
       once, in float32, from the exact integers), divided by ``n`` under Average, scattered
       into zeros; NaN everywhere when a rank was not finite, 0 when the fingerprints disagree
       (never a wrong sum).
    9. ``finish``: when every rank was finite, ``e <- e'`` and the codes become the agreed ones;
       after a disagreement ``e <- c`` (nothing was applied), the codes realign to the agreed
       ones (the same on every rank, so the ranks agree again from the next step), the step
       counter restarts at 0 and ``metrics()["realigned"]`` counts it. When a rank was not
       finite, the state stays as it was.

Under :class:`torch_backend.UpdateSync` (``compression="sparseloco"``, ``outer_lr=1``,
``outer_momentum=0``) ``x`` is the rank's change of the parameters since the last sync and the
decoded mean is the outer step: SparseLoCo's accumulator replaces the outer momentum. As
gradient compression it is error feedback with decay over 2-bit agreed chunks.

Wire per tensor and step, int32 in the one all-reduce: ``4 (ceil(k C / lanes) + ceil(m /
lanes_code) + ceil(m / lanes_flag) + 4)`` bytes; at 2 ranks under Sum with ``subtract_own``:
``bits`` bits a sent coordinate, and 3 codes and 15 flags a word (12.8 bits a chunk). Integer
payload: prescale/postscale factors must stay 1 and the op must be Sum or Average.

Why interleaved chunks (measured on ``lm-comm``, docs/sparseloco.md): at a small ratio a chunk
waits about ``1 / ratio`` syncs and then delivers what it accumulated at once, about ten
times one interval's change on the coordinates it moves. Spread over every row of a matrix
(interleaved, or the per-coordinate selection of the paper) the model takes it; on a
contiguous run (whole rows of a weight matrix, an embedding row) it diverged.

Why agreed chunks, and how this differs from the paper: the paper's top-k is within each chunk
(every chunk sends its largest values, at its own indices per peer); an all-reduce needs the
same coordinates on every rank, so here whole chunks are selected by their agreed predicted
size, and small chunks (``chunk``) make the selection finer at more bytes of statistics. The
scale of a chunk is derived from the previous step's agreed statistics, as THC's ranges are:
a chunk whose content outgrew its predicted RMS clips, and the accumulator keeps the excess.

Errors: ValueError for a world size above 1024 or a layout no lane fits, at ``init`` (before
any collective).
"""
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

from . import composite
from .base import Scheme, TensorInfo, WireBytes
from .lanes import (LaneLayout, as_reduced, control_words, exact_words, lane_layout, others_words, pack,
                    read_control, says_sum, unpack)
from .options import option, ratio_option, validate
from .saturation import grid_saturation_rate, saturation_threshold
from .topk import num_selected
from .topkc_kernels import _top_kernel

__all__ = ["SparseLoCoConfig", "SparseLoCoState", "SparseLoCoScheme"]

_CONTROL = 4  # contributes, not finite, fingerprint s, s**2
# Chunk statistics: a log code round(4 log2 rms) + 256 in [1, 511] (quarter octaves), 0: no data.
_CODE_SCALE, _CODE_OFFSET, _CODE_MAX = 4.0, 256.0, 511
_TINY = 2.0 ** -63.75  # an RMS at or below this counts as no data
_GRID = 1.0 + 2.0 ** -20  # delta = 2 R _GRID / L: float rounding never gives a level above L


@dataclass(frozen=True)
class SparseLoCoConfig:
    """Options of :class:`SparseLoCoScheme` (:mod:`hvd_gradcomp.options`; ``python -m
    hvd_gradcomp --list`` lists them).

    Raises:
        ValueError: an option of the wrong kind or outside its range, e.g. ``"sparseloco: bits
            must be an integer in [1, 8], got 9"``.
    """

    SCHEME: ClassVar[str] = "sparseloco"
    PRIMARY: ClassVar[str] = "ratio"
    ratio: float = ratio_option(0.06, doc="fraction of chunks sent per tensor and step, agreed "
                                          "across ranks")
    chunk: int = option(128, kind="integer", lo=1,
                        doc="coordinates per chunk (smaller: finer selection, more bytes of chunk "
                            "statistics, 12.8 bits a chunk at 2 ranks)")
    bits: int = option(2, kind="integer", lo=1, hi=8, harder="down",
                       doc="bits per sent value: 2^bits levels over [-R, R], R from the chunk's "
                           "agreed statistics")
    decay: float = option(0.95, kind="number", lo=0.0, hi=1.0,
                          doc="factor on the accumulator each step, e <- decay e + x (1: plain "
                              "error feedback; 0: none)")
    subtract_own: bool = option(True, kind="boolean",
                                doc="lanes sized for the other ranks' sum (each rank takes its own "
                                    "words off): at 2 ranks bits-bit lanes")
    interleave: bool = option(True, kind="boolean",
                              doc="chunk j holds coordinates j, j + m, j + 2m, ... (a chunk's burst "
                                  "spread over the tensor's rows); false: contiguous runs, which "
                                  "diverged on lm-comm (docs/sparseloco.md)")
    saturation_rate: Optional[float] = option(
        None, kind="number", lo=0.0, hi=0.5, lo_open=True, optional=True,
        doc="fraction of a standard normal clipped by the range (T = 1.5 at 0.134); none: by the "
            "levels and world size, as THC's")

    def __post_init__(self):
        validate(self)


class SparseLoCoState(NamedTuple):
    residual: object  # float32 [d]: the accumulator e (this rank's)
    codes: object  # float32 [m]: agreed mean chunk codes (0: no data), rank the chunks, set ranges
    step: object  # int64 []: steps since the start or the last realignment (in the fingerprint)
    realigned: object  # int64 []: steps whose output was 0 because the ranks' states disagreed


class Layout(NamedTuple):
    """Static sizes of one tensor's payload (ints and lane layouts)."""

    chunks: int  # m
    selected: int  # k
    pad: int  # m C - d
    levels: LaneLayout  # lanes of the values' levels (top = L)
    level_words: int  # ceil(k C / lanes)
    codes: LaneLayout  # lanes of the chunk codes
    code_words: int
    flags: LaneLayout  # lanes of the "has data" flags
    flag_words: int
    fingerprint_bits: int  # h
    threshold: float  # T


class _Ctx(NamedTuple):
    idx: object  # int64 [k]: the selected chunks
    sent: object  # float32 [k, C]: this rank's decoded values (given back after a realignment)
    left: object  # float32 [m C]: e' padded
    levels: object  # int32 [k C]: this rank's levels
    delta: object  # float32 [k, 1]: the grid step of each selected chunk
    own: object  # int32 [level words]: this rank's level words as sent (subtract_own), or None
    count: object = None  # int64 []: contributing ranks (receive)
    bad: object = None  # int64 []: ranks that were not finite
    mismatch: object = None  # bool []: the fingerprints disagree
    summed: object = None  # Python bool or bool []: the op was Sum
    codes: object = None  # float32 [m]: the agreed codes of this step's payload


class SparseLoCoScheme(Scheme):
    """SparseLoCo's compressor on an all-reduce (module docstring, steps 1-9)."""

    name = "sparseloco"
    flattens = True  # a vector's math: a bucket's tensors may go as one
    scalable = False  # integer payload
    min_numel = 1024  # below: fp16 (routing); the statistics and control words outweigh the saving

    def __init__(self, config: SparseLoCoConfig = SparseLoCoConfig()):
        self.config = config
        self._layouts = {}

    # ---- static sizes ----
    def layout(self, info: TensorInfo) -> Layout:
        """The payload's sizes (cached per size, world size and op); ValueError when no lane
        fits (:func:`~hvd_gradcomp.lanes.lane_layout`) or the world size is above 1024."""
        key = (info.numel, info.world_size, info.op)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = self._layout(info)
        return lay

    def _layout(self, info: TensorInfo) -> Layout:
        cfg, n = self.config, info.world_size
        m = -(-max(info.numel, 1) // cfg.chunk)
        k = num_selected(cfg.ratio, m)
        levels = lane_layout(cfg.bits, n, None, info.op, scheme=self.name, subtract_own=cfg.subtract_own)
        g = levels.guard
        cw = (_CODE_MAX * n).bit_length()
        fw = n.bit_length()
        codes, flags = LaneLayout((31 - g) // cw, cw, g), LaneLayout((31 - g) // fw, fw, g)
        h = min(13, (31 - g - n.bit_length()) // 2)
        rate = cfg.saturation_rate
        threshold = saturation_threshold(grid_saturation_rate(levels.top, n) if rate is None else rate)
        return Layout(m, k, m * cfg.chunk - info.numel, levels, -(-k * cfg.chunk // levels.lanes),
                      codes, -(-m // codes.lanes), flags, -(-m // flags.lanes), h, threshold)

    def init(self, ops, info: TensorInfo, like):
        lay = self.layout(info)
        zero = ops.zeros((), "int64", like)
        return SparseLoCoState(ops.zeros((info.numel,), "float32", like), ops.zeros((lay.chunks,), "float32", like),
                               zero, zero)

    # ---- compress ----
    def compress(self, ops, x, state, info, finite):
        cfg, lay = self.config, self.layout(info)
        m, k, C, top = lay.chunks, lay.selected, cfg.chunk, lay.levels.top
        flat = ops.reshape(x, (info.numel,))
        # Step 2 first: the selection comes from the agreed codes alone.
        idx = ops.fuse(_top_kernel, k)(state.codes)
        plan = (C, cfg.decay, top, lay.threshold, cfg.interleave)
        chunks, padded, picked_codes = ops.fuse(_correct_kernel, plan)(flat, state.residual, state.codes, idx)
        levels, delta, sent = ops.fuse(_quantize_kernel, plan)(ops.gather(chunks, idx), picked_codes)
        # Step 4: e' = c less what this rank sent, on the selected chunks only.
        left = ops.reshape(ops.index_add(chunks, idx, sent * -1.0), (m * C,))
        # Step 5: next step's statistics, from the guess b e' + x.
        guess = left * cfg.decay + padded if cfg.decay != 1.0 else left + padded
        rms = ops.norm(ops.reshape(guess, (m, C)), 1) * (1.0 / math.sqrt(C))
        checked = ops.all(ops.isfinite(rms), None)
        finite = checked if finite is None else ops.logical_and(finite, checked)
        usable = ops.logical_and(rms > _TINY, finite)
        code_words = pack(ops, ops.cast(_codes(ops, rms, usable), "int32"), lay.codes)
        flag_words = pack(ops, ops.cast(usable, "int32"), lay.flags)
        # Step 6: the levels in lanes, then the control words with the fingerprint.
        level_flat = ops.reshape(levels, (k * C,))
        level_words = pack(ops, level_flat, lay.levels)
        ok = ops.cast(finite, "int64")
        s = _fingerprint(ops, state.step, idx, picked_codes, lay.fingerprint_bits)
        payload = ops.concat([level_words, code_words, flag_words,
                              control_words(ops, (ok * 0 + 1, 1 - ok, s, s * s), lay.levels.guard)], 0)
        own = level_words + 0 if lay.levels.others else None  # a copy: the payload is reduced in place
        return payload, _Ctx(idx, sent, left, level_flat, delta, own)

    # ---- receive / decompress / finish ----
    def receive(self, ops, payload, ctx, info):
        """Step 7: the control words and the agreed codes, read once for decompress and finish."""
        lay, n = self.layout(info), info.world_size
        g = lay.levels.guard
        at = lay.level_words + lay.code_words + lay.flag_words
        tail = ops.cast(payload[at:], "int64")
        summed = info.op == "sum" if info.op is not None else says_sum(tail[0], g)
        control = read_control(ops, tail, summed, n, g)
        count, bad, s1, s2 = control[0], control[1], control[2], control[3]
        code_sum = _lane_sums(ops, payload[lay.level_words:lay.level_words + lay.code_words], summed, n, lay.codes,
                              lay.chunks)
        have = _lane_sums(ops, payload[lay.level_words + lay.code_words:at], summed, n, lay.flags, lay.chunks)
        codes = ops.where(have > 0.5, code_sum / ops.maximum(have, 1.0), 0.0)
        return ctx._replace(count=count, bad=bad, mismatch=s2 * count != s1 * s1, summed=summed, codes=codes)

    def decompress(self, ops, payload, ctx, info):
        lay, n, C = self.layout(info), info.world_size, self.config.chunk
        k = lay.selected
        lev = lay.levels
        exact = exact_words(ops, ops.cast(payload[:lay.level_words], "int64"), ctx.summed, n, lev.guard)
        if lev.offset:
            exact = exact + ctx.count * lev.offset
        if lev.others:
            exact = others_words(ops, exact, ctx.own)
        # The exact sums lie in [0, 2**32): their int32 patterns unpack to the same lanes.
        exact = ops.cast(ops.where(exact >= 2 ** 31, exact - 2 ** 32, exact), "int32")
        lanes = unpack(ops, exact, lev)
        if lev.others:
            lanes = lanes + unpack(ops, ctx.own, lev)
        total = ops.reshape(ops.cast(lanes[:k * C], "float32"), (k, C))
        # (S - c L'/2) delta: the offset off the integer sums first (no cancellation of n R).
        half = 0.5 * lev.top / _GRID
        offset = ops.cast(ctx.count, "float32") * half + ops.where(ctx.bad > 0, float("nan"), 0.0)
        scale = as_reduced(ops, ops.where(ctx.mismatch, 0.0, 1.0), ctx.summed, n)
        rows = (total - offset) * (ctx.delta * scale)
        return self._coordinates(ops, ops.scatter(ctx.idx, rows, (lay.chunks, C)), info)

    def _coordinates(self, ops, chunks, info):
        """float32 [d]: chunk-major values (float32 [m, C] or [m C]) in the tensor's order,
        unpadded (``interleave``: chunk j, position i is coordinate ``i m + j``)."""
        lay, C = self.layout(info), self.config.chunk
        if self.config.interleave:
            chunks = ops.transpose(ops.reshape(chunks, (lay.chunks, C)), (1, 0))
        flat = ops.reshape(chunks, (lay.chunks * C,))
        return flat[:info.numel] if lay.pad else flat

    def finish(self, ops, payload, ctx, state, info):
        """Step 9: accumulator, codes and counters after the step; unchanged when a rank was
        not finite; after a disagreement every rank keeps all of ``c`` and realigns."""
        lay, C = self.layout(info), self.config.chunk
        ok, mismatch = ctx.bad == 0, ctx.mismatch

        def cut(v):
            return self._coordinates(ops, v, info)

        def moved():
            return ops.select(
                mismatch,
                lambda: SparseLoCoState(cut(ctx.left + ops.reshape(ops.scatter(ctx.idx, ctx.sent, (lay.chunks, C)),
                                                                    (lay.chunks * C,))),
                                        ctx.codes, state.step * 0, state.realigned + 1),
                lambda: SparseLoCoState(cut(ctx.left), ctx.codes, state.step + 1, state.realigned))

        return ops.select(ok, moved, lambda: state)

    # ---- protocol ----
    def hand_over(self, ops, state, own, aggregate, info):
        """The state for the first compressed step after an FP16 warm-up
        (:mod:`hvd_gradcomp.warmup`): the chunk codes of ``aggregate`` (float32 [d], the last
        all-reduced FP16 step, the same on every rank; a sum under ``op="sum"``, so divided by
        ``n`` there: one rank's scale), so the first step ranks chunks and sets ranges as
        every later one (without, it sends nothing and keeps everything). The accumulator
        starts from 0."""
        lay, C = self.layout(info), self.config.chunk
        v = aggregate * (1.0 / info.world_size) if info.op == "sum" else aggregate
        if lay.pad:
            v = ops.concat([v, ops.zeros((lay.pad,), "float32", v)], 0)
        rows = (ops.transpose(ops.reshape(v, (C, lay.chunks)), (1, 0)) if self.config.interleave
                else ops.reshape(v, (lay.chunks, C)))
        rms = ops.norm(rows, 1) * (1.0 / math.sqrt(C))
        usable = ops.logical_and(rms > _TINY, ops.isfinite(rms))
        return state._replace(codes=_codes(ops, rms, usable))

    def payload_dtype(self, info: TensorInfo) -> str:
        return "int32"

    def sent_zeros(self, ops, ctx):
        """``ctx`` with ``own`` zeroed (:func:`~hvd_gradcomp.composite.sent_zeros`)."""
        return composite.own_zeroed(ctx)

    def metrics(self, state) -> dict:
        """``{"realigned": int64 []}``: steps whose output was 0 because the ranks disagreed."""
        return {"realigned": state.realigned}

    def wire(self, info: TensorInfo) -> WireBytes:
        lay = self.layout(info)
        return WireBytes(4 * (lay.level_words + lay.code_words + lay.flag_words + _CONTROL))


# ---- kernels: tensors in, tensors out (Primitives.fuse) ----
def _correct_kernel(ops, plan, flat, residual, codes, idx):
    """Step 1: ``c = b e + x`` as float32 [m, C] (a temporary the caller may update in place),
    ``x`` zero-padded (float32 [m C]), both chunk-major, and the selected chunks' agreed codes
    (float32 [k, 1]). ``interleave``: the padded vector viewed as [C, m] and transposed."""
    C, decay, interleave = plan[0], plan[1], plan[4]
    d = ops.shape(flat)[0]
    m = ops.shape(codes)[0]
    c = flat + residual * decay if decay != 1.0 else flat + residual
    padded = flat
    if m * C > d:
        tail = ops.zeros((m * C - d,), "float32", flat)
        c, padded = ops.concat([c, tail], 0), ops.concat([flat, tail], 0)
    if interleave:
        c = ops.transpose(ops.reshape(c, (C, m)), (1, 0)) + 0.0  # a copy: updated in place later
        padded = ops.reshape(ops.transpose(ops.reshape(padded, (C, m)), (1, 0)), (m * C,))
    return ops.reshape(c, (m, C)), padded, ops.reshape(ops.gather(codes, idx), (ops.shape(idx)[0], 1))


def _quantize_kernel(ops, plan, picked, codes):
    """Step 3: levels (int32 [k, C], in ``0..L``), grid steps (float32 [k, 1]) and the decoded
    values (float32 [k, C], ``(q - L'/2) delta``) of the selected chunks ``picked`` (float32
    [k, C]) on the grids of their agreed ``codes`` (float32 [k, 1]); a non-finite value
    gives level 0 (its rank's "not finite" word makes the payload unread)."""
    top, threshold = plan[2], plan[3]
    have = codes > 0.5
    rng = ops.where(have, ops.exp2((codes - _CODE_OFFSET) * (1.0 / _CODE_SCALE)) * threshold, 0.0)
    delta = rng * (2.0 * _GRID / top)
    inv = ops.where(have, 1.0 / ops.maximum(delta, 1e-38), 0.0)
    u = ops.clip((picked + rng) * inv, 0.0, top / _GRID)
    q = ops.floor(ops.where(ops.isfinite(u), u, 0.0) + 0.5)
    return ops.cast(q, "int32"), delta, (q - 0.5 * top / _GRID) * delta


def _codes(ops, rms, usable):
    """float32 [m]: step 5's log codes ``clamp(round(4 log2 rms) + 256, 1, 511)`` of the chunk
    RMS ``rms`` (float32 [m]), 0 where ``usable`` (bool [m]) is false."""
    code = ops.clip(ops.round(ops.log2(ops.where(usable, rms, 1.0)) * _CODE_SCALE) + _CODE_OFFSET,
                    1.0, float(_CODE_MAX))
    return ops.where(usable, code, 0.0)


def _lane_sums(ops, words, summed, n, lay, count):
    """float32 [count]: the exact lane sums of uncentred all-reduced ``words``."""
    exact = exact_words(ops, ops.cast(words, "int64"), summed, n, lay.guard)
    return ops.cast(unpack(ops, ops.cast(exact, "int32"), lay)[:count], "float32")


def _fingerprint(ops, step, idx, codes, bits):
    """int64 []: ``s`` in ``[0, 2**bits)``, a hash of the step counter (int64 []), the
    selection (int64 [k], in order) and the selected chunks' agreed codes (float32 [k, 1],
    hashed as ``floor(64 code)``), equal on ranks whose states are equal."""
    k = ops.shape(idx)[0]
    weights = ops.bitwise_or(ops.bitwise_and(ops.arange(k, "int64", idx) * 0x1E3779B1, 0x7FFFFFFF), 1)
    code = ops.cast(ops.floor(ops.reshape(codes, (k,)) * 64.0), "int64")
    terms = ops.bitwise_and((ops.cast(idx, "int64") + 1 + code * 0x10001) * weights, 0xFFFFFFFF)
    total = ops.sum(terms, None) + ops.bitwise_and(step + 1, 0xFFFFFF) * 0x85EBCA6B
    mixed = ops.bitwise_and(ops.bitwise_and(total, 0xFFFFFFFF) * 0x9E37, 0xFFFFFFFF)
    return ops.right_shift(mixed, 32 - bits)
