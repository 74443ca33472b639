"""signSGD with error feedback on one all-reduce of integer lanes.

EF-SignSGD (Karimireddy, Rebjock, Stich, Jaggi, "Error Feedback Fixes SignSGD and other
Gradient Compression Schemes", ICML 2019, Algorithm 1) sends ``Delta = (||p||_1 / d) sign(p)``
for ``p = g + e`` and keeps ``e' = p - Delta``. Here every rank sends only the signs, one bit
each in int32 lanes wide enough for the sum over all ranks (:mod:`hvd_gradcomp.lanes`), and
the ranks agree on one scale ``S`` per tensor and step, carried as a log code in the same
payload, so the sum of the ranks' contributions ``S sign(p_i)`` is ``S`` times the summed
signs: one all-reduce, no side collective, no state the ranks must agree on between steps.

Notation: ``d`` coordinates, world size ``n``, ``g`` guard bits (0 under a known Sum, else
``bit_length(n)``), lanes of ``w = bit_length(n)`` bits, ``lanes`` a word: as many as keep
the sum of ``n`` words below ``2**31`` (:func:`~hvd_gradcomp.lanes.lane_layout` with 1-bit
levels, ``centred=False``: no offset, so the ``d`` lane sums unpack in int32, at the cost of
at most one lane a word).

Steps of ``compress`` (no collective):
    1. ``p = g + e`` (float32 [d]; ``e`` the residual, 0 without error feedback). This rank's
       gradient counts as not finite if ``sum |p|`` is not (a NaN/inf, or finite values
       summing beyond float32).
    2. This rank's scale ``s = ||p||_1 / d`` (the paper's), as a log code
       ``clamp(round(4 log2 s) + 512, 1, 1023)`` (quarter octaves over float32's range; 0 and a
       "has data" flag of 0 when ``s <= 1e-30`` or the gradient is not finite).
    3. Bits ``b = [p >= 0]`` (a NaN gives 0: never a carry), packed planar into the lanes
       (:func:`~hvd_gradcomp.lanes.pack`), then four control words above ``g`` guard bits
       (:func:`~hvd_gradcomp.lanes.control_words`): 1 (contributes), 1 if not finite, the
       code, the flag.

Horovod all-reduces the int32 words with Sum or Average.

Steps of ``decompress`` / ``finish``:
    4. Exact sums of the control words and lanes (:func:`~hvd_gradcomp.lanes.read_control`,
       :func:`~hvd_gradcomp.lanes.exact_words`: Average's truncated words are recovered
       exactly). ``c`` contributing ranks, ``V`` per coordinate the ranks with ``p >= 0``, so
       the summed signs are ``2 V - c``. When the op is unknown (a hand-made call) the count
       word tells Sum from Average (full participation assumed).
    5. The agreed scale ``S = 2**((mean code - 512) / 4)`` over the ranks with data (a
       geometric mean of their ``s``; 0 if none had data), the same on every rank. Output
       ``S (2 V - c)``, divided by ``n`` under Average; NaN everywhere if some rank was not
       finite.
    6. ``finish``: ``e' = p - S sign(p)`` (``sign(0) = +1``), what this rank contributed
       taken off; when some rank was not finite the state stays as it was.

Why one agreed scale: the paper's scale is per worker, but a sum of integer signs can carry
only one. The scale of this very step (from the codes in the payload) is used, not the
previous step's, so nothing is stale and nothing needs agreeing between steps. Data-parallel
ranks' ``s`` are close (the same model, batches from one distribution); where a rank's ``s``
differs from ``S``, error feedback keeps the difference and sends it later, as it does for
the paper's own scale (its Theorem II holds for any compressor with
``||C(p) - p||**2 <= (1 - delta) ||p||**2``; this one is such a compressor while ``S < 2 s``).

Wire per tensor and step: ``4 (ceil(d / lanes) + 4)`` bytes of int32 in the one all-reduce:
``32 / lanes`` bits a coordinate (2.13 under Sum and 2.29 under Average at 2 ranks, 5.33
under Average at 8). Integer payload: Horovod's prescale/postscale factors must stay 1 and the op
must be Sum or Average (the adapters refuse the rest, before any collective).

Errors: ValueError for a world size above 1024 (:data:`~hvd_gradcomp.lanes.MAX_WORLD_SIZE`),
at ``init``, before any collective. Measured: ``docs/signsgd.md``.
"""
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from .base import EmptyState, Scheme, TensorInfo, WireBytes, commit
from .lanes import control_words, exact_words, lane_layout, pack, read_control, says_sum, unpack
from .options import error_feedback_option, validate

__all__ = ["SignSGDConfig", "SignSGDState", "SignSGDScheme"]

# The scale's log code (step 2): round(4 log2 s) + 512 in [1, 1023], 10 bits, so n <= 1024
# ranks' sum stays below 2**20 and fits one word above 11 guard bits.
_CODE_SCALE, _CODE_OFFSET, _CODE_MAX = 4.0, 512.0, 1023.0
_TINY = 1e-30  # a scale at or below this has no data (2**-127.75 is the smallest code)
_CONTROL = 4  # contributes, not finite, code, has data


