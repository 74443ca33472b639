"""THC on a plain all-reduce: rotate, quantise to a few bits, sum integer lanes exactly.

Tensor Homomorphic Compression (Li, Ben Basat, Vargaftik, Lao, Kim, Mitzenmacher, Yu, "THC:
Accelerating Distributed Deep Learning Using Tensor Homomorphic Compression", NSDI 2024) was
built for a parameter server that adds small integers. Here the integers travel through one
Horovod all-reduce instead, packed into int32 lanes wide enough for the sum over all ranks
(the "simple adaptation" of Han et al., HotNets 2024),
and the quantisation grid comes from statistics that rode in the previous step's payload, so
``compress`` waits on no other rank.

Notation: ``d`` coordinates, world size ``n`` (of the process set), ``L`` the top level of a
rank (``2**bits - 1``, or fewer where the lane width caps it: step 5),
rotation block ``B`` (``2**rotation_stages``, or ``next_pow2(d)`` with ``rotation="full"``),
padded length ``P`` (a multiple of ``B``), ``nb = P / B`` blocks.

State (per tensor, :class:`THCState`): the residual *in the rotated basis* (float32 [P]), the
agreed range of each block ``R`` (float32 [nb]), a step counter (int64) and the count of
saturated coordinates of the last step.

Steps of ``compress`` (no collective):
    1. Rotate: ``y = H_B D pad(g) + e``. ``D`` is a +-1/sqrt(B) diagonal drawn once per tensor
       from the counter-based RNG keyed by ``(seed, tensor key)``, the same on every rank and
       at every step, so the rotation is a fixed orthonormal map and the residual ``e`` can be
       kept in the rotated basis (no inverse rotation in ``compress``). With ``flush = f``
       (default 1) each coordinate of ``e`` is clipped to ``f r_g`` of its block, ``r_g`` the
       range the rotated gradient alone wants (step 2's rule applied to ``H_B D pad(g)``; no
       bound in a block without gradient); what is clipped stays in the residual for later
       steps. In steady state ``e`` is a rounding error, far inside the bound; after a sudden
       drop in gradient scale the old-scale residual would otherwise set the next ranges and
       ring for many steps (measured in ``docs/thc.md``); bounded, it drains at ``f r_g`` a step.
    2. Next step's statistics, per block: the range this rank would want, ``r = T sigma`` with
       ``sigma = ||y_block|| / sqrt(B)`` (with saturation; ``T`` the two-sided normal quantile of
       ``saturation_rate``, 3.2971933456919635 for 1/1024 as THC; by default THC's from 15
       levels above 0 up, below by the levels and the world size:
       :mod:`~hvd_gradcomp.saturation`) or the block's peak ``max |y|``
       (without), as a log code ``clamp(round(4 log2 r) + 512, 1, 1023)`` (0 for an all-zero
       block) and a flag "non-zero". Quarter-octave steps from ``2**-127.75`` to ``2**127.75``,
       float32's whole range (gradients under loss scaling included). A block whose ``r`` is
       not finite (a non-finite ``y``, or squares beyond float32: a block RMS above about
       ``5e17``) makes this rank's gradient count as not finite (step 5's word), as an
       overflowing sum does in the shared check: the rotation can overflow values whose sum
       does not (``[3e38, -3e38]``).
    3. Quantise with the agreed ranges ``R`` (step 8 of the previous step; all 0 at first): grid
       step ``delta = 2 R / L`` (times ``1 + 2**-20`` so float rounding never gives a level
       above ``L``), grid position ``u = (y + R) / delta`` clipped to ``[0, 2 R / delta]``
       (clipping ``y`` to ``[-R, R]`` per block; counted in ``metrics()["saturated"]``), level
       ``q = floor(u + U)`` with ``U`` uniform on the ``2**-23`` lattice in [0, 1): unbiased
       stochastic rounding, independent per rank (keyed by rank and step). ``1 + U`` is the
       float32 whose mantissa bits are ``a_b XOR c_j`` (block b, column j), with ``nb + B``
       hashed values per step: pairwise independent over coordinates, and no pass beyond one
       XOR. In passes over the block matrix: a multiply and an add for ``u``, one clip, the
       XOR, one add and one floor, two compares for the count.
       A block whose range is 0 sends level 0, which decodes to exactly 0: the first step sends
       nothing and keeps everything in error feedback (the safe first encoding). A rank whose
       gradient is not finite sends undefined levels; its "not finite" word (step 5) makes them
       unread.
    4. Residual candidate ``e' = y - (q delta - R)``: clipping and rounding, in the rotated basis.
    5. Pack into int32 words, every field above ``g`` guard bits that are always 0 (``g = 0``
       under a known Sum, whose words are exact; ``bit_length(n)`` under Average or an unknown
       op, so ``2**g > n``):
       levels ``0..L`` in lanes of ``w = bit_length(n L)`` bits (``lanes`` a word) on
       ``m = ceil(P / lanes)`` words, planar over the whole rotated vector: lane ``j`` of
       word ``i`` holds coordinate ``j m + i`` (one shift and one add per lane over contiguous
       slices, no padded copy; the last lane may be short). Every rank takes a fixed offset
       ``K`` (a multiple of ``2**g``, about half its largest word) off each level word, so that
       the sum of any ``c <= n`` ranks' words lies in ``[-c K, c (peak - K)]``, inside int32:
       the sign bit carries levels too, and no sum ever wraps; the decoder adds ``c K`` back.
       ``L`` and the lanes (:func:`lane_layout`): with ``lane_bits = b`` (default 8), a word
       holds ``32 // b`` lanes of ``(32 - g) // (32 // b)`` bits, and ``L`` is the most levels
       such a lane holds summed over ``n`` ranks, ``(2**width - 1) // n``, capped at
       ``2**bits - 1`` (so the per-rank levels follow the world size at a fixed wire cost,
       averaging over more ranks partly offsetting the coarser levels); the lanes then shrink
       to ``bit_length(n L)`` (more of them a word where ``bits`` caps ``L``); where not even
       ``L = 1`` fits (Average from 64 ranks on with ``b = 8``), one lane fewer a word.
       ``lane_bits=None``: ``L = 2**bits - 1`` at every world size, lanes as wide as its sum
       needs. The trade is the default's (``bits`` at 4): a ``bits`` set to another value is
       honoured, ``L = 2**bits - 1`` at every world size, so where the default ``lane_bits=8``
       would shrink it the lanes widen instead (``lane_bits=None``'s layout), and another
       ``lane_bits`` that cannot hold it is refused at the first compress, naming both
       (:meth:`THCScheme.layout`). The statistics (code, flag) go unsigned in lanes of ``bit_length(1023 n)`` bits
       above the same ``g``; and four control words: ``1`` (a contributing rank), ``1`` if
       this rank's gradient was not finite, and a fingerprint ``s, s**2`` of this rank's step
       counter (``s`` its low ``h`` bits: ranks ``k`` steps apart always disagree for
       ``0 < k < 2**h``, e.g. a rank back from ``hvd.join()``; a hash would miss a one-step
       lag once in ``2**h`` steps). A lane holds the sum over ``n`` ranks without carrying
       into the next.
       ``subtract_own=true``: the level lanes hold only the sum over the other ``n - 1``
       ranks (``w = bit_length((n - 1) L)``, no offset; :func:`~hvd_gradcomp.lanes.lane_layout`).
       The int32 sum of all ``n`` ranks' words may then wrap, harmlessly: each rank keeps its
       own level words (ctx), and step 6 takes them off the exact reduced words modulo
       ``2**32`` (the others' words, exactly: :func:`~hvd_gradcomp.lanes.others_words`) and
       adds its own lanes back. The sums decoded are the same bit for bit, in fewer words
       where ``bit_length((n - 1) L) < bit_length(n L)``: at 2 ranks 4-bit levels take 4-bit
       lanes (8 a word under Sum, 7 under Average) instead of 5-bit ones (6), 14-25% fewer
       bytes; at 3 ranks (and 5 under Sum) one lane more a word; at 4 and 8 nothing, at 16
       under Average one level more (the table: docs/thc.md, "Lanes for the other ranks"). The
       statistics and control words stay plain sums. A payload summed in place (Horovod's)
       needs the copy the ctx keeps: ``m`` int32 words more memory and one copy a step. A
       TensorFlow group that widens the words to float64 brings their exact sums back modulo
       ``2**32`` (:func:`~hvd_gradcomp.grouped.narrowed`).

Horovod all-reduces the words with Sum or Average (a rank in ``hvd.join()`` contributes zeros).

Steps of ``decompress`` / ``finish``:
    6. Exact sums. Under Sum the words are exact. Under Average each word is
       ``trunc(W * (1/n))`` (toward zero: Horovod's scale in double, NCCL's integer division)
       with ``W`` the exact sum, a multiple of ``2**g``; ``n * avg`` lies in ``(W - 2**g, W]``
       for ``W >= 0`` and in ``[W, W + 2**g)`` for ``W < 0``, so ``W`` is the smallest multiple
       of ``2**g`` that is ``>= n * avg``, or for a negative average the largest ``<=`` it.
       The op comes from Horovod's call (the adapters read it); when unknown (a hand-made
       call), full participation is assumed and the count word tells Sum (``n``) from Average.
    7. ``c`` = contributing ranks (joined ranks contribute nothing), ``S`` = summed levels per
       coordinate. The result is ``S delta - c R`` (the sum of the contributors' decoded
       values), divided by ``n`` under Average (Horovod's convention, as for an uncompressed
       tensor), inverse-rotated, unpadded. A non-finite rank makes every value NaN on every
       rank. If the fingerprints disagree (``c * sum(s**2) != sum(s)**2``: some rank's state
       is not the others', e.g. a checkpoint loaded on one rank only, or a rank that sat out
       steps in ``hvd.join()``), the ranks quantised on different grids: the output is 0 for
       this tensor and step (never a wrong value) and ``metrics()["realigned"]`` counts it.
    8. ``finish``: when no rank failed, the ranges become ``2**((sum code / count - 512) / 4)``
       per block, from the summed statistics (a geometric mean over the ranks that had data; 0
       where none did), identical on every rank. The residual becomes ``e'`` and the step
       counter advances; after a fingerprint mismatch the residual becomes all of ``y``
       (nothing was applied), the counters restart at 0 on every rank, and the ranks agree
       again from the next step on. When some rank failed, the state stays as it was.

A stale range clips what this step's gradient has beyond it; saturation counts those
coordinates and error feedback carries them into the next steps (the ranges follow within a
step, since the statistics are of ``y``, residual included). A block that had no data on any
rank last step has range 0 and sends nothing this step: its content waits one step in error
feedback. Measured errors (blocks of very different scales, row-sparse embeddings): docs/thc.md.

``range="current"`` is the paper's blocking form: step 2's per-block range is all-reduced
(Max) by a synchronous side collective inside ``compress`` and used in this same step (no
clipping at all without saturation); it needs every rank to compress every tensor in the
same order (see ``base.py``). The simple adaptation is
``THCConfig(rotation="full", saturation=False, range="current")``.

Wire per tensor and step: ``4 * (m + stats_words + 4)`` bytes of int32 in the one all-reduce
(plus ``4 nb`` bytes in a side collective with ``range="current"``). Bits per coordinate of the
levels, ``32 / lanes`` (:func:`~hvd_gradcomp.lanes.wire_bits`); the table per world size and op,
and why no single int32 all-reduce reaches 8 bits at 128 ranks under Average: docs/thc.md.

The statistics add ``2 / (B lanes_s)`` words per coordinate (0.03-0.07 bits at ``B = 1024``).

The scheme compresses every tensor it is given, whatever its size: which tensors reach it is
the routing's decision (:mod:`hvd_gradcomp.routing`; a plain ``thc`` compressor sends tensors
below ``min_numel``, default 1024, as FP16 instead).

Limits: world size at most 1024; ``ValueError`` at the first ``compress`` (before any
collective) if no lane fits (only with ``lane_bits=None``: ``bits = 16`` from 129 ranks on).
The payload is integer: Horovod's ``gradient_predivide_factor`` and prescale/postscale factors
must stay 1 and ``op`` must be Sum or Average (the adapters refuse anything else, before any
collective, on every rank).

References: THC (NSDI 2024) for rotate-clamp-quantise and ``T``; Suresh et al., "Distributed
Mean Estimation with Limited Communication", ICML 2017, for the randomized Hadamard rotation.
"""
import logging
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

