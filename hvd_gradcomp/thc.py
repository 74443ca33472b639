"""THC on a plain all-reduce: rotate, quantise to a few bits, sum integer lanes exactly.

Tensor Homomorphic Compression (Li, Ben Basat, Vargaftik, Lao, Kim, Mitzenmacher, Yu, "THC:
Accelerating Distributed Deep Learning Using Tensor Homomorphic Compression", NSDI 2024) was
built for a parameter server that adds small integers. Here the integers travel through one
Horovod all-reduce instead, packed into int32 lanes wide enough for the sum over all ranks
(the "simple adaptation" of Han et al., HotNets 2024; see ``shared/reference/algorithms.md``).

Steps of ``compress`` (tensor of ``d`` coordinates, world size ``n``, ``L = 2**bits - 1``):
    1. Error feedback: ``c = g + e`` (flat float32 [d]).
    2. Pad ``c`` with zeros to ``P`` coordinates: a multiple of the rotation block ``B``
       (``B = 2**rotation_stages``, or ``next_pow2(d)`` with ``rotation="full"``).
    3. Randomized Hadamard rotation ``y = H_B D c`` blockwise (:mod:`hvd_gradcomp.hadamard`),
       orthonormal; the +-1 diagonal ``D`` comes from the counter-based RNG keyed by
       ``(seed, tensor key, step)``, the same on every rank.
    4. Side collective, one per tensor per step: all-reduce (Max) of float32
       ``[||y||_2, max|y|, not_finite]`` (the norm is sent as 0 without saturation, which does
       not use it); every rank then holds the same norm ``N``, peak ``M`` and a flag that is 1
       if any rank's input (or its rotation) was not finite. Non-finite entries are sent as 0
       and flagged, so Horovod's Max never sees a NaN.
    5. Range ``R``: ``M`` without saturation (the whole range, nothing is clipped); with
       saturation ``min(M, T * sigma)``, ``sigma = N / sqrt(P)`` (the standard deviation a
       rotated coordinate would have if they were Gaussian) and ``T`` the two-sided normal
       quantile of ``saturation_rate`` (3.2971933456919635 for 1/1024, as THC). Coordinates
       with ``|y| > R`` are clipped to ``+-R`` and counted (``metrics()["saturated"]``).
    6. Quantise: ``u = (clip(y) + R) / delta`` with grid step ``delta = 2 R / L`` (times
       ``1 + 2**-20``, so that float rounding never pushes ``u`` above ``L``; ``R`` floored at
       1e-30 in ``delta`` only, so an all-zero tensor gives level 0 and decodes to exactly 0);
       level ``q = floor(u) + [U < u - floor(u)]`` with ``U`` uniform: unbiased stochastic
       rounding, ``E[q] = u``. ``U`` is independent per rank (the key includes the rank) and is
       drawn as ``frac(a_i + b_j)`` over a ``(P/C) x C`` grid from ``P/C + C`` hashed values on
       a ``2**-23`` lattice (exact in float32): each ``U`` is uniform and any two are
       independent, which is all that unbiasedness and the variance of sums need, at a small
       fraction of the cost of hashing every coordinate.
    7. Pack: levels ``0..L`` into int32 words of ``lanes = (31 - g) // w`` lanes of
       ``w = bit_length(n L)`` bits, above ``g = bit_length(n)`` guard bits that are always 0
       (so ``2**g > n``); the sign bit is never used. A lane holds the sum of ``n`` levels,
       at most ``n L < 2**w``: nothing carries into its neighbour.
    8. Append one int32 marker: ``K = 2**10`` when every rank's input was finite (step 4's
       flag), ``-2**21`` otherwise. Payload = ``[words..., marker]``, int32.
    9. Residual: ``e' = c - irht(q delta - R)[:d]``, this rank's own decoded contribution, so
       error feedback absorbs clipping and rounding. The step counter and the residual
       advance only when every rank was finite (all ranks keep the same step, so the same
       rotation; a skipped step leaves everyone's residual as it was).

Steps of ``decompress`` (Horovod has all-reduced the payload with Sum or Average):
    10. Which op? ``Sum`` gives marker ``n K``, ``Average`` gives ``K`` (Horovod scales int32
        by ``1/n`` in double and truncates): the op was Sum iff ``2 marker > K (n + 1)``.
    11. Exact words. Under Sum they are exact. Under Average each word is ``trunc(W * (1/n))``
        with ``W`` the exact sum, which is ``floor(W/n)`` or, when ``n`` divides ``W``, possibly
        ``W/n - 1`` (the double rounding of ``1/n``); either way ``n * avg`` lies in
        ``(W - 2**g, W]`` and ``W`` is a multiple of ``2**g``, so ``W`` is the smallest
        multiple of ``2**g`` that is ``>= n * avg`` (computed in int64).
    12. Unpack the lanes (shift, mask): ``S`` = sum of the ranks' levels per coordinate.
        Value ``S delta - n R`` (Sum) or ``(S / n) delta - R`` (Average), selected with
        ``where`` on the marker: the sum or the mean of the ranks' decoded contributions.
        A negative marker (some rank not finite) makes every value NaN, on every rank.
    13. Inverse rotation, drop the padding, reshape.

Wire per tensor and step (``P`` padded length):
    payload: ``4 * (ceil(P / lanes) + 1)`` bytes of int32 (all-reduced with the caller's op);
    side: 12 bytes (3 float32), one Max all-reduce. Bits per coordinate on the wire:
    ``32 / lanes`` with ``lanes = (31 - bit_length(n)) // bit_length(n (2**bits - 1))``
    (:func:`wire_bits`); lanes x lane width in brackets:

    =====  ============  ============  =============  =============
    bits   n = 2         n = 4         n = 8          n = 16
    =====  ============  ============  =============  =============
    2      3.56 (9x3)    4.57 (7x4)    6.40 (5x5)     8.00 (4x6)
    4      6.40 (5x5)    8.00 (4x6)    10.67 (3x7)    10.67 (3x8)
    8      10.67 (3x9)   16.00 (2x10)  16.00 (2x11)   16.00 (2x12)
    =====  ============  ============  =============  =============

    FP16 is 16 bits per coordinate. The container grows like ``log2(n)``, the known cost of
    carrying THC's integers through an all-reduce; ``bits = 8`` saves nothing from n = 4.

Tensors with fewer than ``min_numel`` coordinates are sent as FP16 (:class:`Fp16Scheme`, pre-
scaled by ``1/n``): below that, the side collective's latency costs more than the bytes saved.

Limits: world size at most 1024 (the marker's sums must fit int32); ``ValueError`` at the first
``compress`` (before any collective) if no lane fits (``bit_length(n) + bit_length(n L) > 31``:
``bits = 16`` from 129 ranks on; ``bits <= 10`` always fits). Horovod's ``gradient_predivide_factor`` and ``prescale_factor``
must stay 1 (they would scale integer words), and ``op`` must be Sum or Average.

References: THC (NSDI 2024) for rotate-clamp-quantise and ``T``; Suresh et al., "Distributed
Mean Estimation with Limited Communication", ICML 2017, for the randomized Hadamard rotation.
"""
import math
from dataclasses import dataclass
from typing import NamedTuple