@dataclass(frozen=True)
class SignSGDConfig:
    """Options of :class:`SignSGDScheme` (:mod:`hvd_gradcomp.options`; ``python -m
    hvd_gradcomp --list`` lists them).

    Raises:
        ValueError: an option of the wrong kind, e.g. ``"signsgd: error_feedback must be true
            or false, got 'maybe'"``.
    """

    SCHEME: ClassVar[str] = "signsgd"
    error_feedback: bool = error_feedback_option("keep g + e - S sign(g + e) for the next step "
                                                 "(EF-SignSGD); false: plain scaled signSGD")

    def __post_init__(self):
        validate(self)


class SignSGDState(NamedTuple):
    residual: object  # float32 [d]: this rank's error feedback e


class _Ctx(NamedTuple):
    corrected: object  # float32 [d]: p = g + e
    nonneg: object  # int32 [d]: 1 where p >= 0 (the bits sent)
    count: object = None  # int64 []: contributing ranks c (receive)
    bad: object = None  # int64 []: ranks whose gradient was not finite
    scale: object = None  # float32 []: the agreed S
    summed: object = None  # Python bool (op known) or bool []: Horovod applied Sum


class SignSGDScheme(Scheme):
    """EF-SignSGD with one agreed scale per tensor and step (module docstring, steps 1-6)."""

    name = "signsgd"
    scalable = False  # integer payload: Horovod's scale factors would corrupt it

    def __init__(self, config: SignSGDConfig = SignSGDConfig()):
        self.config = config

    def _layout(self, info: TensorInfo):
        return lane_layout(1, info.world_size, None, info.op, scheme=self.name, centred=False)

    def init(self, ops, info: TensorInfo, like):
        self._layout(info)  # ValueError now for a world size above 1024
        if not self.config.error_feedback:
            return EmptyState()
        return SignSGDState(ops.zeros((info.numel,), "float32", like))

    def compress(self, ops, x, state, info, finite):
        lay = self._layout(info)
        p = ops.reshape(x, (info.numel,))
        if self.config.error_feedback:
            p = p + state.residual
        # Steps 1-2: the scale and whether this rank's p is finite, from one reduction.
        total = ops.sum(ops.abs(p), None)
        finite = ops.logical_and(finite, ops.isfinite(total))
        s = total * (1.0 / info.numel)
        usable = ops.logical_and(finite, s > _TINY)
        code = ops.round(ops.log2(ops.where(usable, s, 1.0)) * _CODE_SCALE) + _CODE_OFFSET
        code = ops.where(usable, ops.clip(code, 1.0, _CODE_MAX), 0.0)
        # Step 3: one bit a coordinate in the lanes, then the control words.
        nonneg = ops.cast(p >= 0.0, "int32")
        bits = pack(ops, nonneg, lay)
        ok = ops.cast(finite, "int64")
        flags = (ok * 0 + 1, 1 - ok, ops.cast(code, "int64"), ops.cast(usable, "int64"))
        payload = ops.concat([bits, control_words(ops, flags, lay.guard)], 0)
        return payload, _Ctx(p, nonneg)

    def receive(self, ops, payload, ctx, info):
        """Step 4's control words and step 5's scale, read once for decompress and finish."""
        lay = self._layout(info)
        tail = ops.cast(payload[ops.shape(payload)[0] - _CONTROL:], "int64")
        summed = info.op == "sum" if info.op is not None else says_sum(tail[0], lay.guard)
        control = read_control(ops, tail, summed, info.world_size, lay.guard)
        count, bad, codes, have = control[0], control[1], control[2], control[3]
        mean = ops.cast(codes - have * int(_CODE_OFFSET), "float32") / ops.maximum(ops.cast(have, "float32"), 1.0)
        scale = ops.where(have > 0, ops.exp2(mean * (1.0 / _CODE_SCALE)), 0.0)
        return ctx._replace(count=count, bad=bad, scale=scale, summed=summed)

    def decompress(self, ops, payload, ctx, info):
        lay, d = self._layout(info), info.numel
        words = ops.shape(payload)[0] - _CONTROL
        exact = exact_words(ops, ops.cast(payload[:words], "int64"), ctx.summed, info.world_size, lay.guard)
        # Uncentred lanes: the exact sums are below 2**31, so d values unpack in int32.
        lanes = unpack(ops, ops.cast(exact, "int32"), lay)
        positive = ops.cast(lanes[:d] if lay.lanes * words > d else lanes, "float32")
        n = info.world_size
        if isinstance(ctx.summed, bool):
            factor = ctx.scale if ctx.summed else ctx.scale * (1.0 / n)
        else:
            factor = ctx.scale * ops.where(ctx.summed, 1.0, 1.0 / n)
        factor = factor + ops.where(ctx.bad > 0, float("nan"), 0.0)
        # S (2 V - c) (times 1/n under Average) in two passes over the float32 counts V.
        return positive * (factor * 2.0) - ops.cast(ctx.count, "float32") * factor

    def finish(self, ops, payload, ctx, state, info):
        """Step 6: ``e' = p - S sign(p)``, kept only when every rank was finite."""
        if not self.config.error_feedback:
            return state
        # p - S (2 b - 1) = (p + S) - 2 S b, in float passes (a where on the bits is slower).
        left = (ctx.corrected + ctx.scale) - ops.cast(ctx.nonneg, "float32") * (ctx.scale * 2.0)
        return commit(ops, ctx.bad == 0, SignSGDState(left), state)

    def payload_dtype(self, info: TensorInfo) -> str:
        return "int32"

    def wire(self, info: TensorInfo) -> WireBytes:
        return WireBytes(4 * (-(-info.numel // self._layout(info).lanes) + _CONTROL))