from . import composite, hadamard, rng
from .base import Scheme, TensorInfo, WireBytes
from .lanes import MAX_WORLD_SIZE, LaneLayout, exact_words, lane_layout, stats_layout, wire_bits
from .thc_kernels import (_CONTROL, _Plan, _decode_kernel, _encode_kernel, _finish_kernel, _noise_kernel, _pad,
                          _quantize_kernel, _receive_kernel, _rotate_kernel)
from .options import error_feedback_option, option, seed_option, validate
from .saturation import grid_saturation_rate, saturation_threshold

log = logging.getLogger(__name__)
_WARNED = set()  # (world size, bits, lane_bits): the one-level warning given once a process

__all__ = ["THCConfig", "THCState", "THCScheme", "saturation_threshold", "grid_saturation_rate", "lane_layout",
           "wire_bits", "exact_words", "MAX_WORLD_SIZE"]

@dataclass(frozen=True)
class THCConfig:
    """Options of :class:`THCScheme`, each declared once below (kind, range, default, which
    way compresses harder, doc: :mod:`hvd_gradcomp.options`; ``python -m hvd_gradcomp --list``
    lists them).

    Tuning ``bits`` and ``lane_bits``: the wire cost is in the module docstring's table
    (``lane_bits`` caps it, ``bits`` caps the per-rank levels); keep ``bits=4`` with saturation.
    Levels of 1-2 bits (``bits``, or ``lane_bits=8`` from 64 ranks on) are coarse: error
    feedback then carries a rounding error larger than the gradient (one-step errors in
    ``docs/thc.md``; ``bits=1`` diverged to NaN under AdamW on the LM): use ``bits >= 3`` with
    error feedback. Under Adam/AdamW prefer ``error_feedback=false`` at the default 4 bits (error
    feedback's lag costs steps there; measured in ``docs/adam.md``); ``lane_bits=16`` or none
    keeps 4-bit levels at more bytes.
    ``rotation_stages`` (THC's code has 10): more stages mix more coordinates, cost more time
    and pad to a multiple of ``2**k``. ``saturation``
    buys a finer grid with the same bits; ``saturation_rate`` 1/1024 is THC's
    (``T = 3.297``), the default from 15 levels above 0 up; fewer levels (``bits`` <= 3, or 4
    bits shrunk by ``lane_bits``) default to a lower threshold that suits their coarse grid and
    the world size (:func:`~hvd_gradcomp.saturation.grid_saturation_rate`; measured in
    ``docs/thc.md``, section 3). ``rotation`` and ``rotation_stages`` move the bytes both ways (padding
    against per-block ranges). All ranks must use the same ``seed``.

    The size threshold below which tensors go as FP16 (``min_numel``) is a routing option,
    not one of these (:mod:`hvd_gradcomp.routing`).

    Raises:
        ValueError: an option of the wrong kind or outside its range, naming the scheme and the
            option (one wording for every scheme), e.g. ``"thc: bits must be an integer in
            [1, 16], got 17"``.
    """

    SCHEME: ClassVar[str] = "thc"
    PRIMARY: ClassVar[str] = "bits"  # the option a bare first value sets ("thc:VALUE")
    bits: int = option(4, kind="integer", lo=1, hi=16, harder="down",
                       doc="bits per level: 2^bits - 1 levels above 0 (THC's 4, which may shrink "
                           "under lane_bits); any other value is kept at every world size")
    lane_bits: Optional[int] = option(8, kind="integer", lo=2, hi=32, optional=True, harder="down",
                       doc="int32 bits a coordinate takes: levels of bits=4 shrink with the world "
                           "size to keep 32 // lane_bits lanes a word; other bits widen the default "
                           "8 (refused with other values); none: lanes as wide as the levels need")
    rotation: str = option("partial", kind="choice", choices=("partial", "full"),
                           doc="Hadamard rotation in blocks of 2^rotation_stages (partial) or in "
                               "one block of next_pow2(d), up to 2x padding (full)")
    rotation_stages: int = option(10, kind="integer", lo=1, hi=30,
                                  doc="butterfly stages k of the partial rotation: blocks of 2^k "
                                      "coordinates, each with its own range")
    saturation: bool = option(True, kind="boolean",
                              doc="clamp at T sigma for a finer grid (true) or aim the range at "
                                  "the block's peak (false)")
    saturation_rate: Optional[float] = option(
        None, kind="number", lo=0.0, hi=0.5, lo_open=True, optional=True,
        doc="fraction of a standard normal clipped (T = 3.297 for 1/1024); larger clips more and "
            "refines the grid; none: by the layout, THC's 1/1024 from 15 levels above 0 up, below "
            "the rate of least clipping plus rounding error of the ranks' mean (bits=2: 0.134 at "
            "2 ranks)")
    range: str = option("previous", kind="choice", choices=("previous", "current"),
                        harder="previous",
                        doc="ranges from the previous step's statistics (one all-reduce) or this "
                            "step's (blocking Max side all-reduce)")
    seed: int = seed_option("seeds the shared rotation and the per-rank rounding; equal on all "
                            "ranks")
    error_feedback: bool = error_feedback_option("keep y - own decoded for the next step")
    subtract_own: bool = option(False, kind="boolean",
                                doc="lanes sized for the other ranks' sum: each rank takes its own "
                                    "words off the reduced ones (mod 2^32) and adds its own levels "
                                    "back; at 2 ranks 4-bit levels in 4-bit lanes, not 5")
    flush: Optional[float] = option(1.0, kind="number", lo=0.0, lo_open=True, optional=True,
                                    doc="error feedback one step may add to a rotated coordinate, "
                                        "times the range the block's gradient alone wants: bounds "
                                        "the burst after a drop in gradient scale; none: no bound")

    def __post_init__(self):
        validate(self)

    def fixed_levels(self) -> bool:
        """True if the levels are ``2**bits - 1`` at every world size: ``bits`` is not its
        default 4 (a choice made, to be honoured), or ``lane_bits`` is None."""
        return self.bits != type(self).bits or self.lane_bits is None