from . import hadamard, rng
from .base import EmptyState, Scheme, TensorInfo, WireBytes
from .cast import Fp16Scheme

__all__ = ["THCConfig", "THCState", "THCScheme", "saturation_threshold", "lane_layout",
           "wire_bits", "was_summed", "exact_words", "MAX_WORLD_SIZE"]

# Step 8's marker: K per finite rank; BAD per rank otherwise. n*K and n*BAD fit int32 for
# n <= 1024, and one BAD outweighs 1023 K's, so any non-finite rank makes the sum (and the
# truncated average) negative.
_MARKER_OK = 1 << 10
_MARKER_BAD = -(1 << 21)
MAX_WORLD_SIZE = 1024
# Floor of the range in the grid step: keeps L / (2 R) finite for an all-zero tensor.
_TINY_RANGE = 1e-30


def saturation_threshold(rate: float) -> float:
    """``T`` with ``P(|Z| > T) = rate`` for a standard normal ``Z`` (host-side bisection).

    ``saturation_threshold(1 / 1024) == 3.2971933456919635`` to within 1e-15 (THC's constant).
    """
    lo, hi = 0.0, 40.0
    for _ in range(200):  # halves the bracket each time; stops moving after ~60
        mid = 0.5 * (lo + hi)
        if math.erfc(mid / math.sqrt(2.0)) > rate:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


class LaneLayout(NamedTuple):
    """How levels sit in an int32 word (step 7): ``lanes`` lanes of ``width`` bits above ``guard``."""

    lanes: int
    width: int
    guard: int


def lane_layout(bits: int, world_size: int) -> LaneLayout:
    """The int32 layout for ``bits``-bit levels summed over ``world_size`` ranks.

    Raises:
        ValueError: ``world_size`` above ``MAX_WORLD_SIZE``, or no lane fits in 31 bits.
    """
    if world_size > MAX_WORLD_SIZE:
        raise ValueError(f"thc: world size must be at most {MAX_WORLD_SIZE}, got {world_size}")
    top = world_size * ((1 << bits) - 1)
    width, guard = top.bit_length(), world_size.bit_length()
    lanes = (31 - guard) // width
    if lanes < 1:
        raise ValueError(f"thc: bits={bits} with {world_size} ranks needs {guard} guard bits and "
                         f"lanes of {width} bits, more than the 31 of an int32 word; use fewer bits")
    return LaneLayout(lanes, width, guard)


def wire_bits(bits: int, world_size: int) -> float:
    """Payload bits per (padded) coordinate: ``32 / lanes`` (marker and padding not counted)."""
    return 32.0 / lane_layout(bits, world_size).lanes


def was_summed(marker, world_size: int):
    """Step 10: bool 0-d, True if the all-reduce was a Sum (marker ``n K``), False if Average (``K``)."""
    return marker * 2 > _MARKER_OK * (world_size + 1)


def exact_words(ops, words, marker, world_size: int, guard: int):
    """Step 11: the exact int64 sums of the packed words, whichever op Horovod applied.

    Args:
        words: int64 [m], the all-reduced words (sums, or Horovod's truncated averages).
        marker: int64 0-d, the all-reduced marker (see :func:`was_summed`).
        world_size: n.
        guard: guard bits g of the layout (``2**g > n``; exact sums are multiples of ``2**g``).

    Returns:
        int64 [m]: ``words`` under Sum; under Average the smallest multiple of ``2**g`` that is
        ``>= n * words`` (see the module docstring, step 11, for why that is exact).
    """
    scaled = words * world_size + ((1 << guard) - 1)
    recovered = ops.left_shift(ops.right_shift(scaled, guard), guard)
    return ops.where(was_summed(marker, world_size), words, recovered)