class THCState(NamedTuple):
    residual: object  # float32 [P]: error feedback in the rotated basis ([0] without it)
    ranges: object  # float32 [nb]: the agreed range R of each block for the next step
    diag: object  # float32 [P]: the fixed rotation diagonal +-1/sqrt(B) (a constant, kept)
    step: object  # int64 []: steps completed, equal on all ranks (keys rounding, fingerprint)
    saturated: object  # int64 []: rotated coordinates clipped at +-R in the last step (this rank)
    realigned: object  # int64 []: steps whose output was 0 because ranks' states disagreed


class Layout(NamedTuple):
    """Static sizes of one tensor's payload (all ints)."""

    block: int  # B
    padded: int  # P
    blocks: int  # nb
    levels: LaneLayout  # lanes of the levels
    words: int  # int32 words of levels: m = ceil(P / lanes)
    stats: LaneLayout  # lanes of the block statistics (code, flag)
    stats_words: int  # int32 words of statistics (0 with range="current")
    fingerprint_bits: int  # h: s < 2**h


class _THCCtx(NamedTuple):
    """What decompress and finish need from compress (and, from ``count`` on, from receive)."""

    ranges: object  # float32 [nb]: R used this step
    residual: object  # float32 [P]: e' (None without error feedback)
    corrected: object  # float32 [P]: y, kept when the step is realigned
    saturated: object  # int64 []
    diag: object  # float32 [P]
    hmat: object  # float32 [s, s]: the largest Sylvester factor of B (hadamard.nested_factors)
    count: object = None  # int64 []: contributing ranks
    bad: object = None  # int64 []: ranks whose gradient was not finite
    mismatch: object = None  # bool []: the ranks' step fingerprints disagree
    inferred: object = None  # bool []: the count word says Sum (used when the op is unknown)
    held: object = None  # float32 [P]: error feedback held back by the flush bound (step 1), or None
    own: object = None  # int32 [m]: this rank's level words as sent (subtract_own), or None


class THCScheme(Scheme):
    """THC with exact int32 lanes on a Sum/Average all-reduce (module docstring, steps 1-8).

    The arithmetic is in kernels that the backends may compile or replace by fused forms
    (``Primitives.fuse``): ``_encode_kernel`` (steps 1-5; with ``range="current"`` its parts
    ``_rotate_kernel``, ``_noise_kernel`` and ``_quantize_kernel`` around the side all-reduce),
    ``_receive_kernel``, ``_decode_kernel`` (with an engine's ``1 / n`` folded in, written into
    its bucket: :func:`~hvd_gradcomp.composite.decompress_into`) and ``_finish_kernel``; the
    methods here hold the Python-side sizes and keys.
    """

    name = "thc"
    flattens = True  # a vector's math: a bucket's tensors go as one (buckets.py)
    # Tensors below this many coordinates go as fp16 (routing): THC's 4 control words and
    # ranges outweigh its saving on them.
    min_numel = 1024
    scalable = False  # integer payload: Horovod's scale factors would corrupt it
    # No separate finite check (compress gets finite=None): every NaN/inf of the gradient
    # reaches its block's range (step 2), which makes the rank's "not finite" control word say
    # so; and so does a block whose squares overflow float32, which the gradient's sum may not.
    guards_nonfinite = False

    def __init__(self, config: THCConfig = THCConfig()):
        self.config = config
        self.blocking = config.range == "current"
        self._round_keys = {}
        self._layouts = {}  # (numel, world size, op) -> Layout: four lookups a step per tensor

    # ---- static sizes ----
    def layout(self, info: TensorInfo) -> Layout:
        """The payload layout of a tensor (module docstring, step 5).

        ``bits`` other than its default 4 is honoured at every world size: where the lanes of
        the default ``lane_bits`` (8) cannot hold ``2**bits - 1`` levels summed over ``n``
        ranks, they widen (``lane_bits=None``'s layout); with another ``lane_bits`` that cannot,
        the pair is refused.

        Raises:
            ValueError: no lane fits; or ``bits`` other than 4 with a ``lane_bits`` other than
                8 whose lanes cannot hold ``2**bits - 1`` levels at this world size and op
                (neither option is weakened), naming both options.
        """
        key = (info.numel, info.world_size, info.op)
        lay = self._layouts.get(key)
        if lay is None:
            lay = self._layouts[key] = self._layout(info)
        return lay

    def _layout(self, info: TensorInfo) -> Layout:
        cfg, n = self.config, info.world_size
        block = hadamard.block_size(info.numel, None if cfg.rotation == "full" else cfg.rotation_stages)
        padded = hadamard.padded_size(info.numel, block)
        own = cfg.subtract_own
        levels = lane_layout(cfg.bits, n, cfg.lane_bits, info.op, subtract_own=own)
        if cfg.fixed_levels() and levels.top < (1 << cfg.bits) - 1:
            wide = lane_layout(cfg.bits, n, None, info.op, subtract_own=own)
            if cfg.lane_bits != type(cfg).lane_bits:
                raise ValueError(
                    f"thc: bits={cfg.bits} ({(1 << cfg.bits) - 1} levels a rank) and lane_bits={cfg.lane_bits} "
                    f"({32 // cfg.lane_bits} lanes a word) do not fit together at {n} ranks under "
                    f"{info.op or 'an unknown op'}: those lanes hold at most {levels.top} levels here; set "
                    f"lane_bits=none or leave it unset (lanes widen for bits: {32 / wide.lanes:.2f} bits a "
                    f"coordinate), or leave bits at its default {type(cfg).bits} (levels follow the world size)")
            levels = wide  # lane_bits at its default gives way to the bits asked for
        if levels.top == 1 and cfg.error_feedback and (n, cfg.bits, cfg.lane_bits) not in _WARNED:
            _WARNED.add((n, cfg.bits, cfg.lane_bits))
            log.warning("thc: at %d ranks its %s-bit lanes hold 1 level a rank above zero (%s), and error "
                        "feedback at 1 level can run away (docs/scale.md: default THC's perplexity turned NaN "
                        "at 32 ranks on lm-comm); use thc:error_feedback=false, or bits=2 (4 levels, the lanes "
                        "widen), or lane_bits=none", n, cfg.lane_bits, info.key)
        stats = stats_layout(n, levels.guard)
        stats_words = 0 if self.blocking else -(-2 * (padded // block) // stats.lanes)
        h = min(13, (31 - levels.guard - n.bit_length()) // 2)
        return Layout(block, padded, padded // block, levels, -(-padded // levels.lanes),
                      stats, stats_words, h)

    def threshold(self, top: int, ranks: int) -> float:
        """Step 2's ``T`` for levels ``0..top`` over ``ranks`` ranks: ``saturation_rate``'s
        two-sided normal quantile, or with ``saturation_rate=None`` that of
        :func:`grid_saturation_rate` (the same on every rank: a function of the layout)."""
        rate = self.config.saturation_rate
        return saturation_threshold(grid_saturation_rate(top, ranks) if rate is None else rate)

    def _plan(self, info: TensorInfo, lay: Layout) -> _Plan:
        cfg = self.config
        return _Plan(lay.block, lay.levels, None if self.blocking else lay.stats,
                     self.threshold(lay.levels.top, info.world_size) if cfg.saturation else 0.0,
                     cfg.flush if cfg.error_feedback else None, cfg.error_feedback,
                     info.world_size, info.op)

    def init(self, ops, info: TensorInfo, like):
        lay = self.layout(info)  # ValueError now if no lane fits
        zero = ops.zeros((), "int64", like)
        return THCState(ops.zeros((lay.padded if self.config.error_feedback else 0,), "float32", like),
                        ops.zeros((lay.blocks,), "float32", like),
                        self.rotation_diagonal(ops, info, like), zero, zero, zero)

    def rotation_diagonal(self, ops, info: TensorInfo, like):
        """Step 1's diagonal: float32 [P] of ``+-1/sqrt(B)``, the same on every rank and step."""
        lay = self.layout(info)
        key = rng.stream_key("thc.rotation", self.config.seed, info.key)
        return hadamard.rademacher(ops, key, lay.padded, like, 1.0 / math.sqrt(lay.block))

    def _round_key(self, info: TensorInfo) -> int:
        """Step 3's per-rank rounding key (host side, computed once per tensor and rank)."""
        k = (info.key, info.rank)
        if k not in self._round_keys:
            self._round_keys[k] = rng.stream_key("thc.round", self.config.seed, info.key, info.rank)
        return self._round_keys[k]

    # ---- compress ----
    def compress(self, ops, x, state, info, finite):
        lay = self.layout(info)
        plan = self._plan(info, lay)
        # Step 1's Sylvester matrix, for the forward and inverse rotations (a kernel: a backend
        # may keep it per device instead of building it each call).
        hmat = ops.fuse(hadamard.sylvester, max(hadamard.factor_sizes(lay.block)))(x)
        x = ops.reshape(x, (info.numel,))
        # Per-step keys in a few operations: rng.bits32 hashes its key with every counter, so
        # the rounding key is this rank's static key XOR the step (taken modulo 2**32 by
        # rng.bits32 and every fused form of the noise, so no mask here); the fingerprint is
        # the step's low bits (step 5).
        key = ops.bitwise_xor(state.step, self._round_key(info))
        fingerprint = ops.bitwise_and(state.step, (1 << lay.fingerprint_bits) - 1)
        if self.blocking:
            y, held, wanted, stats_words, finite = ops.fuse(_rotate_kernel, plan)(
                x, state.residual, state.diag, hmat, finite)
            ranges = ops.allreduce(ops.where(ops.isfinite(wanted), wanted, 0.0), "max",
                                   f"hvd_gradcomp.thc.range.{info.key}", info.group)
            rows, cols = ops.fuse(_noise_kernel, plan)(key, ranges)
            payload, residual, saturated = ops.fuse(_quantize_kernel, plan)(
                y, held, ranges, rows, cols, fingerprint, finite, stats_words)
        else:  # steps 1-5 in one kernel (one fused call where the backend has one)
            ranges = state.ranges
            payload, residual, y, held, saturated = ops.fuse(_encode_kernel, plan)(
                x, state.residual, state.diag, hmat, ranges, key, fingerprint, finite)
        # subtract_own: this rank's level words as sent (a copy: Horovod reduces the payload in
        # place), for step 6.
        own = payload[:lay.words] + 0 if lay.levels.others else None
        return payload, _THCCtx(ranges, residual if self.config.error_feedback else None, y, saturated,
                             state.diag, hmat, held=held if plan.flush is not None else None, own=own)

    def receive(self, ops, payload, ctx, info):
        """Step 6's control words, read once for decompress and finish."""
        plan = self._plan(info, self.layout(info))
        count, bad, mismatch, inferred = ops.fuse(_receive_kernel, plan)(payload)
        return ctx._replace(count=count, bad=bad, mismatch=mismatch, inferred=inferred)

    # ---- decompress / finish ----
    def decompress(self, ops, payload, ctx, info):
        """Steps 6-7 (one kernel, ``_decode_kernel``)."""
        return self.decompress_into(ops, payload, ctx, info, 1.0, None)

    def decompress_into(self, ops, payload, ctx, info, factor, into):
        """Steps 6-7 times ``factor``, in the decode's last pass, written into ``into`` where the
        backend's fused form can (:func:`~hvd_gradcomp.composite.decompress_into`): an engine's
        mean lands in its bucket with no multiply or copy after it."""
        plan = self._plan(info, self.layout(info))._replace(factor=factor)
        out = ops.fuse(_decode_kernel, plan)(payload, ctx.ranges, ctx.diag, ctx.hmat, ctx.count,
                                             ctx.bad, ctx.mismatch, ctx.inferred, ctx.own, into)
        return out[:info.numel] if ops.shape(out)[0] > info.numel else out

    def finish(self, ops, payload, ctx, state, info):
        """Step 8: ranges, residual and counters from the all-reduced payload."""
        plan = self._plan(info, self.layout(info))
        ranges, step, realigned, saturated, ok = ops.fuse(_finish_kernel, plan)(
            payload, state.ranges, state.step, state.realigned, state.saturated, ctx.saturated,
            ctx.bad, ctx.mismatch, ctx.inferred)
        mismatch = ctx.mismatch
        residual = state.residual
        if self.config.error_feedback:  # whole tensors chosen, no pass (ops.select)
            whole = (lambda: ctx.corrected + ctx.held) if ctx.held is not None else (lambda: ctx.corrected)
            residual = ops.select(ok, lambda: ops.select(mismatch, whole,
                                                         lambda: ctx.residual),
                                  lambda: state.residual)
        return THCState(residual, ranges, state.diag, step, saturated, realigned)

    def payload_dtype(self, info: TensorInfo) -> str:
        return "int32"

    def sent_zeros(self, ops, ctx):
        """``ctx`` with ``own`` zeroed (:func:`~hvd_gradcomp.composite.sent_zeros`)."""
        return composite.own_zeroed(ctx)

    def scatter_split(self, info: TensorInfo):
        """The ``m`` level words are the values; the statistics and the four control words
        (exact int32 sums) are the agreed part, all that steps 6 and 8 read besides the ctx
        (:func:`~hvd_gradcomp.composite.scatter_split`). None for ``range="current"``, whose
        side all-reduce makes it a two-round scheme."""
        return None if self.blocking else self.layout(info).words

    def wire(self, info: TensorInfo) -> WireBytes:
        lay = self.layout(info)
        payload = 4 * (lay.words + lay.stats_words + _CONTROL)
        return WireBytes(payload, 4 * lay.blocks, 1) if self.blocking else WireBytes(payload)

    def residual_of(self, ops, state, info):
        """The error feedback in the gradient's coordinates: the rotated residual rotated back
        (``irht``) and unpadded, float32 [numel]; None without error feedback."""
        if not self.config.error_feedback:
            return None
        block = self.layout(info).block
        back = hadamard.irht(ops, state.residual, state.diag,
                             hadamard.hadamard_factors(ops, block, state.residual))
        return back[:info.numel] if ops.shape(back)[0] > info.numel else back

    def add_residual(self, ops, state, info, residual):
        """``state`` with ``residual`` (float32 [numel], gradient coordinates) padded, rotated
        (``rht``) and added to the rotated residual; None without error feedback."""
        if not self.config.error_feedback:
            return None
        padded = ops.shape(state.diag)[0]
        rotated = hadamard.rht(ops, _pad(ops, residual, padded, "float32", residual), state.diag,
                               hadamard.hadamard_factors(ops, self.layout(info).block, residual))
        return state._replace(residual=state.residual + rotated)

    def metrics(self, state) -> dict:
        """``{"saturated": int64 [], "realigned": int64 []}``: rotated coordinates clipped in the
        last step (this rank); steps whose output was 0 because the ranks' states disagreed."""
        return {"saturated": state.saturated, "realigned": state.realigned}