@dataclass(frozen=True)
class THCConfig:
    """Options of :class:`THCScheme`.

    Attributes:
        bits: bits per level, ``L = 2**bits - 1`` levels above 0; integer in [1, 16], default
            4 (THC's). Fewer compresses harder; the wire cost is in the module docstring's table.
            Tuning: keep 4 with saturation; try 2 only with error feedback and watch the loss.
        rotation: "partial" (default; blocks of ``2**rotation_stages``) or "full" (one block of
            ``next_pow2(d)``, up to 2x padding on the wire).
        rotation_stages: ``k`` butterfly stages of the partial rotation, integer in [1, 30];
            default 10 (THC's code). Larger mixes more coordinates, costs more time and pads
            to a multiple of ``2**k``. Measured on a 2**22 layer gradient (table in
            ``tests/test_thc.py``): error 0.218/0.201/0.200/0.200/0.182/0.180 at k = 4/8/10/
            12/14/full, WHT 4.4/7.6/10.8/12.7/13.8/25.6 ms; on Gaussian data flat in k.
        saturation: clamp at ``T sigma`` (True, default) or use the whole range (False, the
            simple adaptation). The clamp buys a finer grid with the same bits.
        saturation_rate: fraction of a standard normal clipped, in (0, 0.5]; default 1/1024
            (THC's, ``T = 3.297``). Larger clips more and refines the grid.
        seed: seeds the shared rotation and the per-rank rounding (integer >= 0); default 0.
        error_feedback: keep ``c - own decoded`` for the next step; default True.
        min_numel: tensors with fewer coordinates go as FP16; integer >= 1, default 1024
            (2 KiB in FP16: below that a side collective's latency costs more than the at most
            1.2 KiB that THC would save).

    The simple adaptation is ``THCConfig(rotation="full", saturation=False)``.
    """

    bits: int = 4
    rotation: str = "partial"
    rotation_stages: int = 10
    saturation: bool = True
    saturation_rate: float = 1.0 / 1024
    seed: int = 0
    error_feedback: bool = True
    min_numel: int = 1024

    def __post_init__(self):
        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)
        if not is_int(self.bits) or not 1 <= self.bits <= 16:
            raise ValueError(f"thc: bits must be an integer in [1, 16], got {self.bits!r}")
        if self.rotation not in ("partial", "full"):
            raise ValueError(f"thc: rotation must be 'partial' or 'full', got {self.rotation!r}")
        if not is_int(self.rotation_stages) or not 1 <= self.rotation_stages <= 30:
            raise ValueError(f"thc: rotation_stages must be an integer in [1, 30], "
                             f"got {self.rotation_stages!r}")
        if isinstance(self.saturation_rate, bool) or not isinstance(self.saturation_rate, (int, float)) \
                or not 0.0 < self.saturation_rate <= 0.5:
            raise ValueError(f"thc: saturation_rate must be in (0, 0.5], got {self.saturation_rate!r}")
        if not is_int(self.seed) or self.seed < 0:
            raise ValueError(f"thc: seed must be an integer >= 0, got {self.seed!r}")
        if not is_int(self.min_numel) or self.min_numel < 1:
            raise ValueError(f"thc: min_numel must be an integer >= 1, got {self.min_numel!r}")
        if not isinstance(self.saturation, bool) or not isinstance(self.error_feedback, bool):
            raise ValueError(f"thc: saturation and error_feedback must be True or False, got "
                             f"{self.saturation!r} and {self.error_feedback!r}")


class THCState(NamedTuple):
    residual: object  # float32 [d]: error feedback ([0] when error_feedback=False)
    step: object  # int64 []: steps compressed so far, equal on all ranks (keys the rotation)
    saturated: object  # int64 []: rotated coordinates clipped at +-R in the last step (this rank)


class _Ctx(NamedTuple):
    """What decompress needs from compress (tensors of this step)."""

    diag: object  # float32 [P]: the rotation's +-1/sqrt(B) diagonal
    factors: list  # hadamard_factors(B)
    top: object  # float32 []: R, the grid's upper end (its lower end is -R)
    delta: object  # float32 []: grid step 2 max(R, 1e-30) / L


class THCScheme(Scheme):
    """THC with exact int32 lanes on a Sum/Average all-reduce (module docstring, steps 1-13)."""

    name = "thc"
    # Step and residual advance only if every rank was finite (the side collective says so).
    masks_own_state = True

    def __init__(self, config: THCConfig = THCConfig()):
        self.config = config
        self._fp16 = Fp16Scheme()
        self._threshold = saturation_threshold(config.saturation_rate)

    # ---- static sizes ----
    def _tiny(self, info: TensorInfo) -> bool:
        return info.numel < self.config.min_numel

    def _sizes(self, info: TensorInfo):
        """(B, P, layout, words): block, padded length, lane layout, int32 words of levels."""
        cfg = self.config
        block = hadamard.block_size(info.numel, None if cfg.rotation == "full" else cfg.rotation_stages)
        padded = hadamard.padded_size(info.numel, block)
        layout = lane_layout(cfg.bits, info.world_size)
        return block, padded, layout, -(-padded // layout.lanes)

    def init(self, ops, info: TensorInfo, like):
        if self._tiny(info):
            return EmptyState()
        self._sizes(info)  # ValueError now if no lane fits
        return THCState(ops.zeros((info.numel if self.config.error_feedback else 0,), "float32", like),
                        ops.zeros((), "int64", like), ops.zeros((), "int64", like))

    def _side_name(self, info):
        return f"hvd_gradcomp.thc.scale.{info.key}"

    def rotation_diagonal(self, ops, info: TensorInfo, step, like):
        """Step 3's diagonal: float32 [P] of ``+-1/sqrt(B)``, the same on every rank.

        Args:
            step: int64 0-d tensor, the state's step counter.
        """
        block, padded, _, _ = self._sizes(info)
        key = rng.step_key(ops, rng.stream_key("thc.rotation", self.config.seed, info.key), step)
        return hadamard.rademacher(ops, key, padded, like, 1.0 / math.sqrt(block))

    def _uniform(self, ops, info, step, padded, like):
        """float32 [P] pairwise-independent uniforms on a 2**-23 lattice (step 6), per rank."""
        cols = hadamard.next_pow2(math.isqrt(padded))
        rows = -(-padded // cols)
        key = rng.step_key(ops, rng.stream_key("thc.round", self.config.seed, info.key, info.rank), step)
        lattice = ops.cast(ops.right_shift(rng.bits32(ops, key, rows + cols, like), 9), "float32") * (2.0 ** -23)
        u = ops.reshape(lattice[:rows], (rows, 1)) + ops.reshape(lattice[rows:], (1, cols))
        u = ops.reshape(u - ops.floor(u), (rows * cols,))  # sums < 2 on a 2**-23 lattice: exact
        return u[:padded] if rows * cols > padded else u

    def compress(self, ops, x, state, info, finite):
        if self._tiny(info):
            return self._fp16.compress(ops, x, state, info, finite)
        cfg = self.config
        block, padded, layout, words = self._sizes(info)
        levels_max = (1 << cfg.bits) - 1
        d = info.numel
        # Step 1.
        corrected = ops.reshape(x, (d,))
        if cfg.error_feedback:
            corrected = corrected + state.residual
        # Step 2.
        c = ops.concat([corrected, ops.zeros((padded - d,), "float32", x)], 0) if padded > d else corrected
        # Step 3: shared diagonal, +-1/sqrt(B) so the rotation is orthonormal.
        diag = self.rotation_diagonal(ops, info, state.step, x)
        factors = hadamard.hadamard_factors(ops, block, x)
        y = hadamard.rht(ops, c, diag, factors)
        # Step 4: NaN must not reach Horovod's Max, so each entry is sanitised and flagged.
        magnitude = ops.abs(y)
        peak = ops.max(magnitude, None)
        # A NaN/inf anywhere makes these sums non-finite (Max itself may drop NaNs); without
        # saturation the norm is not needed and the cheaper sum of magnitudes is checked.
        check = ops.sum(y * y, None) if cfg.saturation else ops.sum(magnitude, None)
        ok_local = ops.logical_and(finite, ops.isfinite(check))
        norm = ops.where(ok_local, ops.sqrt(check), 0.0) if cfg.saturation else ops.zeros((), "float32", x)
        side = ops.concat([ops.reshape(norm, (1,)),
                           ops.reshape(ops.where(ok_local, peak, 0.0), (1,)),
                           ops.reshape(ops.where(ok_local, 0.0, 1.0), (1,))], 0)
        agreed = ops.allreduce(side, "max", self._side_name(info))
        ok = agreed[2] < 0.5
        # Step 5.
        top = agreed[1]
        if cfg.saturation:
            top = ops.minimum(top, agreed[0] * (self._threshold / math.sqrt(padded)))
            clipped = ops.minimum(ops.maximum(y, -top), top)
            saturated = ops.sum(ops.cast(magnitude > top, "int64"), None)
        else:  # R is the largest |y| of all ranks: nothing to clip
            clipped, saturated = y, ops.zeros((), "int64", x)
        # Step 6: grid of L + 1 points from -R with step delta; unbiased stochastic rounding.
        # delta is widened by 2**-20 so that u <= L despite rounding (no clamp pass needed).
        delta = ops.maximum(top, _TINY_RANGE) * (2.0 * (1.0 + 2.0 ** -20) / levels_max)
        u = (clipped + top) / delta
        low = ops.floor(u)
        uniform = self._uniform(ops, info, state.step, padded, x)
        q = low + ops.cast(uniform < u - low, "float32")
        q = ops.where(ok, q, 0.0)  # NaN levels would be undefined integers
        # Step 7.
        lanes, width, guard = layout
        slots = words * lanes
        levels = ops.cast(q, "int32")
        if slots > padded:
            levels = ops.concat([levels, ops.zeros((slots - padded,), "int32", x)], 0)
        shifts = ops.constant([guard + j * width for j in range(lanes)], "int32", x)
        packed = ops.sum(ops.left_shift(ops.reshape(levels, (words, lanes)), shifts), 1)
        # Step 8.
        marker = ops.reshape(ops.where(ok, float(_MARKER_OK), float(_MARKER_BAD)), (1,))
        payload = ops.concat([ops.cast(packed, "int32"), ops.cast(marker, "int32")], 0)
        # Step 9.
        new_state = state._replace(step=state.step + ops.cast(ok, "int64"),
                                   saturated=ops.where(ok, saturated, state.saturated))
        if cfg.error_feedback:
            own = hadamard.irht(ops, q * delta - top, diag, factors)
            residual = corrected - (own[:d] if padded > d else own)
            new_state = new_state._replace(residual=ops.where(ok, residual, state.residual))
        return payload, _Ctx(diag, factors, top, delta), new_state

    def decompress(self, ops, payload, ctx, info):
        if self._tiny(info):
            return self._fp16.decompress(ops, payload, ctx, info)
        n = info.world_size
        block, padded, (lanes, width, guard), words = self._sizes(info)
        whole = ops.cast(payload, "int64")  # Horovod may hand back another dtype under Average
        marker = whole[words]
        # Steps 10-11.
        summed = was_summed(marker, n)
        exact = ops.cast(exact_words(ops, whole[:words], marker, n, guard), "int32")  # < 2**31
        # Step 12.
        shifts = ops.constant([guard + j * width for j in range(lanes)], "int32", payload)
        lane_sums = ops.bitwise_and(ops.right_shift(ops.reshape(exact, (words, 1)), shifts), (1 << width) - 1)
        total = ops.cast(ops.reshape(lane_sums, (words * lanes,)), "float32")
        if words * lanes > padded:
            total = total[:padded]
        share = ops.where(summed, 1.0, 1.0 / n)  # 1 for the sum, 1/n for the mean
        offset = ctx.top * (share * n) + ops.where(marker < 0, float("nan"), 0.0)
        values = total * (ctx.delta * share) - offset
        # Step 13.
        out = hadamard.irht(ops, values, ctx.diag, ctx.factors)
        return out[:info.numel] if padded > info.numel else out

    def wire(self, info: TensorInfo) -> WireBytes:
        if self._tiny(info):
            return self._fp16.wire(info)
        _, _, _, words = self._sizes(info)
        return WireBytes(4 * (words + 1), 12, 1)

    def metrics(self, state) -> dict:
        """``{"saturated": int64 []}``: rotated coordinates clipped in the last step (this rank)."""
        if not len(state):
            return {}
        return {"saturated": state.saturated}
